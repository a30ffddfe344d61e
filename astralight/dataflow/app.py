"""HTTP face of the dataflow service (FastAPI): routes under ``/v1``, msgpack bodies.

Request and response bodies are msgpack (``application/msgpack``, via :mod:`astralight.protocol`);
only ``/v1/info``, ``/v1/stats``, ``/v1/eval/{model_id}`` (and its ``/{version}/completions``, a
few sample completions per evaluated version) and ``/v1/counters/{model_id}`` answer JSON, and weight files travel as raw bytes (with HTTP Range on download). A bad request gets a 4xx
JSON ``{"error", "field"}``; an unexpected exception a 500 JSON, logged with its traceback; neither
stops the server.

Security, enforced here so that nothing invalid reaches the core (:class:`Dataflow`):

* **access** -- :class:`~astralight.dataflow.auth.AccessGuard` wraps the whole ASGI app: with a
  token configured every route (and any route added later, and unknown paths) needs
  ``Authorization: Bearer <token>`` (constant-time over SHA-256 digests), and the token's scope
  (rollout, trainer, admin; ``ASTRALIGHT_TOKEN`` grants all) must be one the route's line in
  :data:`astralight.dataflow.auth.ROUTES` names. Handlers then check what needs the body: a
  trainer token bound to a model_id acts on that model_id only, and a rollout caller acts only as
  an instance whose ``instance_secret`` (answered by register) it sends, pushing only tasks
  leased to it. Always: requests with ``Origin`` are refused (403) and bodies must be msgpack
  (415); without any token, a ``Host`` that is not loopback or the configured host too (403).
* **size** -- every msgpack body is read through :func:`read_body` (``max_body_bytes``, 413 before
  parsing); weight uploads are streamed against ``max_weight_file_bytes``.
* **schema** -- :func:`astralight.protocol.decode` refuses anything but plain msgpack values
  (no extension types, no object arrays, bounded nesting, array dtype/shape/byte-count checked);
  each route then accepts only its own fields (an unknown field is a 422), with types, ranges
  and lengths checked (ids: 1..256 printable characters; counts and versions bounded so that
  they fit SQLite's integers; every float finite). The core adds the checks that need state:
  model_id known, task leased, versions newer, sha256 of uploads.
* **observation** -- :class:`ClientStats` counts requests and 4xx/5xx answers per client address
  and per ``instance_id`` named in a body, shown under ``clients`` / ``client_instances`` in
  ``/v1/stats``; a client's 1st, 10th, 100th... failure is logged.
* **no code from the wire** -- nothing here unpickles or evaluates client data; bodies are msgpack
  decoded by :mod:`astralight.protocol` only.

Batched pushes: ``POST /v1/push_many`` takes ``{instance_id, items: [{task_id, samples}]}``
(1..``MAX_PUSH_ITEMS`` items, the whole body within ``max_body_bytes``) and pushes each item
exactly as ``POST /v1/push`` would (idempotent per task). Each item is answered on its own, in
order, under ``results``: ``{status: 200, reply: {accepted, filtered, duplicate}}`` or
``{status, error, field}`` with push's own status and field names (``samples[0].reward``). The
request answers 200 when any item succeeded, else the first refusal's 4xx (``field``:
``items[i].<field>``), still with every item's answer. A bad envelope (not a map, an unknown
top-level field, no items, too many) is a plain 4xx, as is a body that does not decode.
Every answer, single or batched, leaves once its commits are durable (group commit:
:mod:`astralight.dataflow.durability`).

Route handlers only parse and format: the state machine is :class:`~astralight.dataflow.core.Dataflow`,
whose blocking calls (SQLite commits with fsync) run in the thread pool so that long-polling pulls
keep waiting on the event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import threading
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from stat import S_ISREG
from typing import Any

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from astralight.dataflow import auth, evals, membership
from astralight.dataflow.auth import AccessGuard, Credentials, InstanceSecrets
from astralight.dataflow.client import ACK_TIMEOUT_HEADER  # the pull's batch_ack_timeout_s
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.weightfiles import fs_error
from astralight.protocol import (MAX_VERSION, ProtocolError, Sample, WeightManifest, decode,
                                 encode, expect)

log = logging.getLogger("astralight.dataflow")

MSGPACK = "application/msgpack"
_REQUIRED = object()

MAX_ID_LEN = 256  # instance, task, batch, trainer ids
MAX_COUNT = 1_000_000  # capacities and in-flight counts
MAX_LIST = 4096  # model_ids or task_ids in one request
MAX_SECONDS = 1e7  # timings and timeouts
MAX_ABS_REWARD = 1e9  # beyond this the group statistics' variance overflows float64
MAX_INT64 = (1 << 63) - 1
MAX_PUSH_ITEMS = 1024  # tasks in one POST /v1/push_many (the body limit bounds the samples)
PUSH_ITEM_FIELDS = ("task_id", "samples")

#: per request: what the handlers learned about the caller (instance_id, failing field)
_REQUEST: contextvars.ContextVar[dict | None] = contextvars.ContextVar("astralight_request",
                                                                        default=None)


def _note(**kw) -> None:
    """Tell :class:`ClientStats` about the current request (works from the thread pool too:
    the context is copied, the dict it holds is shared)."""
    info = _REQUEST.get()
    if info is not None:
        info.update(kw)


# ----------------------------------------------------------------------------- plumbing


_LOG_AT = frozenset(10 ** k for k in range(13))  # log a client's 1st, 10th, 100th... failure


class _ClientEntry:
    """Counters of one client (an address or an instance_id)."""

    __slots__ = ("requests", "failures_4xx", "failures_5xx", "auth_failures", "first_seen",
                 "last_seen", "last_failure", "_buckets", "_stamps")

    def __init__(self, now: float):
        self.requests = self.failures_4xx = self.failures_5xx = self.auth_failures = 0
        self.first_seen = self.last_seen = now
        self.last_failure: dict | None = None
        self._buckets = [0] * 60  # failures per second over the last minute (a ring)
        self._stamps = [0] * 60

    def fail(self, now: float) -> None:
        sec = int(now)
        i = sec % 60
        if self._stamps[i] != sec:
            self._stamps[i], self._buckets[i] = sec, 0
        self._buckets[i] += 1

    def as_dict(self, now: float) -> dict:
        sec = int(now)
        recent = sum(b for b, t in zip(self._buckets, self._stamps) if sec - t < 60)
        return {"requests": self.requests, "failures_4xx": self.failures_4xx,
                "failures_5xx": self.failures_5xx, "auth_failures": self.auth_failures,
                "failures_last_60s": recent, "first_seen": self.first_seen,
                "last_seen": self.last_seen, "last_failure": self.last_failure}


class ClientTracker:
    """Requests and failures per client address and per ``instance_id``, bounded in memory.

    At most ``max_entries`` of each are kept; the least recently seen is forgotten first (counted
    in ``evicted``), so a flood of made-up instance ids cannot grow the table.
    """

    def __init__(self, max_entries: int = 1024):
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._tables: dict[str, OrderedDict[str, _ClientEntry]] = {
            "address": OrderedDict(), "instance": OrderedDict()}
        self.evicted = 0

    def _entry(self, kind: str, key: str, now: float) -> _ClientEntry:
        table = self._tables[kind]
        entry = table.get(key)
        if entry is None:
            entry = table[key] = _ClientEntry(now)
            while len(table) > self.max_entries:
                table.popitem(last=False)
                self.evicted += 1
        else:
            table.move_to_end(key)
        return entry

    def record(self, address: str, instance_id: str | None, status: int, method: str, path: str,
               field_name: str | None, now: float | None = None) -> None:
        now = time.time() if now is None else now
        failed = status >= 400
        with self._lock:
            keys = [("address", address)] + ([("instance", instance_id)] if instance_id else [])
            for kind, key in keys:
                e = self._entry(kind, key, now)
                e.requests += 1
                e.last_seen = now
                if not failed:
                    continue
                if status >= 500:
                    e.failures_5xx += 1
                else:
                    e.failures_4xx += 1
                if status in (401, 403):
                    e.auth_failures += 1
                e.fail(now)
                e.last_failure = {"time": now, "status": status, "method": method,
                                  "path": path[:200], "field": field_name}
                n = e.failures_4xx + e.failures_5xx
                if n in _LOG_AT:
                    log.warning("client %s (%s): %d failed request(s), last %d %s %s (field %s)",
                                key, kind, n, status, method, path[:200], field_name)

    def snapshot(self, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        with self._lock:
            return {kind: {k: e.as_dict(now) for k, e in table.items()}
                    for kind, table in self._tables.items()} | {"evicted": self.evicted}


class ClientStats:
    """ASGI middleware (outermost): records every HTTP answer's status per client in a
    :class:`ClientTracker`, including 401s of :class:`BearerAuth` and unhandled errors."""

    def __init__(self, app, tracker: ClientTracker):
        self.app = app
        self.tracker = tracker

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        info: dict = {}
        status: list[int] = []

        async def send_status(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        reset = _REQUEST.set(info)
        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status.append(500)
            raise
        finally:
            _REQUEST.reset(reset)
            if status:  # none: the client went away before an answer
                client = scope.get("client")
                address = client[0] if client else "unknown"
                instance_id = info.get("instance_id")
                self.tracker.record(address, instance_id if isinstance(instance_id, str) else None,
                                    status[0], scope.get("method", ""), scope.get("path", ""),
                                    info.get("field"))


class Wakeups:
    """Wakes long-polling pulls of a model_id when samples arrive (one event per generation)."""

    def __init__(self, model_ids: list[str]):
        self._events = {m: asyncio.Event() for m in model_ids}
        self.stopping = False  # set from the SIGTERM path; waiters re-check it every second

    def event(self, model_id: str) -> asyncio.Event:
        return self._events[model_id]

    def notify(self, model_ids) -> None:
        for m in model_ids:
            if m in self._events:
                ev, self._events[m] = self._events[m], asyncio.Event()
                ev.set()


def msgpack_response(obj: Any, status: int = 200) -> Response:
    return Response(encode(obj), status_code=status, media_type=MSGPACK)


def field(msg: dict, name: str, types: type | tuple, default: Any = _REQUIRED) -> Any:
    """Read one request field, raising ProtocolError(name) if it is missing or mistyped."""
    if msg.get(name) is None:
        if default is _REQUIRED:
            raise ProtocolError(name, "is required")
        return default
    value = msg[name]
    allowed = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        names = "/".join(t.__name__ for t in allowed)
        raise ProtocolError(name, f"expected {names}, got {type(value).__name__}")
    return value


def check_id(value: Any, name: str) -> str:
    """An id (instance, task, batch, trainer, model): 1..MAX_ID_LEN printable characters."""
    if not isinstance(value, str):
        raise ProtocolError(name, f"expected str, got {type(value).__name__}")
    if not 0 < len(value) <= MAX_ID_LEN:
        raise ProtocolError(name, f"must be 1..{MAX_ID_LEN} characters, got {len(value)}")
    if not value.isprintable():
        raise ProtocolError(name, "must hold printable characters only")
    return value


def id_field(msg: dict, name: str, default: Any = _REQUIRED) -> Any:
    value = field(msg, name, str, default)
    return value if value is default and default is not _REQUIRED else check_id(value, name)


def int_field(msg: dict, name: str, lo: int, hi: int, default: Any = _REQUIRED) -> Any:
    value = field(msg, name, int, default)
    if value is not default and not lo <= value <= hi:
        raise ProtocolError(name, f"must be in [{lo}, {hi}], got {value}")
    return value


def num_field(msg: dict, name: str, lo: float, hi: float, default: Any = _REQUIRED) -> Any:
    """A finite number in ``[lo, hi]`` (ints accepted), as float."""
    value = field(msg, name, (int, float), default)
    if value is default:
        return value
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ProtocolError(name, f"must be a finite number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


HEARTBEAT_STATS = ("weight_pause_s", "weight_updates", "requests_spanning_update",
                   "requests_restarted")
"""What a RaaS may report in its heartbeat's ``stats`` (cumulative, non-negative numbers)."""


def only_fields(msg: dict, allowed: tuple[str, ...]) -> dict:
    """Refuse fields a route does not know (a typo would otherwise be ignored silently)."""
    for key in msg:
        if key not in allowed:
            raise ProtocolError(str(key)[:64], f"unknown field; this route takes {list(allowed)}")
    return msg


def check_json_value(value: Any, name: str, depth: int = 0) -> Any:
    """Free-form metadata stored as JSON: str keys; str, int64, finite float, bool, nil, lists
    and maps only (no bytes, no arrays, no NaN)."""
    if depth > 16:
        raise ProtocolError(name, "nested deeper than 16 levels")
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        if not -MAX_INT64 - 1 <= value <= MAX_INT64:
            raise ProtocolError(name, "integer does not fit 64 signed bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ProtocolError(name, f"must be finite, got {value!r}")
        return value
    if isinstance(value, list):
        for i, v in enumerate(value):
            check_json_value(v, f"{name}[{i}]", depth + 1)
        return value
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError(name, f"keys must be strings, got {type(k).__name__}")
            check_json_value(v, f"{name}.{k}", depth + 1)
        return value
    raise ProtocolError(name, f"{type(value).__name__} is not allowed here (JSON values only)")


def check_version(version: int, name: str = "version") -> int:
    if not 0 <= version <= MAX_VERSION:
        raise ProtocolError(name, f"must be in [0, {MAX_VERSION}], got {version}")
    return version


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it exceeds ``limit`` bytes."""
    declared = request.headers.get("content-length")
    too_big = ServiceError(413, "body", f"request body exceeds max_body_bytes={limit}")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise too_big
    return bytes(buf)


def decode_map(data: bytes, limit: int, allowed: tuple[str, ...] | None = None) -> dict:
    """Decode a request map; with ``allowed``, refuse any other field. An ``instance_id`` in it
    is noted for :class:`ClientStats`."""
    msg = decode(data, max_bytes=limit)
    if not isinstance(msg, dict):
        raise ProtocolError("body", "expected a map of request fields")
    iid = msg.get("instance_id")
    if isinstance(iid, str) and 0 < len(iid) <= MAX_ID_LEN and iid.isprintable():
        _note(instance_id=iid)
    if allowed is not None:
        only_fields(msg, allowed)
    return msg


def _error(status: int, field_name: str | None, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "field": field_name}, status_code=status)


def check_samples(samples: list) -> list[Sample]:
    """A push's samples: each a :class:`Sample` with a bounded reward (the core checks the rest
    against the task). Field names as in ``POST /v1/push`` (``samples[i].reward``)."""
    for i, s in enumerate(samples):
        expect(s, Sample, f"samples[{i}]")
        if not abs(s.reward) <= MAX_ABS_REWARD:
            raise ProtocolError(f"samples[{i}].reward",
                                f"|reward| must be <= {MAX_ABS_REWARD:g}, got {s.reward!r}")
    return samples


def parse_push_item(item: Any) -> tuple[str, list[Sample]]:
    """One task group of a batched push, ``{task_id, samples}``, checked exactly as
    ``POST /v1/push`` checks its own ``task_id`` and ``samples`` (same field names)."""
    if not isinstance(item, dict):
        raise ProtocolError("body", "expected a map {task_id, samples}, got "
                                    f"{type(item).__name__}")
    only_fields(item, PUSH_ITEM_FIELDS)
    task_id = id_field(item, "task_id")
    return task_id, check_samples(field(item, "samples", list))


def push_item_error(exc: ServiceError | ProtocolError) -> dict:
    """The per-item answer for a refused item: what ``POST /v1/push`` of it alone would answer."""
    status = exc.status if isinstance(exc, ServiceError) else 422
    return {"status": status, "error": str(exc), "field": exc.field}


def push_many_refused(results: list[dict]) -> JSONResponse:
    """Every item was refused: a 4xx (the first item's status, its field prefixed with
    ``items[i].``) that still carries every item's answer under ``results``."""
    i, first = next((i, r) for i, r in enumerate(results) if r["status"] != 200)
    where = f"items[{i}]" if first["field"] in (None, "body") else f"items[{i}].{first['field']}"
    message = f"items[{i}]: {first['error']}"
    if len(results) > 1:
        message += f" (all {len(results)} items were refused; see results)"
    _note(field=where)
    return JSONResponse({"error": message, "field": where, "results": results},
                        status_code=first["status"])


# ----------------------------------------------------------------------------- app


def create_app(config: DataflowConfig, token: str | None = None,
               credentials: Credentials | None = None) -> FastAPI:
    """Build the service app around a fresh :class:`Dataflow` on ``config.state_dir``.

    Who may call what (:mod:`astralight.dataflow.auth`): ``credentials`` if given; else ``token``
    alone (every scope; ``""``: no auth); else the environment (``ASTRALIGHT_TOKEN`` and the
    scoped ``ASTRALIGHT_ROLLOUT_TOKEN`` / ``ASTRALIGHT_TRAINER_TOKEN`` / ``ASTRALIGHT_ADMIN_TOKEN``,
    :meth:`Credentials.from_env`). No auth: bind only to loopback
    (:func:`astralight.dataflow.service.check_bind` enforces it).
    """
    if credentials is None:
        credentials = (Credentials.from_env(config.model_ids) if token is None
                       else Credentials.single(token) if token else Credentials.none())
    core = Dataflow(config)
    wake = Wakeups(core.model_ids)
    limit = config.max_body_bytes
    tracker = ClientTracker(config.max_clients_tracked)
    instance_secrets = InstanceSecrets(core.store, core.lock)
    sweep_every = min(1.0, max(0.05, config.batch_ack_timeout_s / 4))

    async def sweeper() -> None:
        while True:
            await asyncio.sleep(sweep_every)
            try:
                wake.notify(await run_in_threadpool(core.requeue_expired_batches))
                if core.gc_due():  # a full version's weights_keep_s grace period ended
                    await run_in_threadpool(core.gc_weights)
            except Exception:  # keep sweeping; the error is in the log
                log.exception("sweep failed")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(sweeper())
        try:
            yield
        finally:
            wake.stopping = True
            task.cancel()
            await run_in_threadpool(core.close)
            log.info("dataflow state closed")

    app = FastAPI(title="astralight dataflow", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.dataflow = core
    app.state.wakeups = wake
    app.state.clients = tracker
    app.state.auth = credentials.enabled
    app.state.credentials = credentials
    app.state.instance_secrets = instance_secrets
    app.add_middleware(AccessGuard, credentials=credentials, host=config.host,
                       on_refuse=lambda name: _note(field=name))
    app.add_middleware(ClientStats, tracker=tracker)  # added last: outermost, sees the 401s

    # -- access checks that need the body (the route's scope is AccessGuard's) -----------

    def own_model(model_id: str, name: str = "model_id") -> None:
        """A trainer token bound to a model_id acts on that model_id only."""
        p = auth.current().principal
        if p.scope == auth.TRAINER and p.model_id is not None and model_id != p.model_id:
            raise ServiceError(403, name, (
                f"this trainer token is bound to model_id {p.model_id!r} and cannot act on "
                f"{model_id!r}; the trainer of {model_id!r} needs its own token (astralight run "
                f"hands each trainer its own; or: python -m astralight.dataflow.auth "
                f"trainer-token {model_id})"))

    def own_batch(batch_id: str) -> None:
        """A bound trainer acks and extends only batches of its model_id (unknown ones: the
        core answers 404)."""
        p = auth.current().principal
        if p.scope == auth.TRAINER and p.model_id is not None:
            with core.lock:
                row = core.store.batch(batch_id)
            if row is not None:
                own_model(row["model_id"], "batch_id")

    def own_instance(instance_id: str) -> None:
        """A rollout caller acts as an instance only with its instance secret (admin: any)."""
        a = auth.current()
        if a.principal.admin:
            return
        ok = instance_secrets.matches(instance_id, a.instance_secret)
        if ok is None:
            raise ServiceError(404, "instance_id", (
                f"unknown instance {instance_id!r} (or one registered before instances were "
                f"bound to a secret); register it (POST /v1/register) first"))
        if not ok:
            raise ServiceError(403, "instance_secret", (
                f"the {auth.INSTANCE_SECRET_HEADER} header is missing or is not the secret "
                f"instance {instance_id!r} got at registration; only that instance may act as it "
                f"(astralight.dataflow.client sends it by itself)"))

    def foreign_tasks(instance_id: str, task_ids: list[str]) -> set[str]:
        """For a rollout caller: the ``task_ids`` currently leased (or returned) by another
        instance, which it may not push (done tasks answer ``duplicate``, unknown ones 404)."""
        if auth.current().principal.admin or not task_ids:
            return set()
        with core.lock:
            rows = {t: core.store.task(t) for t in task_ids}
        return {t for t, row in rows.items() if row is not None and row["state"] != "done"
                and row["instance_id"] is not None and row["instance_id"] != instance_id}

    def foreign_task_error(task_id: str) -> ServiceError:
        # 409, as for a task never leased: also what a late push gets once the expired lease
        # went to another instance, and the RaaS drops such a push without counting a failure
        return ServiceError(409, "task_id", (
            f"task {task_id!r} is leased to another instance; an instance pushes only the tasks "
            f"it leased (POST /v1/lease) and still holds"))

    def instance_is_live(instance_id: str) -> bool:
        row = core.store.instance(instance_id)  # (under the core's lock)
        return row is not None and membership.is_live(
            row["state"], time.time() - float(row["last_seen"]), config.lease_seconds)

    # -- errors -------------------------------------------------------------

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        log.warning("%s %s -> %d %s", request.method, request.url.path, exc.status, exc)
        _note(field=exc.field)
        return _error(exc.status, exc.field, str(exc))

    @app.exception_handler(ProtocolError)
    async def _protocol_error(request: Request, exc: ProtocolError):
        log.warning("%s %s -> 422 %s", request.method, request.url.path, exc)
        _note(field=exc.field)
        return _error(422, exc.field, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        loc = ".".join(str(p) for p in errs[0]["loc"][1:]) if errs else "request"
        msg = f"{loc}: {errs[0]['msg']}" if errs else "invalid request"
        log.warning("%s %s -> 422 %s", request.method, request.url.path, msg)
        _note(field=loc)
        return _error(422, loc, msg)

    @app.exception_handler(ClientDisconnect)
    async def _disconnect(request: Request, exc: ClientDisconnect):
        return _error(400, "body", "client disconnected before the body was read")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("%s %s -> 500", request.method, request.url.path)
        return _error(500, None, f"internal error: {type(exc).__name__}: {exc}")

    # -- observation (JSON) -------------------------------------------------

    @app.get("/v1/info")
    async def info():
        return core.info()

    @app.get("/v1/stats")
    async def stats():
        out = await run_in_threadpool(core.stats)
        clients = tracker.snapshot()
        out["clients"] = clients["address"]
        out["client_instances"] = clients["instance"]
        out["clients_evicted"] = clients["evicted"]
        return out

    @app.get("/v1/eval/{model_id}")
    async def eval_results(model_id: str):
        own_model(model_id)
        results = await run_in_threadpool(core.eval_results, model_id)
        return {str(v): r for v, r in results.items()}

    def _request_eval(data: bytes) -> dict:
        msg = decode_map(data, limit, ("model_id", "version"))
        model_id = id_field(msg, "model_id")
        version = int_field(msg, "version", 0, MAX_VERSION)
        own_model(model_id)
        return core.request_eval(model_id, version)

    @app.post("/v1/eval")
    async def request_eval(request: Request):
        """Evaluate ``{model_id, version}`` (the current version) now, whatever ``eval.every``
        says; once (:meth:`Dataflow.request_eval`)."""
        return msgpack_response(await run_in_threadpool(_request_eval,
                                                        await read_body(request, limit)))

    @app.get("/v1/eval/{model_id}/{version}/completions")
    async def eval_completions(model_id: str, version: int = Path(ge=0, le=MAX_VERSION),
                               limit: int = Query(evals.COMPLETIONS_PER_VERSION, ge=1,
                                                  le=evals.COMPLETIONS_PER_VERSION)):
        own_model(model_id)
        rows = await run_in_threadpool(core.eval_completions, model_id, version, limit)
        return {"model_id": model_id, "version": version, "completions": rows}

    @app.get("/v1/balance/{model_id}")
    async def balance_report(model_id: str, window: int = Query(10, ge=1, le=MAX_COUNT),
                             pool: int | None = Query(None, ge=0, le=MAX_COUNT),
                             last: int | None = Query(None, ge=0, le=MAX_VERSION)):
        own_model(model_id)
        return await run_in_threadpool(core.balance, model_id, window, pool, None, last)

    @app.get("/v1/counters/{model_id}")
    async def version_counters(model_id: str, since: int = Query(0, ge=0, le=MAX_VERSION)):
        own_model(model_id)
        counters = await run_in_threadpool(core.version_counters, model_id, since)
        return {"model_id": model_id, "versions": {str(v): c for v, c in counters.items()}}

    # -- RaaS side ----------------------------------------------------------

    def _register(data: bytes) -> dict:
        msg = decode_map(data, limit, ("model_ids", "capacity", "instance_id", "meta",
                                       "capacity_units", "limits"))
        model_ids = field(msg, "model_ids", list)
        if not all(isinstance(m, str) for m in model_ids):
            raise ProtocolError("model_ids", "must be a list of strings")
        if not 0 < len(model_ids) <= MAX_LIST:
            raise ProtocolError("model_ids", f"must list 1..{MAX_LIST} model_ids")
        for i, m in enumerate(model_ids):
            check_id(m, f"model_ids[{i}]")
        units = float(field(msg, "capacity_units", (int, float), 1.0))
        if not 0 < units < 1e6:
            raise ProtocolError("capacity_units", f"must be > 0 (GPUs or CPU slots), got {units}")
        instance_id = field(msg, "instance_id", str, None) or None  # empty: the service names it
        if instance_id is not None:
            check_id(instance_id, "instance_id")
        meta = check_json_value(field(msg, "meta", dict, {}), "meta")
        membership.check_workflow(meta, config.workflow)  # 409 naming both names and the key
        capacity = int_field(msg, "capacity", 0, MAX_COUNT, 1)
        access = auth.current()
        with core.lock:  # (re-entrant: the check, the registration and the secret as one step)
            held = (instance_secrets.matches(instance_id, access.instance_secret)
                    if instance_id is not None else None)
            if held is False and not access.principal.admin and instance_is_live(instance_id):
                raise ServiceError(403, "instance_secret", (
                    f"instance {instance_id!r} is registered and live; registering it again "
                    f"needs its secret in the {auth.INSTANCE_SECRET_HEADER} header (the client "
                    f"that registered it sends it). Register under another instance_id, or "
                    f"again once it has been silent for lease_seconds={config.lease_seconds:g} s "
                    f"or deregistered"))
            reply = core.register(model_ids, capacity, instance_id, meta, capacity_units=units,
                                  limits=field(msg, "limits", dict, None))  # checked by the core
            secret = (access.instance_secret if held else
                      instance_secrets.issue(reply["instance_id"]))
        return {**reply, "instance_secret": secret}

    @app.post("/v1/register")
    async def register(request: Request):
        return msgpack_response(await run_in_threadpool(_register, await read_body(request, limit)))

    def _heartbeat(data: bytes) -> dict:
        msg = decode_map(data, limit, ("instance_id", "in_flight", "stats"))
        in_flight = int_field(msg, "in_flight", 0, MAX_COUNT, None)
        stats = field(msg, "stats", dict, None)
        if stats is not None:
            only_fields(stats, HEARTBEAT_STATS)
            stats = {k: num_field(stats, k, 0.0, 1e12) for k in stats}
        instance_id = id_field(msg, "instance_id")
        own_instance(instance_id)
        return core.heartbeat(instance_id, in_flight, stats=stats)

    @app.post("/v1/heartbeat")
    async def heartbeat(request: Request):
        return msgpack_response(await run_in_threadpool(_heartbeat, await read_body(request, limit)))

    @app.post("/v1/instances/{instance_id}/drain")
    async def drain(instance_id: str):
        check_id(instance_id, "instance_id")
        await run_in_threadpool(own_instance, instance_id)
        return msgpack_response(await run_in_threadpool(core.drain, instance_id))

    def _return(data: bytes) -> dict:
        msg = decode_map(data, limit, ("instance_id", "task_ids", "failed"))
        task_ids = field(msg, "task_ids", list)
        if len(task_ids) > MAX_LIST:
            raise ProtocolError("task_ids", f"at most {MAX_LIST} task ids per request")
        for i, t in enumerate(task_ids):
            if not isinstance(t, str):
                raise ProtocolError(f"task_ids[{i}]", f"expected str, got {type(t).__name__}")
            check_id(t, f"task_ids[{i}]")
        instance_id = id_field(msg, "instance_id")
        failed = field(msg, "failed", bool, False)
        own_instance(instance_id)
        return core.return_tasks(instance_id, task_ids, failed)

    @app.post("/v1/return")
    async def return_tasks(request: Request):
        return msgpack_response(await run_in_threadpool(_return, await read_body(request, limit)))

    def _deregister(data: bytes) -> dict:
        instance_id = id_field(decode_map(data, limit, ("instance_id",)), "instance_id")
        own_instance(instance_id)
        return core.deregister(instance_id)

    @app.post("/v1/deregister")
    async def deregister(request: Request):
        return msgpack_response(await run_in_threadpool(_deregister,
                                                        await read_body(request, limit)))

    def _lease(data: bytes) -> dict:
        msg = decode_map(data, limit, ("instance_id", "max_tasks"))
        instance_id, max_tasks = id_field(msg, "instance_id"), field(msg, "max_tasks", int)
        own_instance(instance_id)
        return {"tasks": core.lease(instance_id, max_tasks)}

    @app.post("/v1/lease")
    async def lease(request: Request):
        return msgpack_response(await run_in_threadpool(_lease, await read_body(request, limit)))

    def _push(data: bytes) -> dict:
        msg = decode_map(data, limit, ("instance_id", "task_id", "samples"))
        samples = check_samples(field(msg, "samples", list))
        instance_id, task_id = id_field(msg, "instance_id"), id_field(msg, "task_id")
        own_instance(instance_id)
        if foreign_tasks(instance_id, [task_id]):
            raise foreign_task_error(task_id)
        return core.push(instance_id, task_id, samples)

    @app.post("/v1/push")
    async def push(request: Request):
        result = await run_in_threadpool(_push, await read_body(request, limit))
        if result["accepted"]:
            wake.notify(core.model_ids)
        return msgpack_response(result)

    def _push_many(data: bytes) -> list[dict]:
        """Decode ``{instance_id, items: [{task_id, samples}]}``; push every well-formed item
        (:meth:`Dataflow.push_many`); one answer per item, in order: ``{status: 200, reply}``
        or ``{status, error, field}`` as ``POST /v1/push`` of that item alone would answer."""
        msg = decode_map(data, limit, ("instance_id", "items"))
        instance_id = id_field(msg, "instance_id")
        own_instance(instance_id)
        items = field(msg, "items", list)
        if not 0 < len(items) <= MAX_PUSH_ITEMS:
            raise ProtocolError("items", f"must hold 1..{MAX_PUSH_ITEMS} task groups, got "
                                         f"{len(items)}; split bigger batches")
        results: list[dict | None] = [None] * len(items)
        good: list[tuple[int, tuple[str, list[Sample]]]] = []
        for i, item in enumerate(items):
            try:
                good.append((i, parse_push_item(item)))
            except ProtocolError as exc:
                results[i] = push_item_error(exc)
        foreign = foreign_tasks(instance_id, [t for _, (t, _) in good])
        for i, (task_id, _) in [g for g in good if g[1][0] in foreign]:
            results[i] = push_item_error(foreign_task_error(task_id))
        good = [g for g in good if g[1][0] not in foreign]
        replies = core.push_many(instance_id, [item for _, item in good]) if good else []
        for (i, _), reply in zip(good, replies):
            results[i] = (push_item_error(reply) if isinstance(reply, ServiceError)
                          else {"status": 200, "reply": reply})
        for i, r in enumerate(results):
            if r["status"] != 200:
                log.warning("POST /v1/push_many items[%d] -> %d %s", i, r["status"], r["error"])
        return results

    @app.post("/v1/push_many")
    async def push_many(request: Request):
        """Many task groups in one request, each idempotent like ``POST /v1/push``; answered
        once every accepted item is durable. 200 if any item was accepted (or a duplicate),
        else the first refusal's 4xx; both carry every item's answer under ``results``."""
        results = await run_in_threadpool(_push_many, await read_body(request, limit))
        if any(r["status"] == 200 and r["reply"]["accepted"] for r in results):
            wake.notify(core.model_ids)
        if all(r["status"] != 200 for r in results):
            return push_many_refused(results)
        return msgpack_response({"results": results})

    # -- trainer side -------------------------------------------------------

    @app.post("/v1/pull")
    async def pull(request: Request):
        msg = await run_in_threadpool(decode_map, await read_body(request, limit), limit,
                                      ("model_id", "size", "timeout_s", "trainer_id"))
        model_id = id_field(msg, "model_id")
        size = field(msg, "size", int)
        timeout_s = num_field(msg, "timeout_s", 0.0, MAX_SECONDS, 0.0)
        timeout_s = min(timeout_s, config.max_pull_timeout_s)
        trainer_id = id_field(msg, "trainer_id", None)
        own_model(model_id)
        core.check_pull(model_id, size)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            event = wake.event(model_id)  # taken before trying, so no wake-up is missed
            batch = await run_in_threadpool(core.pull, model_id, size, trainer_id)
            remaining = deadline - loop.time()
            if batch is not None or remaining <= 0 or wake.stopping:
                break
            if await request.is_disconnected():
                break
            try:
                await asyncio.wait_for(event.wait(), timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass
        # the ack timeout travels as a header (old clients ignore it): the trainer extends every
        # batch it holds well within it (POST /v1/batches/extend)
        return Response(await run_in_threadpool(encode, batch), media_type=MSGPACK,
                        headers={ACK_TIMEOUT_HEADER: f"{config.batch_ack_timeout_s:g}"})

    def _ack(data: bytes) -> dict:
        msg = decode_map(data, limit, ("batch_id", "wait_s", "step_s", "step"))
        timings = {k: field(msg, k, (int, float), None) for k in ("wait_s", "step_s")}
        for k, v in timings.items():
            if v is not None and not 0 <= v < MAX_SECONDS:
                raise ServiceError(422, k, f"must be seconds in [0, 1e7), got {v}")
        step = int_field(msg, "step", 0, MAX_VERSION, None)
        batch_id = id_field(msg, "batch_id")
        own_batch(batch_id)
        return core.ack(batch_id, **timings, step=step)

    @app.post("/v1/ack")
    async def ack(request: Request):
        return msgpack_response(await run_in_threadpool(_ack, await read_body(request, limit)))

    def _resumed(data: bytes) -> dict:
        msg = decode_map(data, limit, ("model_id", "step"))
        model_id, step = id_field(msg, "model_id"), int_field(msg, "step", 0, MAX_VERSION)
        own_model(model_id)
        return core.trainer_resumed(model_id, step)

    @app.post("/v1/trainer/resumed")
    async def trainer_resumed(request: Request):
        """A trainer restarted from a checkpoint at ``step``: its acks after it are rolled back."""
        return msgpack_response(await run_in_threadpool(_resumed, await read_body(request, limit)))

    def _extend(data: bytes) -> dict:
        batch_id = id_field(decode_map(data, limit, ("batch_id",)), "batch_id")
        own_batch(batch_id)
        return core.extend_batch(batch_id)

    @app.post("/v1/batches/extend")
    async def extend_batch(request: Request):
        """Keep-alive of a served batch: its ack deadline moves to now + batch_ack_timeout_s."""
        return msgpack_response(await run_in_threadpool(_extend, await read_body(request, limit)))

    # -- versions and weights -----------------------------------------------

    @app.get("/v1/version/{model_id}")
    async def version(model_id: str):
        return msgpack_response({"model_id": model_id, "version": core.current_version(model_id)})

    @app.put("/v1/weights/{model_id}/{version}/{name}")
    async def upload(model_id: str, version: int, name: str, request: Request):
        check_version(version)
        own_model(model_id)
        await run_in_threadpool(core.check_upload, model_id, version, name)
        max_bytes = config.max_weight_file_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_bytes:
            raise ServiceError(413, "body", f"weight file exceeds max_weight_file_bytes={max_bytes}")
        tmp, sha, size = await core.weights.receive(model_id, version, name, request.stream(),
                                                    max_bytes)
        await run_in_threadpool(core.commit_upload, tmp, model_id, version, name, sha)
        return msgpack_response({"model_id": model_id, "version": version, "name": name,
                                 "sha256": sha, "bytes": size})

    def _weight_file(model_id: str, version: int, name: str):
        """``(path, manifest entry, stat)`` of a published file to send, checked before the
        answer starts (FileResponse opens the file only after its 200 went out): a missing
        file (or something else in its place) is a 410; any other file system error is
        :func:`~astralight.dataflow.weightfiles.fs_error`'s answer, as on upload and publish
        (507 naming the weight store; 422 naming ``name`` for a name it refuses), never a 500."""
        path, info = core.weight_file(model_id, version, name)
        try:
            st = path.stat()
            if S_ISREG(st.st_mode):
                with open(path, "rb"):  # readable (permissions, I/O errors)
                    pass
        except (FileNotFoundError, NotADirectoryError):
            st = None
        except OSError as exc:
            raise fs_error(core.weights.root, exc, "name", name) from exc
        if st is None or not S_ISREG(st.st_mode):
            raise ServiceError(410, "name", f"{name} of {model_id} v{version} is listed in the "
                                            "manifest but missing from the weight store")
        return path, info, st

    @app.get("/v1/weights/{model_id}/{version}/{name}")
    async def download(model_id: str, version: int, name: str):
        check_version(version)
        path, info, st = await run_in_threadpool(_weight_file, model_id, version, name)
        return FileResponse(path, media_type="application/octet-stream", stat_result=st,
                            headers={"X-Sha256": str(info["sha256"])})

    def _publish(data: bytes) -> dict:
        manifest = expect(decode(data, max_bytes=limit), WeightManifest, "manifest")
        own_model(manifest.model_id)
        return core.publish(manifest)

    @app.post("/v1/publish")
    async def publish(request: Request):
        return msgpack_response(await run_in_threadpool(_publish, await read_body(request, limit)))

    @app.get("/v1/manifest/{model_id}/latest")
    async def latest_manifest(model_id: str):
        return msgpack_response(await run_in_threadpool(core.manifest, model_id, None))

    @app.get("/v1/manifest/{model_id}/{version}")
    async def manifest(model_id: str, version: int):
        check_version(version)
        found = await run_in_threadpool(core.manifest, model_id, version)
        if found is None:
            raise ServiceError(404, "version", f"version {version} of {model_id!r} is not published")
        return msgpack_response(found)

    return app
