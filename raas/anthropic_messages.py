"""The Anthropic Messages API (``POST .../v1/messages``) on the OpenAI endpoint's recorder.

The ``anthropic`` SDK, Claude-Agent-SDK-style harnesses and LiteLLM's ``anthropic/`` routes speak
it. A Messages request is translated into a chat request (:func:`chat_body`: ``system`` a system
message, ``text`` blocks content, ``tool_use`` blocks an assistant turn's tool calls,
``tool_result`` blocks tool messages, ``input_schema`` tools chat tools, ``stop_sequences``
stops), validated by the chat request's own checks, served by the same call, and answered as a
``message`` (:func:`message_body`: text and ``tool_use`` blocks, ``stop_reason``). One record
and one token stream serve every dialect. ``tool_choice`` ``any`` and ``{"type": "tool", "name"}``
force tool calls by constrained decoding (recorded exactly; see
:mod:`~astralight.raas.openai_requests`). The SDK's ``x-api-key`` header carries the same key as
the bearer token. ``stream: true`` sends the finished message as the Messages event stream
(:func:`message_events`), so the sampling and the record are those of a plain call.
"""

from __future__ import annotations

import json
from typing import Any

from astralight.raas.openai_episodes import CallRecord, Episode
from astralight.raas.openai_requests import bad_request, check_fields

__all__ = ["chat_body", "message_body", "message_events", "MESSAGES_FIELDS"]

#: request fields that change nothing here
IGNORED = frozenset({"metadata", "service_tier", "container", "mcp_servers"})
MESSAGES_FIELDS = frozenset({"model", "messages", "system", "max_tokens", "tools", "tool_choice",
                             "temperature", "top_p", "top_k", "stop_sequences", "stream",
                             "thinking"}) | IGNORED


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(where, "must be a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{where}[{j}]", "must be a content block with a type")
    return content


def _text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}.text", "must be a string")
    return block["text"]


def _result_text(content: Any, where: str) -> str:
    """A tool_result's content as text (a string, or its text blocks joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(_text(b, f"{where}[{j}]") if b.get("type") == "text" else _refuse(
        b, f"{where}[{j}]") for j, b in enumerate(_blocks(content, where)))


def _refuse(block: dict, where: str):
    raise bad_request(f"{where}.type", f"{block.get('type')!r} blocks are not supported "
                      "(text, tool_use and tool_result are)")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages", "must be a non-empty list of messages")
    out: list[dict] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role", "must be 'user' or 'assistant'")
        texts, calls, results = [], [], []
        for j, block in enumerate(_blocks(m.get("content"), f"{where}.content")):
            at = f"{where}.content[{j}]"
            kind = block["type"]
            if kind == "text":
                texts.append(_text(block, at))
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise bad_request(at, "a tool_use block needs id and name")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_request(f"{at}.tool_use_id", "must be a string")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": _result_text(block.get("content"), f"{at}.content")})
            else:
                _refuse(block, at)
        out += results  # the results answer the previous assistant turn's calls
        if m["role"] == "assistant":
            msg = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _tools(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise bad_request("tools", "must be a list of tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or not isinstance(
                tool.get("name"), str):
            raise bad_request(f"tools[{i}]", "only client tools ({name, description, "
                              "input_schema}) are supported (the policy runs no server tools)")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_body(body: Any) -> dict:
    """The chat completions request a Messages request means."""
    check_fields(body, MESSAGES_FIELDS)
    if body.get("top_k") is not None:
        raise bad_request("top_k", "is not supported (the trainer's log-probs have no top-k); "
                          "leave it unset")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict)
                                 or thinking.get("type") != "disabled"):
        raise bad_request("thinking", "extended thinking is not supported; the policy's template "
                          "decides (chat_template_kwargs on the workflow)")
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise bad_request("max_tokens", "is required (an integer)")
    system = body.get("system")
    head = []
    if system:
        text = system if isinstance(system, str) else "".join(
            _text(b, f"system[{j}]") for j, b in enumerate(_blocks(system, "system")))
        head = [{"role": "system", "content": text}]
    chat = {"model": body.get("model"), "messages": head + _messages(body.get("messages")),
            "max_completion_tokens": body["max_tokens"]}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    choice = body.get("tool_choice")
    if choice is not None:
        chat.update(_tool_choice(choice))
    return chat


def _tool_choice(choice: Any) -> dict:
    """``tool_choice`` as chat request fields: ``auto`` / ``none`` as they are, ``any`` as
    ``"required"``, ``{"type": "tool", "name"}`` as that named function (both forced by
    constrained decoding), ``disable_parallel_tool_use`` as ``parallel_tool_calls: false``."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "none", "any", "tool"):
        raise bad_request("tool_choice", 'must be {"type": T} with T one of auto, none, any, '
                          f"tool, got {str(choice)[:80]}")
    out: dict = {"tool_choice": "required" if kind == "any" else kind}
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice.name", "is required for {\"type\": \"tool\"}")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise bad_request("tool_choice.disable_parallel_tool_use", "must be true or false")
        if kind != "none":
            out["parallel_tool_calls"] = not parallel
    return out


def message_body(ep: Episode, record: CallRecord) -> dict:
    """The Anthropic ``message`` of one call."""
    content: list[dict] = []
    if record.content:
        content.append({"type": "text", "text": record.content})
    for call in record.tool_calls:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    stop = ("tool_use" if record.tool_calls else
            "max_tokens" if record.finish_reason == "length" else "end_turn")
    return {"id": f"msg_{ep.id[:8]}{record.index}", "type": "message", "role": "assistant",
            "model": record.model_id, "content": content, "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": len(record.prompt_ids),
                      "output_tokens": len(record.completion_ids)}}


def message_events(message: dict) -> list[tuple[str, dict]]:
    """A finished ``message`` as the Messages API's stream: ``(event name, data)`` pairs --
    ``message_start`` (no content yet), per block ``content_block_start``, one delta (the
    text, or the tool input as ``input_json_delta``) and ``content_block_stop``, then
    ``message_delta`` (the stop reason and the output tokens) and ``message_stop``."""
    start = {**message, "content": [], "stop_reason": None,
             "usage": {**message["usage"], "output_tokens": 0}}
    out: list[tuple[str, dict]] = [("message_start", {"type": "message_start",
                                                       "message": start})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            empty, delta = {"type": "text", "text": ""}, {"type": "text_delta",
                                                          "text": block["text"]}
        else:
            empty = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        out.append(("content_block_start", {"type": "content_block_start", "index": i,
                                            "content_block": empty}))
        out.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                                            "delta": delta}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    out.append(("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": message["stop_reason"],
                                            "stop_sequence": None},
                                  "usage": {"output_tokens": message["usage"]["output_tokens"]}}))
    out.append(("message_stop", {"type": "message_stop"}))
    return out
