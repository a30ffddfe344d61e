"""What one chat completion call does on its episode's loop, and the ChatCompletion it answers.

:func:`complete` renders the request's messages and ``tools`` with the policy tokenizer's chat
template (``add_generation_prompt=True``), generates with ``await engine.generate(ids,
SamplingSpec)``, decodes, and records the call
(:class:`~astralight.raas.openai_episodes.CallRecord`).
The model's ``<tool_call>{json}</tool_call>`` blocks (Qwen3/Hermes, read by
:func:`astralight.agents.tools.parse_tool_calls`) become OpenAI ``tool_calls``
(:func:`split_tool_calls`); :func:`completion_body` lays a record out as OpenAI's
``chat.completion`` object (``finish_reason`` ``"tool_calls"`` when there are any, ``usage``
counting the tokens).
"""

from __future__ import annotations

import json
import re
import time

from astralight.agents.chat import encode, render
from astralight.agents.tools import parse_tool_calls
from astralight.engine import SamplingSpec
from astralight.raas.openai_episodes import CallRecord, Episode
from astralight.raas.openai_requests import ChatRequest, RequestError, bad_request
from astralight.workflows.chat_episodes import decode_turn

__all__ = ["complete", "sampling_spec", "split_tool_calls", "completion_body"]

_TOOL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


async def complete(ep: Episode, req: ChatRequest, index: int) -> CallRecord:
    """Call ``index`` of ``ep``, on the episode's loop: render, generate, parse, record."""
    engine, s = ep.engine, ep.settings
    tok = engine.tokenizer
    tools = req.tools if req.use_tools else []
    try:
        text = render(tok, req.messages, tools, True, **s.chat_template_kwargs)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's
        raise bad_request("messages", f"the policy's chat template cannot render them "
                          f"({type(exc).__name__}: {exc})") from None
    ids = encode(tok, text)
    limit = getattr(engine, "max_model_len", None)
    if s.max_context_tokens is not None:
        limit = s.max_context_tokens if limit is None else min(int(limit), s.max_context_tokens)
    room = None if limit is None else int(limit) - len(ids)
    if room is not None and room < 1:
        raise bad_request("messages", f"the conversation is {len(ids)} tokens; the policy's "
                          f"context holds {limit} (prompt and completion)",
                          "context_length_exceeded")
    stop_ids = []
    for j, stop in enumerate(req.stop):
        sid = encode(tok, stop)
        if len(sid) != 1:
            raise bad_request(f"stop[{j}]" if len(req.stop) > 1 else "stop",
                              f"{stop!r} is {len(sid)} tokens of the policy's tokenizer; only "
                              "single-token stop sequences are supported")
        stop_ids.append(sid[0])
    spec = sampling_spec(ep, req, index, room, stop_ids)
    version = int(engine.version)
    completion = await engine.generate(ids, spec)
    if completion.finish_reason == "abort":
        raise RequestError(503, None, "the policy engine aborted this call; retry",
                           "engine_aborted", "server_error")
    out = decode_turn(tok, completion)
    content, calls, errors = split_tool_calls(out, tools, ep.id, index)
    record = CallRecord(
        index=index, model_id=ep.model_id, prompt_ids=list(ids),
        completion_ids=[int(t) for t in completion.token_ids],
        logprobs=[float(x) for x in completion.logprobs],
        versions=[int(v) for v in completion.token_versions(version)],
        finish_reason=completion.finish_reason, version=version, messages=req.messages,
        tools=tools, text=out, content=content, tool_calls=calls, tool_call_errors=errors,
        temperature=float(spec.temperature))
    if not ep.closed:
        ep.calls.append(record)
    return record


def sampling_spec(ep: Episode, req: ChatRequest, index: int, room: int | None,
                  stop_ids: list[int]) -> SamplingSpec:
    """The engine's sampling for call ``index``: the request's own temperature, top_p and seed
    unless the episode forces its sampling, ``max_tokens`` capped by the ``room`` left in the
    context, the request's single-token stops added to the episode's."""
    s = ep.settings
    base = s.sampling.for_request(s.seed_slot + index * s.seed_stride, s.seed_key)
    own = not s.force_sampling
    temperature = req.temperature if own and req.temperature is not None else base.temperature
    top_p = req.top_p if own and req.top_p is not None else base.top_p
    max_tokens = req.max_tokens if req.max_tokens is not None else base.max_tokens
    if room is not None:
        max_tokens = min(max_tokens, room)
    return SamplingSpec(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                        stop_token_ids=list(base.stop_token_ids) + stop_ids,
                        seed=req.seed % (1 << 31) if own and req.seed is not None else base.seed)


def split_tool_calls(text: str, tools: list[dict], episode_id: str,
                     index: int) -> tuple[str | None, list[dict], dict[str, int]]:
    """``(content, tool_calls, errors)`` of an assistant turn: valid ``<tool_call>`` blocks
    become OpenAI tool calls (``arguments`` a JSON string, as ``tojson`` would write it, so a
    chat template re-renders the turn as generated); the text outside them is the content.
    Without tools declared, nothing is parsed (the text is the content)."""
    errors = {"malformed": 0, "unknown_tool": 0}
    if not tools:
        return text, [], errors
    names = {t["function"]["name"] for t in tools}
    calls = []
    for c in parse_tool_calls(text):
        if c.error is not None:
            errors["malformed"] += 1
            continue
        if c.name not in names:
            errors["unknown_tool"] += 1
        calls.append({"id": f"call_{episode_id[:8]}_{index}_{len(calls)}", "type": "function",
                      "function": {"name": c.name,
                                   "arguments": json.dumps(c.arguments, ensure_ascii=False)}})
    if not calls:
        return text, [], errors
    content = _TOOL_BLOCK.sub("", text).strip()
    return content or None, calls, errors


def completion_body(ep: Episode, r: CallRecord, with_logprobs: bool) -> dict:
    """The OpenAI ChatCompletion of one record."""
    message: dict = {"role": "assistant", "content": r.content}
    if r.tool_calls:
        message["tool_calls"] = r.tool_calls
    finish = ("length" if r.finish_reason == "length" else
              "tool_calls" if r.tool_calls else "stop")
    logprobs = None
    if with_logprobs:
        tok = ep.engine.tokenizer
        logprobs = {"content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip((tok.decode([i]) for i in r.completion_ids), r.logprobs)]}
    n_prompt, n_comp = len(r.prompt_ids), len(r.completion_ids)
    return {"id": f"chatcmpl-{ep.id[:8]}-{r.index}", "object": "chat.completion",
            "created": int(time.time()), "model": r.model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": logprobs}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_comp,
                      "total_tokens": n_prompt + n_comp}}
