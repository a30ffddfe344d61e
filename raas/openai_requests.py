"""What the OpenAI endpoint accepts: the request body, read with a size cap and validated field by
field into a :class:`ChatRequest` (:func:`parse_request`), and :class:`RequestError`, the refusal
in OpenAI's error layout that every route answers with.

``stream: true`` is honoured (the completion is generated to its end, then sent as chunks:
nothing about the sampling changes), and so are stop strings of several tokens (generation
runs on to its end, and the completion is cut after the first:
:func:`~astralight.raas.openai_completions.cut_at_stop_string`).
Constrained decoding is honoured where the policy engine can constrain it with exact behaviour
log-probs (vLLM): ``response_format`` ``json_object`` / ``json_schema`` (the completion is JSON,
matching the schema), ``tool_choice: "required"`` and a named tool (the completion is one or
more tool calls in the chat format's ``<tool_call>{"name", "arguments"}</tool_call>`` blocks,
of the declared tools or of the named one, with arguments matching their parameter schemas;
``parallel_tool_calls: false``: exactly one). The tokens the constraint rules out get
probability 0, and the recorded log-probs are those of the constrained distribution each token
was sampled from (:attr:`~astralight.engine.SamplingSpec.constraint`); an engine that cannot
constrain decoding (the transformers engine) answers such a request with a 400 naming the
field. ``tool_choice: "none"``: the tools are neither announced to the policy nor parsed.
Anything the endpoint cannot honour exactly (``n > 1``, penalties, logit bias, top log-probs,
images...) is a 400 naming the field, never silently ignored: the trainer corrects for the
behaviour log-probs of what was sampled, so a request option that changed the sampling without
being recorded would bias training.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestError", "ChatRequest", "parse_request", "read_json", "bad_request",
           "refuse_lone_surrogates", "MAX_BODY_BYTES", "MAX_MESSAGES", "MAX_TOOLS", "MAX_STOP",
           "ROLES", "KNOWN_FIELDS", "IGNORED_FIELDS"]

#: most bytes of one request body (a long conversation with tool results fits many times over)
MAX_BODY_BYTES = 8 << 20
#: most messages / tools in one request
MAX_MESSAGES = 4096
MAX_TOOLS = 256
#: OpenAI accepts at most four stop sequences; each at most this long here (a bound on the work
#: of finding one in a completion)
MAX_STOP = 4
MAX_STOP_CHARS = 1000
ROLES = ("system", "developer", "user", "assistant", "tool")
#: request fields that change nothing here (metadata for OpenAI's own bookkeeping)
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier",
                            "prediction", "prompt_cache_key", "safety_identifier",
                            # read by OpenAI's own reasoning models; a policy's template reads
                            # chat_template_kwargs (e.g. Qwen3's enable_thinking) instead
                            "reasoning_effort", "verbosity"})
KNOWN_FIELDS = frozenset({"model", "messages", "tools", "tool_choice", "temperature", "top_p",
                          "max_tokens", "max_completion_tokens", "stop", "n", "stream",
                          "stream_options", "seed", "logprobs", "top_logprobs",
                          "frequency_penalty", "presence_penalty", "logit_bias",
                          "response_format", "chat_template_kwargs",
                          "parallel_tool_calls"}) | IGNORED_FIELDS
#: chat template variables a request may not set (the endpoint sets them)
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents",
                                      "chat_template", "add_generation_prompt", "tokenize",
                                      "continue_final_message", "return_dict"})
#: ``stream_options`` keys: ``include_usage`` is honoured; ``include_obfuscation`` (random
#: padding against length side channels, meaningless on loopback) changes nothing here
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
#: ``tool_choice`` strings (a named tool is ``{"type": "function", "function": {"name": ...}}``)
TOOL_CHOICES = ("auto", "none", "required")
#: ``response_format`` types; ``json_object`` / ``json_schema`` constrain decoding
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class RequestError(Exception):
    """A refused request: HTTP ``status``, the offending field ``param`` and OpenAI's ``code``."""

    def __init__(self, status: int, param: str | None, message: str, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.message = status, param, message
        self.code, self.kind = code, kind

    def body(self) -> dict:
        """OpenAI's error layout (what ``openai`` turns into ``BadRequestError`` & co.)."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad_request(param: str, message: str, code: str | None = None) -> RequestError:
    """A 400 naming ``param`` (its message starts with the field's name)."""
    return RequestError(400, param, f"{param}: {message}", code)


@dataclass
class ChatRequest:
    """A validated ``/chat/completions`` body, in the terms the engine needs. ``None`` fields
    were not given (the episode's sampling defaults apply)."""

    model: str
    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    use_tools: bool = True  # tool_choice "none": tools are neither announced nor parsed
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False  # answer as server-sent chunks (generated to the end first)
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs (vLLM's extra)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    #: "auto", "none", "required" (at least one tool call, forced) or "named" (a call of
    #: ``tool_name``, forced)
    tool_choice: str = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True  # False: a forced choice makes exactly one call
    #: ``response_format`` beyond text: ``{"type": "json_object"}`` or ``{"type":
    #: "json_schema", "schema": {...}}`` (its ``json_schema.schema``); None: text
    response_format: dict | None = None

    @property
    def forced_tools(self) -> bool:
        """Whether the completion must be tool calls (``required`` or a named tool)."""
        return self.tool_choice in ("required", "named")

    @property
    def constraint_param(self) -> str | None:
        """The request field that constrains decoding (``tool_choice`` when it forces calls,
        else ``response_format`` when it asks for JSON); None: unconstrained."""
        if self.forced_tools:
            return "tool_choice"
        return "response_format" if self.response_format is not None else None


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    try:
        finite = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise bad_request(name, f"must be a finite number, got {str(v)[:40]}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad_request(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad_request(name, f"must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _text_content(content: Any, where: str, allow_none: bool) -> str | None:
    """A message's content as text: a string, or a list of ``{"type": "text", "text"}`` parts
    (joined); images and audio are refused (the policy reads text only)."""
    if content is None:
        if allow_none:
            return None
        raise bad_request(where, "is required for this role")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise bad_request(f"{where}[{j}]", "only {\"type\": \"text\", \"text\": ...} "
                                  "parts are supported (the policy reads text)")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(where, "must be a string or a list of text parts, got "
                      f"{type(content).__name__}")


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(where, "must be a list")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(w, 'expected {"type": "function", "function": {"name", "arguments"}}')
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise bad_request(f"{w}.function.arguments", "must be a JSON string")
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages", "must be a non-empty list of messages")
    if len(value) > MAX_MESSAGES:
        raise bad_request("messages", f"at most {MAX_MESSAGES} messages, got {len(value)}")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(where, "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role", f"must be one of {list(ROLES)}, got {role!r}")
        msg: dict = {"role": "system" if role == "developer" else role}
        has_calls = role == "assistant" and m.get("tool_calls")
        msg["content"] = _text_content(m.get("content"), f"{where}.content",
                                       allow_none=role == "assistant")
        if has_calls:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
            if msg["content"] is None:  # templates test '</think>' in content: give them text
                msg["content"] = ""
        elif msg["content"] is None:
            raise bad_request(f"{where}.content",
                              "an assistant message needs content or tool_calls")
        for key in ("name", "tool_call_id", "reasoning_content"):  # Qwen3's template reads
            if m.get(key) is not None:                             # reasoning_content
                if not isinstance(m[key], str):
                    raise bad_request(f"{where}.{key}", "must be a string")
                msg[key] = m[key]
        out.append(msg)
    return out


def _tools(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request("tools", f"must be a list of at most {MAX_TOOLS} tools")
    out = []
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(
                fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}]", 'expected {"type": "function", "function": {"name", '
                              '"description", "parameters"}}')
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters", "must be a JSON schema object")
        out.append({"type": "function", "function": dict(fn)})
    return out


def check_fields(body: Any, fields: frozenset) -> dict:
    """A request body of another dialect (Responses, Messages): a JSON object with only
    ``fields`` and a boolean ``stream`` if any; a 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise bad_request("body", "must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad_request(unknown[0], f"unknown field (this route supports {sorted(fields)})")
    if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
        raise bad_request("stream", "must be true or false")
    return body


def _stream(body: dict) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream", f"must be true or false, got {str(stream)[:40]}")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise bad_request("stream_options", "is only allowed with stream: true")
    if not isinstance(options, dict):
        raise bad_request("stream_options", "must be an object")
    unknown = sorted(set(options) - STREAM_OPTIONS)
    if unknown:
        raise bad_request(f"stream_options.{unknown[0]}",
                          f"unknown option (supported: {sorted(STREAM_OPTIONS)})")
    for name in STREAM_OPTIONS:
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise bad_request(f"stream_options.{name}", "must be true or false")
    return True, bool(options.get("include_usage"))


def parse_request(body: Any) -> ChatRequest:
    """Validate a chat completions body; RequestError (400, naming the field) for anything the
    endpoint cannot honour exactly."""
    if not isinstance(body, dict):
        raise bad_request("body", "must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise bad_request(unknown[0],
                          f"unknown field (this endpoint supports {sorted(KNOWN_FIELDS)})")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model", "is required: the policy's model id (GET .../models lists it)")
    n = _integer(body, "n", 1, 1 << 30)
    if n not in (None, 1):
        raise bad_request("n", f"only n=1 is supported (each call is one recorded completion), "
                          f"got {n}; call once per completion")
    stream, include_usage = _stream(body)
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, -2.0, 2.0) not in (None, 0.0):
            raise bad_request(name, "penalties are not supported (they would change the behaviour "
                              "log-probs the trainer corrects for); leave it unset or 0")
    if body.get("logit_bias"):
        raise bad_request("logit_bias", "is not supported; leave it unset")
    response_format = _response_format(body.get("response_format"))
    if _integer(body, "top_logprobs", 0, 20) not in (None, 0):
        raise bad_request("top_logprobs", "is not supported (only the sampled tokens' log-probs); "
                          "leave it unset or 0")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("logprobs", "must be true or false")
    tools = _tools(body.get("tools"))
    tool_choice, tool_name = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls", "must be true or false")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad_request("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise bad_request("stop", f"at most {MAX_STOP} non-empty strings")
    for j, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            raise bad_request(f"stop[{j}]" if len(stops) > 1 else "stop",
                              f"is {len(s)} characters; at most {MAX_STOP_CHARS}")
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 1 << 30)
    return ChatRequest(
        model=model, messages=_messages(body.get("messages")), tools=tools,
        use_tools=tool_choice != "none", temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True), max_tokens=max_tokens, stop=stops,
        seed=_integer(body, "seed", -(1 << 63), (1 << 63) - 1), logprobs=bool(logprobs),
        stream=stream, include_usage=include_usage,
        template_kwargs=_template_kwargs(body.get("chat_template_kwargs")),
        tool_choice=tool_choice, tool_name=tool_name, parallel_tool_calls=parallel is not False,
        response_format=response_format)


def _response_format(value: Any) -> dict | None:
    """``response_format``: None for text, else ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "schema": SCHEMA}`` (OpenAI's ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}}``; the schema is always enforced, ``strict``
    or not)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        raise bad_request("response_format", f"must be {{\"type\": T}} with T one of "
                          f"{list(RESPONSE_FORMATS)}, got {str(value)[:80]}")
    kind = value["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise bad_request(f"response_format.{unknown[0]}", f"unknown field for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema", 'is required: {"name": ..., '
                          '"schema": {...}}')
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise bad_request(f"response_format.json_schema.{unknown[0]}", "unknown field (name, "
                          "schema, strict and description are)")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request("response_format.json_schema.strict", "must be true or false")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema", "is required: a JSON schema "
                          "object")
    return {"type": "json_schema", "schema": schema}


def _tool_choice(value: Any, tools: list[dict]) -> tuple[str, str | None]:
    """``tool_choice`` as ``(choice, tool name)``: ``"auto"`` (also when unset), ``"none"``,
    ``"required"``, or ``"named"`` with the name of a declared tool."""
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise bad_request("tool_choice", f"must be one of {list(TOOL_CHOICES)} or "
                              f'{{"type": "function", "function": {{"name": ...}}}}, got '
                              f"{value[:40]!r}")
        if value == "required" and not tools:
            raise bad_request("tool_choice", '"required" needs tools: declare them in tools')
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(
            fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("tool_choice", 'a named tool is {"type": "function", "function": '
                          f'{{"name": ...}}}}, got {str(value)[:80]}')
    names = [t["function"]["name"] for t in tools]
    if fn["name"] not in names:
        raise bad_request("tool_choice.function.name", f"{fn['name'][:80]!r} is not one of the "
                          f"declared tools {names[:20]}")
    return "named", fn["name"]


def _template_kwargs(value: Any) -> dict:
    """``chat_template_kwargs`` (vLLM's extra field, e.g. ``{"enable_thinking": false}``): chat
    template variables, rendered into the prompt, so they are in the record too."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("chat_template_kwargs", "must be an object of template variables")
    for key in value:
        if not isinstance(key, str) or key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"chat_template_kwargs.{key}",
                              "is set by the endpoint, not by a request")
    return dict(value)


async def read_json(request: Any, max_bytes: int) -> Any:
    """The JSON body of a Starlette ``request``: a body over ``max_bytes`` is a 413, one that is
    not UTF-8 JSON (or nested too deeply to parse) a 400 naming ``body``, a lone surrogate in it
    a 400 naming its field (:func:`refuse_lone_surrogates`); an empty body is ``None``."""
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestError(413, "body", f"body: larger than {max_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks) or b"null"
    try:  # UTF-8 only (RFC 8259): json.loads would also guess UTF-16/32, where the escape
        # search below would miss a lone surrogate
        body = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise bad_request("body", f"must be JSON in UTF-8 ({exc.reason} at byte {exc.start})"
                          ) from None
    except json.JSONDecodeError as exc:
        raise bad_request("body", f"not valid JSON ({exc})") from None
    except RecursionError:
        raise bad_request("body", "JSON nested too deeply") from None
    except ValueError as exc:  # an integer past Python's digit limit (4,300 digits)
        raise bad_request("body", f"not JSON we read ({str(exc)[:80]})") from None
    if _SURROGATE_ESCAPE.search(raw):
        refuse_lone_surrogates(body)
    return body


#: a JSON escape of a UTF-16 surrogate (``\\ud800``-``\\udfff``): the only way a body that is
#: valid UTF-8 can put a lone surrogate into a string (a false hit only costs a walk)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a surrogate code point (one JSON escape of a pair is decoded into
    the pair's character, so any surrogate left is a lone one)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def refuse_lone_surrogates(body: Any) -> None:
    """A 400 naming the field for a lone UTF-16 surrogate anywhere in ``body``: in a string
    value (named by its path, ``messages[0].content``, ``stop``, ``tools[0].function.name``)
    or in a field name (named by the object holding it, ``body`` at the top).

    Why: JSON lets ``"\\ud800"`` through, but the text has no UTF-8 form, so the tokenizer (and
    any answer quoting it) would fail on it: a 500 for bad input. The walk is iterative, so no
    nesting depth the parser accepted can exhaust the stack here."""
    todo = [(body, "")]
    while todo:
        value, where = todo.pop()
        if isinstance(value, str):
            if _has_lone_surrogate(value):
                raise bad_request(where or "body", "holds a lone UTF-16 surrogate (a \\ud800-"
                                  "\\udfff escape that is not half of a pair); send valid "
                                  "Unicode text", "invalid_unicode")
        elif isinstance(value, dict):
            for key, item in value.items():
                if _has_lone_surrogate(key):
                    raise bad_request(where or "body", f"a field name holds a lone UTF-16 "
                                      f"surrogate ({ascii(key)[:60]}); send valid Unicode names",
                                      "invalid_unicode")
                todo.append((item, f"{where}.{key}" if where else key))
        elif isinstance(value, list):
            todo.extend((item, f"{where or 'body'}[{i}]") for i, item in enumerate(value))
