"""An OpenAI-compatible chat endpoint inside the RaaS, backed by a policy's engine, that records
every call token by token (ARCHITECTURE "Agentic episodes": a user's own agent, plain ``openai``
client code, is trained unchanged).

One :class:`OpenAIEndpoint` per process (:func:`shared_endpoint`), started lazily by the first
workflow that needs it. It serves, per *episode*, the routes an ``openai.OpenAI(base_url=...)``
client calls:

- ``POST /v1/episodes/{episode_id}/chat/completions`` -- an OpenAI ChatCompletion;
- ``GET /v1/episodes/{episode_id}/models`` -- the episode's one model (its policy's model_id).

A workflow opens an episode (:meth:`OpenAIEndpoint.open_episode`: the policy's engine, its
model_id, the asyncio loop the engine is driven from, sampling defaults), hands the agent
``base_url`` / ``api_key`` / ``model``, and closes it when the agent returns
(:meth:`OpenAIEndpoint.close_episode`): it gets the episode's :class:`CallRecord` list, each with
the exact prompt and completion token ids, the behaviour log-prob and the policy version of every
generated token, the finish reason and the request's messages. A call after the close (an agent
that timed out and kept going) is a 404.

How a request is served:

1. the HTTP thread (uvicorn in a daemon thread with its own event loop, so its signal handling and
   its lifetime never touch the RaaS's loop) checks the bearer token, the Origin/Host headers and
   the body size, and validates the JSON (:func:`parse_request`): anything the endpoint cannot
   honour exactly (``n > 1``, streaming, penalties, logit bias, multi-token stop strings, ...) is a
   400 naming the field, in OpenAI's error layout, never silently ignored;
2. the call is handed to the episode's loop (:func:`asyncio.run_coroutine_threadsafe`): the RaaS
   runs every workflow on one loop and the engine's callers and its tokenizer live there, exactly
   as for :class:`~astralight.workflows.tool_agent.ToolAgentWorkflow`; there the messages and
   ``tools`` are rendered by the policy tokenizer's chat template
   (``add_generation_prompt=True``), generated with ``await engine.generate(ids, SamplingSpec)``,
   decoded, and recorded;
3. the model's ``<tool_call>{json}</tool_call>`` blocks (Qwen3/Hermes, read by
   :func:`astralight.agents.tools.parse_tool_calls`) become OpenAI ``tool_calls`` (``arguments``
   a JSON string; ``content`` the text outside the blocks, null when empty; ``finish_reason``
   ``"tool_calls"``); ``usage`` counts the tokens.

Security (ARCHITECTURE rule 4): bound to 127.0.0.1 only; every request needs ``Authorization:
Bearer <token>`` with the process's random token (compared in constant time over SHA-256 digests);
browser-originated requests (an ``Origin`` header, a non-loopback ``Host``) are refused; bodies are
size-limited; episode ids are random, so one agent cannot reach another's episode by guessing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import json
import logging
import math
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from astralight.agents.chat import encode, render
from astralight.agents.tools import parse_tool_calls
from astralight.engine import SamplingSpec
from astralight.workflows.chat_episodes import decode_turn

log = logging.getLogger("astralight.raas.openai")

#: most bytes of one request body (a long conversation with tool results fits many times over)
MAX_BODY_BYTES = 8 << 20
#: most messages / tools in one request
MAX_MESSAGES = 4096
MAX_TOOLS = 256
#: OpenAI accepts at most four stop sequences
MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant", "tool")
#: request fields that change nothing here (metadata for OpenAI's own bookkeeping)
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "parallel_tool_calls", "service_tier",
                            "stream_options", "prediction"})
KNOWN_FIELDS = frozenset({"model", "messages", "tools", "tool_choice", "temperature", "top_p",
                          "max_tokens", "max_completion_tokens", "stop", "n", "stream", "seed",
                          "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty",
                          "logit_bias", "response_format"}) | IGNORED_FIELDS

_TOOL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


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


def _bad(param: str, message: str, code: str | None = None) -> RequestError:
    return RequestError(400, param, f"{param}: {message}", code)


# ----------------------------------------------------------------------------- requests


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


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    try:
        finite = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise _bad(name, f"must be a finite number, got {str(v)[:40]}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _bad(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(name, f"must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _text_content(content: Any, where: str, allow_none: bool) -> str | None:
    """A message's content as text: a string, or a list of ``{"type": "text", "text"}`` parts
    (joined); images and audio are refused (the policy reads text only)."""
    if content is None:
        if allow_none:
            return None
        raise _bad(where, "is required for this role")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise _bad(f"{where}[{j}]", "only {\"type\": \"text\", \"text\": ...} parts are "
                           "supported (the policy reads text)")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(where, f"must be a string or a list of text parts, got {type(content).__name__}")


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise _bad(where, "must be a list")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(w, 'expected {"type": "function", "function": {"name", "arguments"}}')
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise _bad(f"{w}.function.arguments", "must be a JSON string")
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "must be a non-empty list of messages")
    if len(value) > MAX_MESSAGES:
        raise _bad("messages", f"at most {MAX_MESSAGES} messages, got {len(value)}")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"must be one of {list(ROLES)}, got {role!r}")
        msg: dict = {"role": "system" if role == "developer" else role}
        has_calls = role == "assistant" and m.get("tool_calls")
        msg["content"] = _text_content(m.get("content"), f"{where}.content",
                                       allow_none=role == "assistant")
        if has_calls:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
            if msg["content"] is None:  # templates test '</think>' in content: give them text
                msg["content"] = ""
        elif msg["content"] is None:
            raise _bad(f"{where}.content", "an assistant message needs content or tool_calls")
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise _bad(f"{where}.{key}", "must be a string")
                msg[key] = m[key]
        out.append(msg)
    return out


def _tools(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise _bad("tools", f"must be a list of at most {MAX_TOOLS} tools")
    out = []
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(
                fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}]", 'expected {"type": "function", "function": {"name", '
                       '"description", "parameters"}}')
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters", "must be a JSON schema object")
        out.append({"type": "function", "function": dict(fn)})
    return out


def parse_request(body: Any) -> ChatRequest:
    """Validate a chat completions body; RequestError (400, naming the field) for anything the
    endpoint cannot honour exactly."""
    if not isinstance(body, dict):
        raise _bad("body", "must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise _bad(unknown[0], f"unknown field (this endpoint supports {sorted(KNOWN_FIELDS)})")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "is required: the policy's model id (GET .../models lists it)")
    n = _integer(body, "n", 1, 1 << 30)
    if n not in (None, 1):
        raise _bad("n", f"only n=1 is supported (each call is one recorded completion), got {n}; "
                   "call once per completion")
    if body.get("stream"):
        raise _bad("stream", "streaming is not supported; leave stream unset")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, -2.0, 2.0) not in (None, 0.0):
            raise _bad(name, "penalties are not supported (they would change the behaviour "
                       "log-probs the trainer corrects for); leave it unset or 0")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "is not supported; leave it unset")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad("response_format", 'only {"type": "text"} is supported')
    if _integer(body, "top_logprobs", 0, 20) not in (None, 0):
        raise _bad("top_logprobs", "is not supported (only the sampled tokens' log-probs); "
                   "leave it unset or 0")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("logprobs", "must be true or false")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise _bad("tool_choice", f'only "auto" and "none" are supported, got {tool_choice!r}')
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise _bad("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise _bad("stop", f"at most {MAX_STOP} non-empty strings")
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 1 << 30)
    return ChatRequest(
        model=model, messages=_messages(body.get("messages")), tools=_tools(body.get("tools")),
        use_tools=tool_choice != "none", temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True), max_tokens=max_tokens, stop=stops,
        seed=_integer(body, "seed", -(1 << 63), (1 << 63) - 1), logprobs=bool(logprobs))


# ----------------------------------------------------------------------------- records


@dataclass
class CallRecord:
    """One served call, exactly as the policy saw and produced it.

    ``prompt_ids`` is the chat template's rendering of the request (generation prompt included);
    ``completion_ids`` / ``logprobs`` / ``versions`` are the engine's tokens (the stop token
    included), their behaviour log-probs and the policy version that sampled each;
    ``version`` is the engine's version when the call was submitted. ``tool_calls`` are those
    returned to the agent (OpenAI schema); ``tool_call_errors`` counts blocks that could not be
    read (``malformed``) or name a tool the request did not declare (``unknown_tool``).
    """

    index: int
    model_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    version: int
    messages: list[dict]
    tools: list[dict]
    text: str
    content: str | None
    tool_calls: list[dict]
    tool_call_errors: dict[str, int]
    temperature: float


@dataclass
class EpisodeSettings:
    """How an episode's calls are sampled.

    Args:
        sampling: defaults for what a request leaves unset (temperature, top_p, max_tokens,
            seed); with a seed, call ``i`` of the episode is seeded
            ``sampling.for_request(seed_slot + i * seed_stride, seed_key)``.
        force_sampling: the sampling's temperature, top_p and seed replace the request's (an
            agent written for greedy evaluation still explores during training, and a seed it
            hard-codes does not make every episode of a group the same).
        max_calls: most calls per episode; the next one is a 400 naming ``messages``.
        chat_template_kwargs: extra chat template variables (``enable_thinking``...).
        max_context_tokens: most prompt + completion tokens per call (the engine's
            ``max_model_len`` bounds it too).
    """

    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    force_sampling: bool = False
    max_calls: int = 16
    chat_template_kwargs: dict = field(default_factory=dict)
    max_context_tokens: int | None = None
    seed_key: str = ""
    seed_slot: int = 0
    seed_stride: int = 1


class Episode:
    """One agent run's view of the endpoint: its engine, loop, settings and records."""

    def __init__(self, episode_id: str, model_id: str, engine: Any,
                 loop: asyncio.AbstractEventLoop, settings: EpisodeSettings):
        self.id, self.model_id, self.engine, self.loop = episode_id, model_id, engine, loop
        self.settings = settings
        self.calls: list[CallRecord] = []  # appended on ``loop`` only
        self.started = 0  # calls admitted (the next call's index)
        self.refused = 0  # calls answered with an error
        self.closed = False
        self.pending: set[concurrent.futures.Future] = set()


# ----------------------------------------------------------------------------- the server


class OpenAIEndpoint:
    """The loopback OpenAI-compatible server (see the module docstring).

    Args:
        token: the bearer token agents must send (default: a random one per process).
        max_body_bytes: a larger request body is a 413.
        host: the address to bind; only loopback addresses are accepted.
    """

    def __init__(self, token: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 host: str = "127.0.0.1"):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"host: the OpenAI endpoint binds to loopback only, got {host!r}")
        self.token = token or secrets.token_urlsafe(32)
        self._expected = hashlib.sha256(f"Bearer {self.token}".encode()).digest()
        self.max_body_bytes = int(max_body_bytes)
        self.host = host
        self.port = 0
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.counters = {"requests": 0, "refused": 0, "auth_failures": 0, "calls": 0,
                         "episodes_opened": 0, "episodes_closed": 0}

    # -- lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, episode_id: str) -> str:
        """What an agent gives ``openai.OpenAI(base_url=...)``."""
        return f"{self.url}/v1/episodes/{episode_id}"

    def start(self, timeout_s: float = 30.0) -> "OpenAIEndpoint":
        """Bind a free loopback port and serve from a daemon thread; returns once listening."""
        if self._thread is not None:
            return self
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        sock.listen(256)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False,
                                lifespan="off", loop="asyncio", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True, name="openai-endpoint")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"OpenAI endpoint: the server did not start on {self.url}")
            time.sleep(0.01)
        log.info("OpenAI-compatible endpoint serving on %s", self.url)
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving (open episodes are closed: their calls in flight are cancelled)."""
        with self._lock:
            ids = list(self._episodes)
        for eid in ids:
            self.close_episode(eid)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self._server = self._thread = None

    # -- episodes

    def open_episode(self, engine: Any, model_id: str, settings: EpisodeSettings | None = None,
                     loop: asyncio.AbstractEventLoop | None = None) -> Episode:
        """Register an episode whose calls ``engine`` serves on ``loop`` (default: the running
        loop, i.e. call this from the workflow's coroutine)."""
        if not model_id:
            raise ValueError("model_id: an episode serves one named policy")
        loop = loop or asyncio.get_running_loop()
        ep = Episode(secrets.token_hex(12), model_id, engine, loop, settings or EpisodeSettings())
        with self._lock:
            self._episodes[ep.id] = ep
            self.counters["episodes_opened"] += 1
        return ep

    def close_episode(self, episode_id: str) -> list[CallRecord]:
        """End an episode: later calls are 404s, calls in flight are cancelled; returns its
        records in call order."""
        with self._lock:
            ep = self._episodes.pop(episode_id, None)
            if ep is None:
                return []
            ep.closed = True
            pending = list(ep.pending)
            self.counters["episodes_closed"] += 1
        for fut in pending:
            fut.cancel()
        return sorted(ep.calls, key=lambda r: r.index)

    def _episode(self, episode_id: str) -> Episode:
        with self._lock:
            ep = self._episodes.get(episode_id)
        if ep is None:
            raise RequestError(404, "episode_id", f"episode_id: {episode_id!r} is not open (it "
                               "ended, timed out, or never existed)", "episode_not_found")
        return ep

    # -- the ASGI app

    def _app(self) -> Any:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        def error(exc: RequestError) -> JSONResponse:
            with self._lock:
                self.counters["refused"] += 1
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.get("/v1/episodes/{episode_id}/models")
        async def models(episode_id: str):
            try:
                ep = self._episode(episode_id)
            except RequestError as exc:
                return error(exc)
            return {"object": "list", "data": [{"id": ep.model_id, "object": "model",
                                                "created": 0, "owned_by": "astralight"}]}

        @app.post("/v1/episodes/{episode_id}/chat/completions")
        async def chat_completions(episode_id: str, request: Request):
            try:
                ep = self._episode(episode_id)
                req = parse_request(await self._read_json(request))
                return JSONResponse(await self._serve(ep, req))
            except RequestError as exc:
                return error(exc)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        async def unknown(path: str):
            return error(RequestError(404, "path", f"path: /{path} is not served here; use "
                                      "base_url .../v1/episodes/EPISODE_ID", "not_found"))

        return _Guard(app, self)

    async def _read_json(self, request: Any) -> Any:
        size, chunks = 0, []
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise RequestError(413, "body", f"body: larger than {self.max_body_bytes} bytes")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _bad("body", f"not valid JSON ({exc})") from None
        except RecursionError:
            raise _bad("body", "JSON nested too deeply") from None

    async def _serve(self, ep: Episode, req: ChatRequest) -> dict:
        """Admit the call, run it on the episode's loop, answer a ChatCompletion."""
        if req.model != ep.model_id:
            raise RequestError(404, "model", f"model: {req.model!r} is not served to this "
                               f"episode; use {ep.model_id!r} (the model argument the agent was "
                               "given)", "model_not_found")
        with self._lock:
            if ep.closed:
                raise self._closed(ep)
            if ep.started >= ep.settings.max_calls:
                raise _bad("messages", f"this episode already made max_calls="
                           f"{ep.settings.max_calls} calls; end the episode or raise max_calls",
                           "max_calls_exceeded")
            index = ep.started
            ep.started += 1
            try:
                fut = asyncio.run_coroutine_threadsafe(self._complete(ep, req, index), ep.loop)
            except RuntimeError:  # the episode's loop is gone
                raise self._closed(ep) from None
            ep.pending.add(fut)
        try:
            record = await asyncio.wrap_future(fut)
        except (asyncio.CancelledError, concurrent.futures.CancelledError):
            if fut.cancelled():  # close_episode cancelled it
                raise self._closed(ep) from None
            fut.cancel()  # this handler was cancelled (shutdown): stop the generation too
            raise
        except RequestError:
            raise
        except Exception as exc:  # the engine failed: not the agent's fault
            log.exception("episode %s: call %d failed in the engine", ep.id, index)
            raise RequestError(500, None, f"the policy engine failed: {type(exc).__name__}: "
                               f"{exc}", "engine_error", "server_error") from None
        finally:
            with self._lock:
                ep.pending.discard(fut)
        with self._lock:
            self.counters["calls"] += 1
        return _completion_body(ep, record, req.logprobs)

    @staticmethod
    def _closed(ep: Episode) -> RequestError:
        return RequestError(404, "episode_id", f"episode_id: {ep.id!r} ended (the agent's "
                            "episode timed out or finished) while this call was made",
                            "episode_not_found")

    async def _complete(self, ep: Episode, req: ChatRequest, index: int) -> CallRecord:
        """On the episode's loop: render, generate, parse, record."""
        engine, s = ep.engine, ep.settings
        tok = engine.tokenizer
        tools = req.tools if req.use_tools else []
        try:
            text = render(tok, req.messages, tools, True, **s.chat_template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's
            raise _bad("messages", f"the policy's chat template cannot render them "
                       f"({type(exc).__name__}: {exc})") from None
        ids = encode(tok, text)
        limit = getattr(engine, "max_model_len", None)
        if s.max_context_tokens is not None:
            limit = s.max_context_tokens if limit is None else min(int(limit), s.max_context_tokens)
        room = None if limit is None else int(limit) - len(ids)
        if room is not None and room < 1:
            raise _bad("messages", f"the conversation is {len(ids)} tokens; the policy's "
                       f"context holds {limit} (prompt and completion)", "context_length_exceeded")
        stop_ids = []
        for j, stop in enumerate(req.stop):
            sid = encode(tok, stop)
            if len(sid) != 1:
                raise _bad(f"stop[{j}]" if len(req.stop) > 1 else "stop",
                           f"{stop!r} is {len(sid)} tokens of the policy's tokenizer; only "
                           "single-token stop sequences are supported")
            stop_ids.append(sid[0])
        spec = self._spec(ep, req, index, room, stop_ids)
        version = int(engine.version)
        completion = await engine.generate(ids, spec)
        if completion.finish_reason == "abort":
            raise RequestError(503, None, "the policy engine aborted this call; retry",
                               "engine_aborted", "server_error")
        out = decode_turn(tok, completion)
        content, calls, errors = _split_tool_calls(out, tools, ep.id, index)
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

    @staticmethod
    def _spec(ep: Episode, req: ChatRequest, index: int, room: int | None,
              stop_ids: list[int]) -> SamplingSpec:
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


class _Guard:
    """ASGI middleware around the whole app: bearer token (constant time), no browser
    requests (Origin header, non-loopback Host), counted. Lifespan events pass."""

    def __init__(self, app: Any, endpoint: OpenAIEndpoint):
        self.app, self.endpoint = app, endpoint

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        ep = self.endpoint
        with ep._lock:
            ep.counters["requests"] += 1
        auth = [v for k, v in scope["headers"] if k == b"authorization"]
        got = hashlib.sha256(auth[0] if len(auth) == 1 else b"").digest()
        host = headers.get(b"host", b"").decode("latin-1").rsplit(":", 1)[0].strip("[]")
        refusal = None
        if not hmac.compare_digest(got, ep._expected):
            with ep._lock:
                ep.counters["auth_failures"] += 1
            refusal = RequestError(401, "authorization", "authorization: missing or wrong "
                                   "bearer token; pass the api_key the agent was given",
                                   "invalid_api_key", "authentication_error")
        elif b"origin" in headers or host not in ("127.0.0.1", "localhost", "::1"):
            refusal = RequestError(403, "origin", "origin: browser or non-loopback requests are "
                                   "refused", "forbidden", "permission_error")
        if refusal is None:
            await self.app(scope, receive, send)
            return
        with ep._lock:
            ep.counters["refused"] += 1
        body = json.dumps(refusal.body()).encode()
        await send({"type": "http.response.start", "status": refusal.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _split_tool_calls(text: str, tools: list[dict], episode_id: str,
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


def _completion_body(ep: Episode, r: CallRecord, with_logprobs: bool) -> dict:
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


_SHARED: OpenAIEndpoint | None = None
_SHARED_LOCK = threading.Lock()


def shared_endpoint() -> OpenAIEndpoint:
    """The process's endpoint, started on first use (every workflow of the RaaS shares it)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = OpenAIEndpoint().start()
        return _SHARED
