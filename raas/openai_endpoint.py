"""An OpenAI-compatible chat endpoint inside the RaaS, backed by a policy's engine, that records
every call token by token (astralight/ARCHITECTURE.md "Agentic episodes": a user's own agent,
plain ``openai`` client code, is trained unchanged).

One :class:`OpenAIEndpoint` per process (:func:`shared_endpoint`), started lazily by the first
workflow that needs it. It serves, per *episode*, the routes an ``openai.OpenAI(base_url=...)``
client calls:

- ``POST /v1/episodes/{episode_id}/chat/completions`` -- an OpenAI ChatCompletion;
- ``POST /v1/episodes/{episode_id}/responses`` -- the Responses API, on the same recorder
  (:mod:`~astralight.raas.openai_responses`);
- ``POST /v1/episodes/{episode_id}/v1/messages`` (and ``.../messages``) -- the Anthropic
  Messages API, on the same recorder (:mod:`~astralight.raas.anthropic_messages`);
- ``GET /v1/episodes/{episode_id}/models`` -- the episode's models: its policy's model_id, and
  for an agent team its teammates' (``open_episode(others=...)``); ``.../models/{model}``
  retrieves one. A call names its model in ``model`` and is served and recorded by that one.

A workflow opens an episode (:meth:`OpenAIEndpoint.open_episode`: the policy's engine, its
model_id, the asyncio loop the engine is driven from, sampling defaults), hands the agent
``base_url`` / ``api_key`` / ``model``, and closes it when the agent returns
(:meth:`OpenAIEndpoint.close_episode`): it gets the episode's :class:`CallRecord` list, each with
the exact prompt and completion token ids, the behaviour log-prob and the policy version of every
generated token, the finish reason and the request's messages. A call after the close (an agent
that timed out and kept going) is a 404.

How a request is served:

1. the HTTP thread (uvicorn in a daemon thread with its own event loop, so its signal handling and
   its lifetime never touch the RaaS's loop) checks the bearer token and the Origin/Host headers
   (:class:`~astralight.raas.openai_guard.LoopbackGuard`), reads the body up to its size limit
   and validates the JSON (:func:`~astralight.raas.openai_requests.parse_request`): anything the
   endpoint cannot honour exactly (``n > 1``, penalties, logit bias, ...) is a 400 naming the
   field, in OpenAI's error layout, never silently ignored;
2. the call is handed to the episode's loop (:func:`asyncio.run_coroutine_threadsafe`): the RaaS
   runs every workflow on one loop and the engine's callers and its tokenizer live there, exactly
   as for :class:`~astralight.workflows.tool_agent.ToolAgentWorkflow`; there
   :func:`~astralight.raas.openai_completions.complete` renders the messages and ``tools`` with
   the policy tokenizer's chat template (``add_generation_prompt=True``), generates with
   ``await engine.generate(ids, SamplingSpec)``, decodes, and records the call; the rendering,
   tokenizing and decoding run on worker threads, never on that loop, and a prompt whose
   rendered length proves it cannot fit the context is refused before it is tokenized;
3. the model's ``<tool_call>{json}</tool_call>`` blocks (Qwen3/Hermes, read by
   :func:`astralight.agents.tools.parse_tool_calls`) become OpenAI ``tool_calls`` (``arguments``
   a JSON string; ``content`` the text outside the blocks, null when empty; ``finish_reason``
   ``"tool_calls"``); ``usage`` counts the tokens;
4. with ``stream: true`` the same completion goes out as ``chat.completion.chunk``
   server-sent events once it is whole (role, content, each tool call, the finish reason,
   ``stream_options.include_usage``'s usage chunk, ``[DONE]``): streaming clients work, and
   nothing about the sampling or the record changes.

Security (astralight/ARCHITECTURE.md rule 4): bound to 127.0.0.1 only; every request needs
``Authorization: Bearer <token>`` with the process's random token (compared in constant time over
SHA-256 digests); browser-originated requests (an ``Origin`` header, a non-loopback ``Host``) are
refused; bodies are size-limited; episode ids are random, so one agent cannot reach another's
episode by guessing.

This module holds the server and its episode registry; the request checks are in
:mod:`~astralight.raas.openai_requests`, the guard in :mod:`~astralight.raas.openai_guard`, the
episode records in :mod:`~astralight.raas.openai_episodes` and the per-call work in
:mod:`~astralight.raas.openai_completions`; the names they define are importable from here too.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from astralight.raas.anthropic_messages import chat_body as anthropic_chat_body
from astralight.raas.anthropic_messages import message_body, message_events
from astralight.raas.openai_completions import (complete, completion_body, completion_chunks,
                                                 sse_events)
from astralight.raas.openai_episodes import CallRecord, Episode, EpisodeSettings
from astralight.raas.openai_guard import (LOOPBACK_HOSTS, LoopbackGuard, bearer_digest,
                                          request_digest)
from astralight.raas.openai_requests import (MAX_BODY_BYTES, ChatRequest, RequestError,
                                             bad_request, parse_request, read_json)
from astralight.raas.openai_responses import chat_body, response_body, response_events

__all__ = ["OpenAIEndpoint", "shared_endpoint", "EpisodeSettings", "Episode", "CallRecord",
           "ChatRequest", "RequestError", "parse_request", "MAX_BODY_BYTES"]

log = logging.getLogger("astralight.raas.openai")

#: a chat request's field names as the Responses API names them, in its refusals
RESPONSES_PARAM_NAMES = {"max_completion_tokens": "max_output_tokens",
                         "response_format": "text.format",
                         "tool_choice.function.name": "tool_choice.name"}

#: keys of closed episodes remembered, so a late call hears that its episode ended
CLOSED_KEYS_KEPT = 4096


class OpenAIEndpoint:
    """The loopback OpenAI-compatible server (see the module docstring).

    Args:
        token: the bearer token agents must send (default: a random one per process).
        max_body_bytes: a larger request body is a 413.
        host: the address to bind; only loopback addresses are accepted.
    """

    def __init__(self, token: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 host: str = "127.0.0.1"):
        if host not in LOOPBACK_HOSTS:
            raise ValueError(f"host: the OpenAI endpoint binds to loopback only, got {host!r}")
        self.token = token or secrets.token_urlsafe(32)
        self._expected = bearer_digest(self.token)
        self.max_body_bytes = int(max_body_bytes)
        self.host = host
        self.port = 0
        self._episodes: dict[str, Episode] = {}
        self._by_key: dict[bytes, str] = {}  # an open episode's key digest -> its id
        #: keys of recently closed episodes -> their ids (a late call is told the episode ended)
        self._closed_keys: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.counters = {"requests": 0, "refused": 0, "auth_failures": 0, "calls": 0,
                         "episodes_opened": 0, "episodes_closed": 0, "wrong_episode": 0}

    # -- lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, episode_id: str) -> str:
        """What an agent gives ``openai.OpenAI(base_url=...)``: the episode's own path."""
        return f"{self.url}/v1/episodes/{episode_id}"

    @property
    def shared_base_url(self) -> str:
        """One base URL for every episode of the process (``OPENAI_BASE_URL``, a client made
        once): the episode is chosen by the api key each call carries."""
        return f"{self.url}/v1"

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
                     loop: asyncio.AbstractEventLoop | None = None,
                     others: dict[str, Any] | None = None) -> Episode:
        """Register an episode whose calls ``engine`` serves on ``loop`` (default: the running
        loop, i.e. call this from the workflow's coroutine). ``others``: further models the
        episode may call by name, ``{model_id: engine}`` (an agent team's other policies and
        frozen models); each call is recorded under the model it named."""
        if not model_id:
            raise ValueError("model_id: an episode serves one named policy")
        if model_id in (others or {}):
            raise ValueError(f"others: {model_id!r} is the episode's own policy already")
        loop = loop or asyncio.get_running_loop()
        ep = Episode(secrets.token_hex(12), model_id, engine, loop, settings or EpisodeSettings(),
                     key=f"ep-{secrets.token_urlsafe(24)}", others=others)
        with self._lock:
            self._episodes[ep.id] = ep
            self._by_key[bearer_digest(ep.key)] = ep.id
            self.counters["episodes_opened"] += 1
        return ep

    def close_episode(self, episode_id: str) -> list[CallRecord]:
        """End an episode: later calls are 404s, calls in flight are cancelled; returns its
        records in call order."""
        with self._lock:
            ep = self._episodes.pop(episode_id, None)
            if ep is None:
                return []
            digest = bearer_digest(ep.key)
            self._by_key.pop(digest, None)
            self._closed_keys[digest] = ep.id
            while len(self._closed_keys) > CLOSED_KEYS_KEPT:
                self._closed_keys.popitem(last=False)
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

    def _accepts(self, digest: bytes) -> bool:
        """The guard's test: the process token, or the key of an open or recently closed
        episode (a late call is then told its episode ended, not that its key is wrong)."""
        if hmac.compare_digest(digest, self._expected):
            return True
        with self._lock:
            return digest in self._by_key or digest in self._closed_keys

    def _episode_of(self, request: Request, episode_id: str | None) -> Episode:
        """The episode a request is for: the one its path names (``/v1/episodes/ID/...``) or,
        on the key-routed paths (``/v1/...``), the one whose key it carries. A call with one
        episode's key on another episode's path is refused (403) and counted: it would put one
        task's conversation into another task's samples, scored with the wrong reward."""
        digest = request_digest(request.scope["headers"])
        with self._lock:
            owner = self._by_key.get(digest) or self._closed_keys.get(digest)
        if episode_id is None:
            if owner is None:
                raise RequestError(400, "authorization", "authorization: this path chooses the "
                                   "episode by its api key, and the process token names none; "
                                   "pass the api_key the agent was given, or use base_url "
                                   ".../v1/episodes/EPISODE_ID", "episode_key_required")
            episode_id = owner
        elif owner is not None and owner != episode_id:
            self._count("wrong_episode")
            log.warning("a call with episode %s's key reached episode %s's path: refused (an "
                        "agent sharing one client across episodes?)", owner, episode_id)
            raise RequestError(403, "authorization", "authorization: this api key belongs to "
                               "another episode; each episode must call with its own base_url "
                               "and api_key (a client shared across episodes mixes their "
                               "conversations)", "wrong_episode", "permission_error")
        return self._episode(episode_id)

    # -- the ASGI app

    def _app(self) -> Any:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        def error(exc: RequestError) -> JSONResponse:
            self._count("refused")
            return ErrorResponse(exc.body(), status_code=exc.status)

        def episode(request: Request) -> Episode:  # by the path's episode_id, else by the key
            return self._episode_of(request, request.path_params.get("episode_id"))

        async def models(request: Request):
            try:
                ep = episode(request)
            except RequestError as exc:
                return error(exc)
            return {"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                                "owned_by": "astralight"} for m in ep.engines]}

        async def model(request: Request):
            model = request.path_params["model"]
            try:
                ep = episode(request)
                if model not in ep.engines:
                    raise RequestError(404, "model", f"model: {model!r} is not served to this "
                                       f"episode; it serves {served(ep)}", "model_not_found")
            except RequestError as exc:
                return error(exc)
            return {"id": model, "object": "model", "created": 0, "owned_by": "astralight"}

        async def chat_completions(request: Request):
            try:
                ep = episode(request)
                req = parse_request(await read_json(request, self.max_body_bytes))
                body = await self._serve(ep, req)
            except RequestError as exc:
                return error(exc)
            if not req.stream:
                return JSONResponse(body)
            # generated to its end already (the record is exact): its chunks, as server-sent
            # events; an error before this point is a plain JSON error, as OpenAI answers one
            return sse(sse_events(completion_chunks(body, req.include_usage)))

        async def responses(request: Request):
            try:
                ep = episode(request)
                raw = await read_json(request, self.max_body_bytes)
                chat = chat_body(raw, ep)
                req = parse_request(chat)
                record = await self._record(ep, req)
                body = await asyncio.to_thread(response_body, ep, record, raw, chat, req.logprobs)
            except RequestError as exc:  # named as the Responses request names the field
                exc.param = RESPONSES_PARAM_NAMES.get(exc.param, exc.param)
                return error(exc)
            if not raw.get("stream"):
                return JSONResponse(body)
            return sse(f"event: {e['type']}\ndata: {_json(e)}\n\n"
                       for e in response_events(body))

        async def messages(request: Request):
            try:
                ep = episode(request)
                raw = await read_json(request, self.max_body_bytes)
                req = parse_request(anthropic_chat_body(raw))
                record = await self._record(ep, req)
                body = await asyncio.to_thread(message_body, ep, record)
            except RequestError as exc:
                if exc.param == "max_completion_tokens":  # named as the Messages API names it
                    exc.param = "max_tokens"
                return error(exc)
            if not raw.get("stream"):
                return JSONResponse(body)
            return sse(f"event: {name}\ndata: {_json(data)}\n\n"
                       for name, data in message_events(body))

        # each route twice: under the episode's own path, and under /v1 with the episode chosen
        # by the api key (one base_url for a whole process); the anthropic SDK appends
        # /v1/messages to its base_url, so the episode path serves that too
        for prefix in ("/v1/episodes/{episode_id}", "/v1"):
            app.add_api_route(f"{prefix}/models", models, methods=["GET"])
            app.add_api_route(f"{prefix}/models/{{model}}", model, methods=["GET"])
            app.add_api_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
            app.add_api_route(f"{prefix}/responses", responses, methods=["POST"])
            app.add_api_route(f"{prefix}/messages", messages, methods=["POST"])
        app.add_api_route("/v1/episodes/{episode_id}/v1/messages", messages, methods=["POST"])

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        async def unknown(path: str):
            return error(RequestError(404, "path", f"path: /{path} is not served here; use "
                                      "base_url .../v1/episodes/EPISODE_ID", "not_found"))

        return LoopbackGuard(app, self._accepts, self._count)

    async def _serve(self, ep: Episode, req: ChatRequest) -> dict:
        """Admit the call, run it on the episode's loop, answer a ChatCompletion."""
        record = await self._record(ep, req)
        # off this server's loop: with logprobs, every token is decoded on its own
        return await asyncio.to_thread(completion_body, ep, record, req.logprobs)

    async def _record(self, ep: Episode, req: ChatRequest) -> CallRecord:
        """Admit the call and run it on the episode's loop; its record."""
        if req.model not in ep.engines:
            team = f"; its team serves {served(ep)}" if len(ep.engines) > 1 else ""
            raise RequestError(404, "model", f"model: {req.model!r} is not served to this "
                               f"episode; use {ep.model_id!r} (the model argument the agent was "
                               f"given){team}", "model_not_found")
        with self._lock:
            if ep.closed:
                raise self._closed(ep)
            if ep.started >= ep.settings.max_calls:
                raise bad_request("messages", f"this episode already made max_calls="
                                  f"{ep.settings.max_calls} calls; end the episode or raise "
                                  "max_calls", "max_calls_exceeded")
            index = ep.started
            ep.started += 1
            try:
                fut = asyncio.run_coroutine_threadsafe(complete(ep, req, index), ep.loop)
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
        self._count("calls")
        return record

    def _count(self, name: str) -> None:
        """Add one to ``counters[name]`` (from the HTTP thread or the guard)."""
        with self._lock:
            self.counters[name] += 1

    @staticmethod
    def _closed(ep: Episode) -> RequestError:
        return RequestError(404, "episode_id", f"episode_id: {ep.id!r} ended (the agent's "
                            "episode timed out or finished) while this call was made",
                            "episode_not_found")


def served(ep: Episode) -> str:
    """The models an episode may call, for a refusal: ``'policy'`` or ``'a', 'b'``."""
    return ", ".join(repr(m) for m in ep.engines)


def sse(events) -> StreamingResponse:
    """Server-sent events (already formatted) as the response of a streamed call."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=True, separators=(",", ":"))


class ErrorResponse(JSONResponse):
    """A refusal's JSON with every non-ASCII character escaped: a message that quotes what the
    request sent (a field name, a value) can never fail to encode (a lone surrogate has no
    UTF-8 form), so a refusal is never turned into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


_SHARED: OpenAIEndpoint | None = None
_SHARED_LOCK = threading.Lock()


def shared_endpoint() -> OpenAIEndpoint:
    """The process's endpoint, started on first use (every workflow of the RaaS shares it)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = OpenAIEndpoint().start()
        return _SHARED
