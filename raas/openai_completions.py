"""What one chat completion call does on its episode's loop, and the ChatCompletion it answers.

:func:`complete` renders the request's messages and ``tools`` with the policy tokenizer's chat
template (``add_generation_prompt=True``), generates with ``await engine.generate(ids,
SamplingSpec)``, decodes, and records the call
(:class:`~astralight.raas.openai_episodes.CallRecord`).
Rendering, tokenizing, decoding and tool-call parsing run on the endpoint's worker threads
(:func:`off_loop`), never on the episode's loop (the RaaS's, shared by every episode); a prompt
whose rendered length alone proves it cannot fit the context is refused before it is tokenized
(:func:`refuse_what_cannot_fit`).
The model's ``<tool_call>{json}</tool_call>`` blocks (Qwen3/Hermes, read by
:func:`astralight.agents.tools.parse_tool_calls`) become OpenAI ``tool_calls``
(:func:`split_tool_calls`); :func:`completion_body` lays a record out as OpenAI's
``chat.completion`` object (``finish_reason`` ``"tool_calls"`` when there are any, ``usage``
counting the tokens), and :func:`completion_chunks` / :func:`sse_events` as the chunks of a
streamed call (``stream: true``: the completion is whole before its first chunk is sent).

A request that constrains decoding (``response_format`` JSON, ``tool_choice`` ``"required"`` or a
named tool) gets its :attr:`~astralight.engine.SamplingSpec.constraint` from
:func:`request_constraint` (forced calls: :func:`tool_calls_format`, in the
``<tool_call>{"name", "arguments"}</tool_call>`` format :func:`split_tool_calls` reads), and is
answered with a 400 naming that field when the engine cannot constrain decoding.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from astralight.agents.chat import encode, render
from astralight.agents.token_bound import fewest_tokens, max_chars_per_token
from astralight.agents.tools import parse_tool_calls, split_at_last_close
from astralight.engine import Completion, ConstraintError, SamplingSpec
from astralight.raas.openai_episodes import CallRecord, Episode
from astralight.raas.openai_requests import ChatRequest, RequestError, bad_request
from astralight.workflows.chat_episodes import decode_turn

__all__ = ["complete", "prepare_prompt", "off_loop", "sampling_spec", "split_tool_calls",
           "split_stops", "cut_at_stop_string", "request_constraint", "tool_calls_format",
           "completion_body", "completion_chunks", "sse_events"]

T = TypeVar("T")

_TOOL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


#: worker threads that render, tokenize and decode for the endpoint's calls (see :func:`off_loop`)
PREP_WORKERS = 4
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The endpoint's worker threads (started on first use). Not the loop's default executor:
    the environment steps and tools of every workflow queue there, and a call must not wait
    behind them (nor they behind a long conversation's tokenization)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=PREP_WORKERS, thread_name_prefix="openai-prep")
        return _POOL


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the endpoint's worker threads, awaited from the episode's loop.

    Why: the episode's loop is the RaaS's loop, which drives every episode, lease, push and
    weight refresh; rendering and tokenizing an 8 MiB conversation on it froze them all for
    about 10 s (issue 41, item 2). The tokenizer releases the interpreter lock while it encodes,
    and the template rendering is Python code that yields it every few milliseconds."""
    return await asyncio.get_running_loop().run_in_executor(_pool(), functools.partial(fn, *args))


@dataclass
class Prompt:
    """A call's prompt as the engine takes it: token ids, the ``room`` left in the context for
    the completion (None: no limit known), the request's stop strings as token ids and the
    tools the template was given."""

    ids: list[int]
    room: int | None
    stop_ids: list[int]
    tools: list[dict]
    stop_strings: list[str] = dataclasses.field(default_factory=list)  # several tokens each
    constraint: dict | None = None  # the SamplingSpec.constraint of the call (None: none)


async def complete(ep: Episode, req: ChatRequest, index: int) -> CallRecord:
    """Call ``index`` of ``ep``, on the episode's loop: render and tokenize (off the loop),
    generate, parse (off the loop), record."""
    engine = ep.engines[req.model]  # the endpoint admitted only models the episode serves
    if req.constraint_param is not None and not getattr(engine, "constrained_decoding", False):
        raise bad_request(req.constraint_param, f"the policy engine ({type(engine).__name__}) "
                          "cannot constrain decoding, so it cannot honour this field (and the "
                          "recorded log-probs must be those of what was sampled from); serve "
                          "the policy with vLLM, or leave the field unset", "unsupported_value")
    prompt = await off_loop(prepare_prompt, ep, req)
    spec = sampling_spec(ep, req, index, prompt.room, prompt.stop_ids, prompt.constraint)
    version = int(engine.version)
    try:
        completion = await engine.generate(prompt.ids, spec)
    except ConstraintError as exc:  # the schema or tag the request asked for
        raise bad_request(req.constraint_param or "response_format", f"the policy engine cannot "
                          f"apply this constraint: {exc}", "unsupported_value") from None
    if completion.finish_reason == "abort":
        raise RequestError(503, None, "the policy engine aborted this call; retry",
                           "engine_aborted", "server_error")
    if prompt.stop_strings:
        completion = await off_loop(cut_at_stop_string, engine.tokenizer, completion,
                                    prompt.stop_strings)
    record = await off_loop(call_record, ep, req, index, prompt, completion, version, spec)
    if not ep.closed:
        ep.calls.append(record)
    return record


def context_limit(ep: Episode, engine: Any) -> int | None:
    """Most prompt + completion tokens of a call served by ``engine``: its ``max_model_len`` and
    the episode's ``max_context_tokens``, whichever is smaller (None: neither is known)."""
    limit = getattr(engine, "max_model_len", None)
    cap = ep.settings.max_context_tokens
    if cap is not None:
        limit = cap if limit is None else min(int(limit), cap)
    return None if limit is None else int(limit)


def prepare_prompt(ep: Episode, req: ChatRequest) -> Prompt:
    """On a worker thread: the request rendered with the policy's chat template, refused
    (400 ``context_length_exceeded`` naming ``messages``) when it cannot fit the context --
    before tokenizing when its length alone proves it --, then tokenized, with its stop strings
    as single tokens."""
    engine = ep.engines[req.model]
    tok = engine.tokenizer
    tools = req.tools if req.use_tools else []
    text = render_prompt(tok, req.messages, tools,
                         {**ep.settings.chat_template_kwargs, **req.template_kwargs})
    limit = context_limit(ep, engine)
    refuse_what_cannot_fit(tok, text, limit)
    ids = encode_prompt(tok, text)
    room = None if limit is None else limit - len(ids)
    if room is not None and room < 1:
        raise bad_request("messages", f"the conversation is {len(ids)} tokens; the policy's "
                          f"context holds {limit} (prompt and completion)",
                          "context_length_exceeded")
    stop_ids, stop_strings = split_stops(tok, req.stop)
    return Prompt(ids, room, stop_ids, tools, stop_strings, request_constraint(req, tok, text))


def render_prompt(tok: Any, messages: list[dict], tools: list[dict], kwargs: dict) -> str:
    """The chat template's text of a request (generation prompt added); a template error is a
    400 naming ``messages`` (it is the request's)."""
    try:
        return render(tok, messages, tools, True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's
        raise bad_request("messages", f"the policy's chat template cannot render them "
                          f"({type(exc).__name__}: {exc})") from None


def refuse_what_cannot_fit(tok: Any, text: str, limit: int | None) -> None:
    """A 400 ``context_length_exceeded`` naming ``messages``, without tokenizing, for a
    rendered prompt longer than ``limit`` tokens of the longest text any one token of the
    policy's tokenizer covers (:func:`~astralight.agents.token_bound.fewest_tokens`: a bound that
    never refuses a prompt that fits; a tokenizer that vouches for none skips this check)."""
    if limit is None:
        return
    fewest = fewest_tokens(tok, text)
    if fewest >= limit:
        raise bad_request("messages", f"the conversation is at least {fewest} tokens "
                          f"({len(text)} characters rendered, at most "
                          f"{max_chars_per_token(tok)} per token of the policy's tokenizer); the "
                          f"policy's context holds {limit} (prompt and completion); shorten the "
                          "conversation", "context_length_exceeded")


def encode_prompt(tok: Any, text: str) -> list[int]:
    """The rendered prompt's token ids; a text the tokenizer refuses is a 400 naming
    ``messages`` (the request's text, never the engine's fault)."""
    try:
        return encode(tok, text)
    except Exception as exc:  # noqa: BLE001 - e.g. text the tokenizer cannot encode
        raise bad_request("messages", f"the policy's tokenizer cannot encode them "
                          f"({type(exc).__name__}: {str(exc)[:120]})") from None


def split_stops(tok: Any, stops: list[str]) -> tuple[list[int], list[str]]:
    """The request's stop strings that are one token of the policy's tokenizer, as token ids
    (the engine stops on them), and the others (:func:`cut_at_stop_string` stops on them after
    generation). A string longer than any token is known to be several without tokenizing."""
    most = max_chars_per_token(tok)
    ids, strings = [], []
    for stop in stops:
        sid = None if most is not None and len(stop) > most else encode_prompt(tok, stop)
        if sid is not None and len(sid) == 1:
            ids.append(sid[0])
        else:
            strings.append(stop)
    return ids, strings


def cut_at_stop_string(tok: Any, completion: Completion, stops: list[str]) -> Completion:
    """``completion`` ended at the first stop string its text holds: its tokens up to the one
    that completes the string, ``finish_reason`` ``"stop_string"`` (unchanged when none
    occurs). The tokens after it were sampled but never shown to the agent; a prefix of a
    sampled sequence keeps every token's behaviour log-prob, so the record stays exact."""
    ids = list(completion.token_ids)
    text = tok.decode(ids, skip_special_tokens=True)
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return completion
    end = min(i + len(s) for i, s in hits)
    lo, hi = 1, len(ids)  # the fewest tokens whose text reaches past the stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tok.decode(ids[:mid], skip_special_tokens=True)) >= end:
            hi = mid
        else:
            lo = mid + 1
    versions = completion.versions[:lo] if completion.versions is not None else None
    return Completion(ids[:lo], list(completion.logprobs[:lo]), "stop_string",
                      version=completion.version, versions=versions)


def call_record(ep: Episode, req: ChatRequest, index: int, prompt: Prompt, completion: Any,
                version: int, spec: SamplingSpec) -> CallRecord:
    """On a worker thread: the completion decoded, its tool calls parsed, as a record (a long
    completion's decoding and parsing stays off the episode's loop too)."""
    tok = ep.engines[req.model].tokenizer
    if completion.finish_reason == "stop_string":  # the text before the first stop string
        out = tok.decode(list(completion.token_ids), skip_special_tokens=True)
        out = out[:min(i for s in prompt.stop_strings if (i := out.find(s)) >= 0)]
    else:
        out = decode_turn(tok, completion)
    content, calls, errors = split_tool_calls(out, prompt.tools, ep.id, index)
    return CallRecord(
        index=index, model_id=req.model, prompt_ids=list(prompt.ids),
        completion_ids=[int(t) for t in completion.token_ids],
        logprobs=[float(x) for x in completion.logprobs],
        versions=[int(v) for v in completion.token_versions(version)],
        finish_reason="stop" if completion.finish_reason == "stop_string" else
        completion.finish_reason, version=version, messages=req.messages,
        tools=prompt.tools, text=out, content=content, tool_calls=calls,
        tool_call_errors=errors, temperature=float(spec.temperature),
        constrained=constraint_kind(req, spec.constraint))


def constraint_kind(req: ChatRequest, constraint: dict | None) -> str | None:
    """What a :attr:`~astralight.engine.SamplingSpec.constraint` (:func:`request_constraint`)
    forced, for the record: ``tool_calls`` (``tool_choice`` required or named),
    ``json_or_tool_calls`` (a JSON ``response_format`` with tools announced), ``json_schema`` /
    ``json_object``; None for none."""
    if not constraint:
        return None
    if "structural_tag" in constraint:
        return "tool_calls" if req.forced_tools else "json_or_tool_calls"
    return next(iter(constraint))


def sampling_spec(ep: Episode, req: ChatRequest, index: int, room: int | None,
                  stop_ids: list[int], constraint: dict | None = None) -> SamplingSpec:
    """The engine's sampling for call ``index``: the request's own temperature, top_p and seed
    unless the episode forces its sampling, ``max_tokens`` capped by the ``room`` left in the
    context, the request's single-token stops added to the episode's, and the request's
    ``constraint`` (:func:`request_constraint`)."""
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
                        seed=req.seed % (1 << 31) if own and req.seed is not None else base.seed,
                        constraint=constraint)


#: the chat format's tool-call block (Qwen3 / Hermes), as :func:`split_tool_calls` reads it
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: most consecutive whitespace characters between the tokens of a forced call's arguments: one,
#: as chat templates write calls (``tojson``: ``{"a": 1, "b": 2}``), or none (compact). Bounded
#: so that a policy cannot spend its tokens on whitespace inside a call it was forced to make.
TOOL_CALL_MAX_WHITESPACE = 1


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _optional(fmt: dict) -> dict:
    return {"type": "optional", "content": fmt}


def _sequence(*elements: dict | None) -> dict:
    return {"type": "sequence", "elements": [e for e in elements if e is not None]}


def _tool_call(tool: dict) -> dict:
    """One ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>`` block of ``tool``: the
    name fixed, the arguments a JSON object matching its ``parameters`` (none declared: ``{}``),
    a newline allowed inside each tag (Qwen3 writes them, Hermes-style toy models do not)."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return _sequence(
        _const(TOOL_CALL_OPEN), _optional(_const("\n")),
        _const('{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '),
        {"type": "json_schema", "json_schema": params,
         "max_whitespace_cnt": TOOL_CALL_MAX_WHITESPACE},
        _const("}"), _optional(_const("\n")), _const(TOOL_CALL_CLOSE))


def tool_calls_format(tools: list[dict], parallel: bool = True) -> dict:
    """The structural-tag format (xgrammar's, :attr:`~astralight.engine.SamplingSpec.constraint`)
    of a turn made of tool calls: one block of any of ``tools`` (chat tool dicts), then, with
    ``parallel``, any number more, each after a newline; nothing else (the stop token follows).
    """
    if not tools:
        raise ValueError("tools: a forced tool call needs at least one tool")
    calls = [_tool_call(t) for t in tools]
    one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if not parallel:
        return one
    return _sequence(one, {"type": "star", "content": _sequence(_const("\n"), one)})


def _has_token(tok: Any, text: str) -> bool:
    """Whether ``text`` is one token of ``tok``'s vocabulary."""
    try:
        tid = tok.convert_tokens_to_ids(text)
    except Exception:  # noqa: BLE001 - a tokenizer without the lookup: no
        return False
    return isinstance(tid, int) and tid != getattr(tok, "unk_token_id", None)


def think_prefix(tok: Any, prompt_text: str) -> dict | None:
    """What a forced tool call lets the policy write before its calls: its reasoning, where its
    chat template reasons in ``<think>`` blocks (Qwen3). A prompt that ends inside an open
    ``<think>`` (templates that open it) continues it to ``</think>``; one that ends after
    ``</think>`` (Qwen3 with ``enable_thinking: false``) gets nothing; otherwise, with a
    ``<think>`` token in the vocabulary, an optional ``<think>...</think>`` block. Up to four
    whitespace characters may follow the block."""
    tail = prompt_text.rstrip()
    gap = {"type": "regex", "pattern": "\\s{0,4}"}
    thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": THINK_CLOSE}
    if tail.endswith(THINK_CLOSE):
        return None
    if tail.endswith(THINK_OPEN):
        return _sequence(thinking, gap)
    if not _has_token(tok, THINK_OPEN):
        return None
    return _optional(_sequence({**thinking, "begin": THINK_OPEN}, gap))


def request_constraint(req: ChatRequest, tok: Any, prompt_text: str) -> dict | None:
    """The :attr:`~astralight.engine.SamplingSpec.constraint` of a request (None: none).

    ``tool_choice`` ``"required"`` / a named tool: tool calls only (:func:`tool_calls_format`;
    of every declared tool, or of the named one; one call with ``parallel_tool_calls: false``),
    after the reasoning the template allows (:func:`think_prefix`). Otherwise a JSON
    ``response_format``: the JSON document alone (vLLM's JSON schema / JSON object modes), or,
    with tools announced (``tool_choice`` ``"auto"``), the JSON document or tool calls."""
    if req.forced_tools:
        tools = [t for t in req.tools if req.tool_choice == "required"
                 or t["function"]["name"] == req.tool_name]
        calls = tool_calls_format(tools, req.parallel_tool_calls)
        return {"structural_tag": {"type": "structural_tag",
                                   "format": _sequence(think_prefix(tok, prompt_text), calls)}}
    fmt = req.response_format
    if fmt is None:
        return None
    schema = fmt["schema"] if fmt["type"] == "json_schema" else {"type": "object"}
    if req.use_tools and req.tools:
        answer = {"type": "json_schema", "json_schema": schema}
        calls = tool_calls_format(req.tools, req.parallel_tool_calls)
        return {"structural_tag": {"type": "structural_tag",
                                   "format": {"type": "or", "elements": [answer, calls]}}}
    return {"json_schema": schema} if fmt["type"] == "json_schema" else {"json_object": True}


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
    head, tail = split_at_last_close(text)  # the block regex on the head only: one pass
    content = (_TOOL_BLOCK.sub("", head) + tail).strip()
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
        tok = ep.engines[r.model_id].tokenizer
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


def completion_chunks(body: dict, include_usage: bool = False) -> list[dict]:
    """A ChatCompletion (:func:`completion_body`) as OpenAI's ``chat.completion.chunk`` stream:
    the role, the content (its log-probs with it), one chunk per tool call (``index``, ``id``,
    name and the whole ``arguments``), the finish reason, and with ``include_usage`` a last chunk
    with no choices and the usage (``usage`` null on the others, as OpenAI sends them)."""
    choice = body["choices"][0]
    message, logprobs = choice["message"], choice["logprobs"]
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
            "model": body["model"]}
    if include_usage:
        head["usage"] = None

    def chunk(delta: dict, finish: str | None = None, lp: dict | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                     "finish_reason": finish}]}

    deltas = []
    if message.get("content"):
        deltas.append({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or []):
        deltas.append({"tool_calls": [{"index": i, **call}]})
    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk(d, lp=logprobs if i == 0 else None) for i, d in enumerate(deltas)]
    out.append(chunk({}, choice["finish_reason"], None if deltas else logprobs))
    if include_usage:
        out.append({**head, "choices": [], "usage": body["usage"]})
    return out


def sse_events(chunks: list[dict]):
    """Server-sent events of ``chunks`` (``data: {json}``, a blank line after each), then
    ``data: [DONE]``: what OpenAI's clients read from a streamed call."""
    for c in chunks:
        yield f"data: {json.dumps(c, ensure_ascii=True, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"
