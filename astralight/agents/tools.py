"""Tools an agent calls: plain Python callables, their JSON schemas, parsing and running calls.

A tool is a function, or a class whose instances are callable, named by import path in a config
(``tools: [pkg.mod.add, {class_path: pkg.mod.Search, init_args: {...}, timeout_s: 5}]``). Its
schema comes from its signature and Google-style docstring through transformers'
``get_json_schema`` (the schema chat templates take as ``tools``), so there is nothing to declare
twice. The model calls tools in the Qwen3/Hermes format, ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``; :func:`parse_tool_calls` reads every such block of a turn.

Nothing a tool or the model does crashes an episode: a malformed block, an unknown tool, wrong
arguments, a raised exception and a timeout each become an error message to the model (its tool
result) and are counted by kind (:data:`astralight.agents.stats.ERROR_KINDS`).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from astralight.workflows.base import blocking

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
#: a result longer than this is cut (and says so), so one tool cannot fill the context
DEFAULT_MAX_RESULT_CHARS = 2000


@dataclass
class ToolCall:
    """One parsed call: the tool's name and arguments, or ``error`` (kind, message) when the
    block could not be read."""

    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: tuple[str, str] | None = None


@dataclass
class ToolResult:
    """What a call returned to the model (``content``) and, when it failed, the error kind."""

    name: str
    content: str
    error: str | None = None

    def message(self) -> dict:
        """The tool message the chat template renders."""
        return {"role": "tool", "name": self.name, "content": self.content}


class Tool:
    """A callable with a name, a JSON schema and a timeout.

    Args:
        fn: the function (or callable instance) run with the call's arguments as keywords.
        name: the name the model calls it by (default: the function's or class's name).
        timeout_s: most seconds a call may take; a slower call is reported to the model as a
            timeout (the thread running it cannot be killed and finishes in the background).
        schema: the OpenAI-style schema; by default derived from ``fn``'s signature and
            docstring (every argument needs a type hint and an ``Args:`` line).
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None, timeout_s: float = 10.0,
                 schema: dict | None = None):
        if not callable(fn):
            raise TypeError(f"tool: expected a callable, got {type(fn).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0 seconds, got {timeout_s}")
        self.fn = fn
        self.timeout_s = float(timeout_s)
        target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
        self.name = name or getattr(fn, "__name__", None) or type(fn).__name__
        self.schema = schema or _schema(target, self.name)
        self.schema["function"]["name"] = self.name
        self.is_async = inspect.iscoroutinefunction(target)

    async def __call__(self, arguments: dict) -> Any:
        if self.is_async:
            return await asyncio.wait_for(self.fn(**arguments), self.timeout_s)
        return await asyncio.wait_for(blocking(self.fn, **arguments), self.timeout_s)


def _schema(fn: Callable[..., Any], name: str) -> dict:
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as exc:
        raise ValueError(f"tools.{name}: cannot derive its JSON schema ({exc}); give every "
                         "argument a type hint and an 'Args:' docstring line, or pass schema") from None
    props = schema["function"].get("parameters", {}).get("properties", {})
    props.pop("self", None)
    return schema


def load_tool(spec: Any) -> Tool:
    """A :class:`Tool` from a config entry: a Tool, a callable, an import path of a function or
    class, or ``{class_path | function, init_args, name, timeout_s, schema}``."""
    if isinstance(spec, Tool):
        return spec
    if isinstance(spec, str):
        spec = {"class_path": spec}
    if isinstance(spec, dict):
        known = {"class_path", "function", "init_args", "name", "timeout_s", "schema"}
        unknown = set(spec) - known
        if unknown:
            raise ValueError(f"tools: unknown keys {sorted(unknown)} in {spec}; known: {sorted(known)}")
        path = spec.get("class_path") or spec.get("function")
        if not path:
            raise ValueError(f"tools: an entry needs class_path (or function), got {spec}")
        obj = _import(path)
        if inspect.isclass(obj):
            obj = obj(**dict(spec.get("init_args") or {}))
        elif spec.get("init_args"):
            raise ValueError(f"tools.{path}: init_args is for classes; {path} is a function")
        return Tool(obj, name=spec.get("name"), timeout_s=float(spec.get("timeout_s", 10.0)),
                    schema=spec.get("schema"))
    if callable(spec):
        return Tool(spec)
    raise TypeError(f"tools: expected an import path, a dict or a callable, got {type(spec).__name__}")


def _import(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError(f"tools: expected an import path like pkg.module.name, got {path!r}")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tools: cannot import {path!r} ({exc})") from None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` block of ``text``, in order; an unclosed
    ``<tool_call>`` or a block that is not ``{"name": str, "arguments": object}`` becomes a
    call with ``error=("malformed", why)``."""
    head, tail = split_at_last_close(text)
    calls = [_parse_one(m.group(1)) for m in _TOOL_CALL.finditer(head)]
    if not calls:
        tail = text
    if "<tool_call>" in tail:
        calls.append(ToolCall(error=("malformed", "<tool_call> without </tool_call>")))
    return calls


def split_at_last_close(text: str) -> tuple[str, str]:
    """``text`` cut after its last ``</tool_call>`` (``("", text)`` when it has none).

    Why: the block regex is only ever run on the head, where every ``<tool_call>`` has a close
    after it, so it finds each block in one pass. On the whole text, each unclosed
    ``<tool_call>`` of the tail makes it scan to the end of the text and fail: quadratic in a
    long completion (thousands of them), inside one regex call that holds the interpreter lock,
    so it would freeze every thread of the RaaS, its event loop included."""
    end = text.rfind("</tool_call>")
    if end < 0:
        return "", text
    end += len("</tool_call>")
    return text[:end], text[end:]


def _loads(text: str) -> Any:
    """``json.loads``, with what it raises besides a syntax error turned into one ValueError: a
    nesting deeper than the interpreter's recursion limit (``RecursionError`` at about 1,000
    levels) and an integer longer than Python's digit limit (a ``ValueError`` that is not a
    ``JSONDecodeError``). A model can write either; neither may crash the episode."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at {exc.pos})") from None
    except RecursionError:
        raise ValueError("not JSON we read (nested too deeply)") from None
    except ValueError as exc:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise ValueError(f"not JSON we read ({str(exc)[:80]})") from None


def _parse_one(body: str) -> ToolCall:
    try:
        obj = _loads(body.strip())
    except ValueError as exc:
        return ToolCall(error=("malformed", str(exc)))
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(error=("malformed", 'expected {"name": "...", "arguments": {...}}'))
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = _loads(args)
        except ValueError:
            return ToolCall(name=obj["name"], error=("malformed", "arguments is not a JSON object"))
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], error=("malformed", "arguments is not a JSON object"))
    return ToolCall(name=obj["name"], arguments=args)


class ToolBox:
    """The tools of one workflow, by name: their schemas for the template, and :meth:`call`."""

    def __init__(self, tools: list[Any], max_result_chars: int = DEFAULT_MAX_RESULT_CHARS):
        loaded = [load_tool(t) for t in tools]
        self.tools: dict[str, Tool] = {}
        for tool in loaded:
            if tool.name in self.tools:
                raise ValueError(f"tools: two tools are named {tool.name!r}; set name on one")
            self.tools[tool.name] = tool
        if max_result_chars < 1:
            raise ValueError(f"max_result_chars: must be >= 1, got {max_result_chars}")
        self.max_result_chars = int(max_result_chars)

    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; every failure becomes an error result (never an exception)."""
        if call.error is not None:
            kind, why = call.error
            return ToolResult(call.name or "?", f"error: malformed tool call: {why}", kind)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call.name, f"error: unknown tool {call.name!r}; tools: "
                              f"{', '.join(self.tools) or 'none'}", "unknown_tool")
        try:
            inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as exc:
            return ToolResult(call.name, f"error: bad arguments: {exc}", "bad_arguments")
        try:
            out = await tool(call.arguments)
        except asyncio.TimeoutError:
            return ToolResult(call.name, f"error: {call.name} timed out after {tool.timeout_s:g} s",
                              "timeout")
        except Exception as exc:  # noqa: BLE001 - the model sees the error, the episode goes on
            return ToolResult(call.name, f"error: {type(exc).__name__}: {exc}", "exception")
        return ToolResult(call.name, self._text(out))

    def _text(self, out: Any) -> str:
        if isinstance(out, str):
            text = out
        else:
            try:
                text = json.dumps(out, ensure_ascii=False, default=str)
            except (TypeError, ValueError):
                text = str(out)
        if len(text) > self.max_result_chars:
            text = text[: self.max_result_chars] + " ...(truncated)"
        return text
