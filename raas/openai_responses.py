"""The OpenAI Responses API (``POST .../responses``) on the same recorder as chat completions.

The Agents SDK calls it by default, and LangChain for reasoning, ``include`` or
``output_version="responses/v1"``. A Responses request is translated into a chat request
(:func:`chat_body`: ``instructions`` a system message, ``input`` items messages, a
``function_call`` item an assistant turn's tool call, a ``function_call_output`` item a tool
message, flat function tools nested as chat tools), validated by the chat request's own checks
(:func:`~astralight.raas.openai_requests.parse_request`), served by the same call, and answered
as a ``response`` object (:func:`response_body`: the text as an ``output_text`` message, each
tool call as a ``function_call`` item). So one token stream and one record serve both dialects,
and a conversation continued in either merges into one sample the same way.

``text.format`` ``json_object`` / ``json_schema`` becomes the chat request's ``response_format``
and ``tool_choice`` ``"required"`` / ``{"type": "function", "name": ...}`` its forced tool choice
(constrained decoding, recorded exactly; see :mod:`~astralight.raas.openai_requests`).

``previous_response_id`` continues a response of the same episode: its whole conversation (its
input and its output) comes first. ``store: false`` is accepted (nothing outlives the episode
anyway). ``stream: true`` sends the finished response as the Responses event stream
(:func:`response_events`: created, each output item added / its text or arguments / done,
completed), so the sampling and the record are those of a plain call.
"""

from __future__ import annotations

import json
import time
from typing import Any

from astralight.raas.openai_episodes import CallRecord, Episode
from astralight.raas.openai_requests import RequestError, bad_request, check_fields

__all__ = ["chat_body", "response_body", "response_events", "RESPONSES_FIELDS"]

#: request fields that change nothing here (OpenAI's own bookkeeping and reasoning settings)
IGNORED = frozenset({"store", "metadata", "user", "service_tier",
                     "truncation", "reasoning", "prompt_cache_key", "safety_identifier",
                     "background", "max_tool_calls"})
#: every field a Responses request may carry here
RESPONSES_FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice",
                              "temperature", "top_p", "max_output_tokens", "previous_response_id",
                              "stream", "include", "text", "seed", "chat_template_kwargs",
                              "parallel_tool_calls"}) | IGNORED
#: ``include`` values honoured (log-probs of the output text)
INCLUDES = frozenset({"message.output_text.logprobs"})


def _text_parts(content: Any, where: str) -> str | list:
    """A message's content: a string, or its input_text / output_text parts as chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(where, "must be a string or a list of input_text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                 "text") or not isinstance(
                part.get("text"), str):
            raise bad_request(f"{where}[{j}]", "only input_text / output_text parts are "
                              "supported (the policy reads text)")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _input_messages(value: Any) -> list[dict]:
    """Chat messages of ``input``: text, or message / function_call / function_call_output
    items in order (consecutive calls join one assistant turn)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request("input", "must be a string or a list of input items")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(where, "must be an object (a message or a function call item)")
        kind = item.get("type", "message")
        if kind == "message":
            msg = {"role": item.get("role"), "content": _text_parts(item.get("content"),
                                                                    f"{where}.content")}
            out.append(msg)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where}.{key}", "must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last.get("role") == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id", "must be a string")
            output = item.get("output")
            if isinstance(output, list):  # input_text parts (the Agents SDK sends an MCP
                # tool's result so): their text, as the tool message a chat client would send
                text = "".join(p["text"] for p in _text_parts(output, f"{where}.output"))
            else:
                text = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        else:
            raise bad_request(f"{where}.type", f"{kind!r} items are not supported (message, "
                              "function_call and function_call_output are)")
    return out


def _tools(value: Any) -> list[dict] | None:
    """Flat Responses function tools as chat tools."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("tools", "must be a list of function tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"tools[{i}]", "only function tools are supported (the policy runs "
                              "no hosted tools)")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}})
    return out


def _response_format(text: Any) -> dict | None:
    """``text.format`` as the chat request's ``response_format`` (None: text): ``{"type":
    "json_schema", "name", "schema", "strict", "description"}`` nests its fields under
    ``json_schema`` as chat completions has them."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text", "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(fmt, dict) or fmt.get("type") not in kinds:
        raise bad_request("text.format", f"must be {{\"type\": T}} with T one of {list(kinds)}")
    if fmt["type"] != "json_schema":
        unknown = sorted(set(fmt) - {"type"})
        if unknown:
            raise bad_request(f"text.format.{unknown[0]}",
                              f"unknown field for type {fmt['type']!r}")
        return None if fmt["type"] == "text" else {"type": "json_object"}
    fields = ("name", "schema", "strict", "description")
    unknown = sorted(set(fmt) - {"type", *fields})
    if unknown:
        raise bad_request(f"text.format.{unknown[0]}", f"unknown field ({list(fields)} are "
                          "supported)")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("text.format.schema", "is required: a JSON schema object")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in fields if k in fmt}}


def _tool_choice(choice: Any) -> Any:
    """``tool_choice`` as chat completions has it: a named function ``{"type": "function",
    "name"}`` nested as ``{"type": "function", "function": {"name"}}``; the strings as they are
    (the chat request checks them); hosted tools refused."""
    if isinstance(choice, str):
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(
            choice.get("name"), str):
        raise bad_request("tool_choice", '"auto", "none", "required" or {"type": "function", '
                          f'"name": ...}} are supported, got {str(choice)[:80]}')
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_body(body: Any, ep: Episode) -> dict:
    """The chat completions request a Responses request means (``previous_response_id``'s
    conversation first)."""
    check_fields(body, RESPONSES_FIELDS)
    include = body.get("include") or []
    if not isinstance(include, list) or set(include) - INCLUDES:
        raise bad_request("include", f"only {sorted(INCLUDES)} is supported")
    response_format = _response_format(body.get("text"))
    messages: list[dict] = []
    prev = body.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str) or prev not in ep.responses:
            raise RequestError(404, "previous_response_id", f"previous_response_id: {prev!r} is "
                               "not a response of this episode", "previous_response_not_found")
        messages = [dict(m) for m in ep.responses[prev]]
        messages = [m for m in messages if m.get("role") != "system"]  # instructions: this one's
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions", "must be a string")
    head = [{"role": "system", "content": instructions}] if instructions else []
    if "input" not in body:
        raise bad_request("input", "is required")
    chat = {"model": body.get("model"), "messages": head + messages + _input_messages(body["input"])}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                     ("max_output_tokens", "max_completion_tokens"),
                     ("chat_template_kwargs", "chat_template_kwargs")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if response_format is not None:
        chat["response_format"] = response_format
    if include:
        chat["logprobs"] = True
    return chat


def response_body(ep: Episode, record: CallRecord, request: dict, chat: dict,
                  with_logprobs: bool) -> dict:
    """The ``response`` object of one call; remembers its conversation for
    ``previous_response_id``."""
    rid = f"resp_{ep.id[:8]}{record.index}"
    output: list[dict] = []
    if record.content:
        part = {"type": "output_text", "text": record.content, "annotations": []}
        if with_logprobs:
            tok = ep.engines[record.model_id].tokenizer
            part["logprobs"] = [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                 "top_logprobs": []}
                                for t, lp in zip((tok.decode([i]) for i in record.completion_ids),
                                                 record.logprobs)]
        output.append({"type": "message", "id": f"msg_{ep.id[:8]}{record.index}",
                       "status": "completed", "role": "assistant", "content": [part]})
    for call in record.tool_calls:
        output.append({"type": "function_call", "id": f"fc_{call['id']}",
                       "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    assistant = {"role": "assistant", "content": record.content or ""}
    if record.tool_calls:
        assistant["tool_calls"] = record.tool_calls
    ep.responses[rid] = list(chat["messages"]) + [assistant]
    n_in, n_out = len(record.prompt_ids), len(record.completion_ids)
    cut = record.finish_reason == "length"
    return {"id": rid, "object": "response", "created_at": float(int(time.time())),
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None, "model": record.model_id, "output": output,
            "instructions": request.get("instructions"),
            "previous_response_id": request.get("previous_response_id"),
            "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
            "tool_choice": request.get("tool_choice", "auto"),
            "tools": request.get("tools") or [], "temperature": request.get("temperature"),
            "top_p": request.get("top_p"), "max_output_tokens": request.get("max_output_tokens"),
            "text": {"format": (request.get("text") or {}).get("format") or {"type": "text"}},
            "usage": {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def response_events(response: dict) -> list[dict]:
    """A finished ``response`` as the Responses API's stream events (``sequence_number`` in
    order): ``response.created`` and ``in_progress`` (no output yet), per output item its
    ``output_item.added``, its text (``content_part.added``, one ``output_text.delta`` with the
    log-probs, ``output_text.done``, ``content_part.done``) or its arguments (one
    ``function_call_arguments.delta`` and ``.done``), ``output_item.done``; then
    ``response.completed`` (or ``response.incomplete``) with the whole response."""
    events: list[dict] = []

    def emit(kind: str, **fields) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    pending = {**response, "status": "in_progress", "output": [], "usage": None}
    emit("response.created", response=pending)
    emit("response.in_progress", response=pending)
    for i, item in enumerate(response["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            emit("response.output_item.added", output_index=i,
                 item={**item, "status": "in_progress", "content": []})
            emit("response.content_part.added", output_index=i, item_id=item["id"],
                 content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            emit("response.output_text.delta", output_index=i, item_id=item["id"],
                 content_index=0, delta=part["text"], logprobs=part.get("logprobs", []))
            emit("response.output_text.done", output_index=i, item_id=item["id"],
                 content_index=0, text=part["text"], logprobs=part.get("logprobs", []))
            emit("response.content_part.done", output_index=i, item_id=item["id"],
                 content_index=0, part=part)
        else:
            emit("response.output_item.added", output_index=i,
                 item={**item, "status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", output_index=i, item_id=item["id"],
                 delta=item["arguments"])
            emit("response.function_call_arguments.done", output_index=i, item_id=item["id"],
                 name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=i, item=item)
    done = "response.completed" if response["status"] == "completed" else "response.incomplete"
    emit(done, response=response)
    return events
