"""HTTP face of the dataflow service (FastAPI): routes under ``/v1``, msgpack bodies.

Request and response bodies are msgpack (``application/msgpack``, via :mod:`astralight.protocol`);
only ``/v1/info``, ``/v1/stats``, ``/v1/eval/{model_id}`` and ``/v1/counters/{model_id}`` answer
JSON, and weight files travel as raw bytes (with HTTP Range on download). Every route is guarded by ``ASTRALIGHT_TOKEN`` when it
is set. A bad request gets a 4xx JSON ``{"error", "field"}``; an unexpected exception a 500 JSON,
logged with its traceback; neither stops the server.

Route handlers only parse and format: the state machine is :class:`~astralight.dataflow.core.Dataflow`,
whose blocking calls (SQLite commits with fsync) run in the thread pool so that long-polling pulls
keep waiting on the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.protocol import ProtocolError, Sample, WeightManifest, decode, encode, expect

log = logging.getLogger("astralight.dataflow")

MSGPACK = "application/msgpack"
_REQUIRED = object()


# ----------------------------------------------------------------------------- plumbing


class BearerAuth:
    """ASGI middleware: every HTTP request must carry ``Authorization: Bearer <token>``."""

    def __init__(self, app, token: str):
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                body = json.dumps({"error": "authorization: missing or wrong bearer token "
                                            "(set ASTRALIGHT_TOKEN on both sides)",
                                   "field": "authorization"}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


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


def decode_map(data: bytes, limit: int) -> dict:
    msg = decode(data, max_bytes=limit)
    if not isinstance(msg, dict):
        raise ProtocolError("body", "expected a map of request fields")
    return msg


def _error(status: int, field_name: str | None, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "field": field_name}, status_code=status)


# ----------------------------------------------------------------------------- app


def create_app(config: DataflowConfig, token: str | None = None) -> FastAPI:
    """Build the service app around a fresh :class:`Dataflow` on ``config.state_dir``.

    ``token`` defaults to the ``ASTRALIGHT_TOKEN`` environment variable; empty means no auth.
    """
    core = Dataflow(config)
    wake = Wakeups(core.model_ids)
    limit = config.max_body_bytes
    token = os.environ.get("ASTRALIGHT_TOKEN", "") if token is None else token
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
    if token:
        app.add_middleware(BearerAuth, token=token)

    # -- errors -------------------------------------------------------------

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        log.warning("%s %s -> %d %s", request.method, request.url.path, exc.status, exc)
        return _error(exc.status, exc.field, str(exc))

    @app.exception_handler(ProtocolError)
    async def _protocol_error(request: Request, exc: ProtocolError):
        log.warning("%s %s -> 422 %s", request.method, request.url.path, exc)
        return _error(422, exc.field, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        loc = ".".join(str(p) for p in errs[0]["loc"][1:]) if errs else "request"
        msg = f"{loc}: {errs[0]['msg']}" if errs else "invalid request"
        log.warning("%s %s -> 422 %s", request.method, request.url.path, msg)
        return _error(422, loc, msg)

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
        return await run_in_threadpool(core.stats)

    @app.get("/v1/eval/{model_id}")
    async def eval_results(model_id: str):
        results = await run_in_threadpool(core.eval_results, model_id)
        return {str(v): r for v, r in results.items()}

    @app.get("/v1/balance/{model_id}")
    async def balance_report(model_id: str, window: int = 10, pool: int | None = None):
        return await run_in_threadpool(core.balance, model_id, window, pool)

    @app.get("/v1/counters/{model_id}")
    async def version_counters(model_id: str, since: int = 0):
        counters = await run_in_threadpool(core.version_counters, model_id, since)
        return {"model_id": model_id, "versions": {str(v): c for v, c in counters.items()}}

    # -- RaaS side ----------------------------------------------------------

    def _register(data: bytes) -> dict:
        msg = decode_map(data, limit)
        model_ids = field(msg, "model_ids", list)
        if not all(isinstance(m, str) for m in model_ids):
            raise ProtocolError("model_ids", "must be a list of strings")
        units = float(field(msg, "capacity_units", (int, float), 1.0))
        if not 0 < units < 1e6:
            raise ProtocolError("capacity_units", f"must be > 0 (GPUs or CPU slots), got {units}")
        return core.register(model_ids, field(msg, "capacity", int, 1),
                             field(msg, "instance_id", str, None), field(msg, "meta", dict, {}),
                             capacity_units=units)

    @app.post("/v1/register")
    async def register(request: Request):
        return msgpack_response(await run_in_threadpool(_register, await read_body(request, limit)))

    def _heartbeat(data: bytes) -> dict:
        msg = decode_map(data, limit)
        in_flight = field(msg, "in_flight", int, None)
        if in_flight is not None and in_flight < 0:
            raise ProtocolError("in_flight", f"must be >= 0 tasks, got {in_flight}")
        return core.heartbeat(field(msg, "instance_id", str), in_flight)

    @app.post("/v1/heartbeat")
    async def heartbeat(request: Request):
        return msgpack_response(await run_in_threadpool(_heartbeat, await read_body(request, limit)))

    @app.post("/v1/instances/{instance_id}/drain")
    async def drain(instance_id: str):
        return msgpack_response(await run_in_threadpool(core.drain, instance_id))

    def _return(data: bytes) -> dict:
        msg = decode_map(data, limit)
        task_ids = field(msg, "task_ids", list)
        for i, t in enumerate(task_ids):
            if not isinstance(t, str):
                raise ProtocolError(f"task_ids[{i}]", f"expected str, got {type(t).__name__}")
        return core.return_tasks(field(msg, "instance_id", str), task_ids,
                                 field(msg, "failed", bool, False))

    @app.post("/v1/return")
    async def return_tasks(request: Request):
        return msgpack_response(await run_in_threadpool(_return, await read_body(request, limit)))

    def _deregister(data: bytes) -> dict:
        return core.deregister(field(decode_map(data, limit), "instance_id", str))

    @app.post("/v1/deregister")
    async def deregister(request: Request):
        return msgpack_response(await run_in_threadpool(_deregister,
                                                        await read_body(request, limit)))

    def _lease(data: bytes) -> dict:
        msg = decode_map(data, limit)
        tasks = core.lease(field(msg, "instance_id", str), field(msg, "max_tasks", int))
        return {"tasks": tasks}

    @app.post("/v1/lease")
    async def lease(request: Request):
        return msgpack_response(await run_in_threadpool(_lease, await read_body(request, limit)))

    def _push(data: bytes) -> dict:
        msg = decode_map(data, limit)
        samples = field(msg, "samples", list)
        for i, s in enumerate(samples):
            expect(s, Sample, f"samples[{i}]")
        return core.push(field(msg, "instance_id", str), field(msg, "task_id", str), samples)

    @app.post("/v1/push")
    async def push(request: Request):
        result = await run_in_threadpool(_push, await read_body(request, limit))
        if result["accepted"]:
            wake.notify(core.model_ids)
        return msgpack_response(result)

    # -- trainer side -------------------------------------------------------

    @app.post("/v1/pull")
    async def pull(request: Request):
        msg = await run_in_threadpool(decode_map, await read_body(request, limit), limit)
        model_id = field(msg, "model_id", str)
        size = field(msg, "size", int)
        timeout_s = float(field(msg, "timeout_s", (int, float), 0.0))
        timeout_s = min(max(timeout_s, 0.0), config.max_pull_timeout_s)
        trainer_id = field(msg, "trainer_id", str, None)
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
        return Response(await run_in_threadpool(encode, batch), media_type=MSGPACK)

    def _ack(data: bytes) -> dict:
        msg = decode_map(data, limit)
        timings = {k: field(msg, k, (int, float), None) for k in ("wait_s", "step_s")}
        for k, v in timings.items():
            if v is not None and not 0 <= v < 1e7:
                raise ServiceError(422, k, f"must be seconds in [0, 1e7), got {v}")
        return core.ack(field(msg, "batch_id", str), **timings)

    @app.post("/v1/ack")
    async def ack(request: Request):
        return msgpack_response(await run_in_threadpool(_ack, await read_body(request, limit)))

    # -- versions and weights -----------------------------------------------

    @app.get("/v1/version/{model_id}")
    async def version(model_id: str):
        return msgpack_response({"model_id": model_id, "version": core.current_version(model_id)})

    @app.put("/v1/weights/{model_id}/{version}/{name}")
    async def upload(model_id: str, version: int, name: str, request: Request):
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

    @app.get("/v1/weights/{model_id}/{version}/{name}")
    async def download(model_id: str, version: int, name: str):
        path, info = await run_in_threadpool(core.weight_file, model_id, version, name)
        if not path.is_file():
            raise ServiceError(410, "name", f"{name} of {model_id} v{version} is listed in the "
                                            "manifest but missing from the weight store")
        return FileResponse(path, media_type="application/octet-stream",
                            headers={"X-Sha256": str(info["sha256"])})

    def _publish(data: bytes) -> dict:
        manifest = expect(decode(data, max_bytes=limit), WeightManifest, "manifest")
        return core.publish(manifest)

    @app.post("/v1/publish")
    async def publish(request: Request):
        return msgpack_response(await run_in_threadpool(_publish, await read_body(request, limit)))

    @app.get("/v1/manifest/{model_id}/latest")
    async def latest_manifest(model_id: str):
        return msgpack_response(await run_in_threadpool(core.manifest, model_id, None))

    @app.get("/v1/manifest/{model_id}/{version}")
    async def manifest(model_id: str, version: int):
        found = await run_in_threadpool(core.manifest, model_id, version)
        if found is None:
            raise ServiceError(404, "version", f"version {version} of {model_id!r} is not published")
        return msgpack_response(found)

    return app
