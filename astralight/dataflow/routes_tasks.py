"""Routes of a RaaS's tasks: lease (a long poll with ``wait_s``), return, push and push_many (the
samples of a leased task).

An instance acts only with its secret and pushes only the tasks it holds
(:class:`~astralight.dataflow.http_access.BodyAccess`); every answer leaves once its commits are
durable (group commit: :mod:`astralight.dataflow.durability`), and accepted samples wake the
pulls waiting for them (:class:`~astralight.dataflow.http_wakeups.Wakeups`).

A push may name the ``run_id`` its samples were generated for (both routes, top level): a
dataflow of another run, restarted on a fresh ``state_dir``, refuses it whole (409 ``run_id``).

Batched pushes: ``POST /v1/push_many`` takes ``{instance_id, items: [{task_id, samples}]}``
(1..``MAX_PUSH_ITEMS`` items, the whole body within ``max_body_bytes``) and pushes each item
exactly as ``POST /v1/push`` would (idempotent per task). Each item is answered on its own, in
order, under ``results``: ``{status: 200, reply: {accepted, filtered, duplicate}}`` or
``{status, error, field}`` with push's own status and field names (``samples[0].reward``). The
request answers 200 when any item succeeded, else the first refusal's 4xx (``field``:
``items[i].<field>``), still with every item's answer. A bad envelope (not a map, an unknown
top-level field, no items, too many) is a plain 4xx, as is a body that does not decode.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.http_access import BodyAccess, foreign_task_error
from astralight.dataflow.http_bodies import (MAX_LIST, MAX_SECONDS, check_id, decode_map, field,
                                             id_field, msgpack_post, msgpack_response, num_field,
                                             only_fields, read_body)
from astralight.dataflow.http_stats import note_request
from astralight.dataflow.http_wakeups import Wakeups
from astralight.protocol import ProtocolError, Sample, expect

log = logging.getLogger("astralight.dataflow")

MAX_ABS_REWARD = 1e9  # beyond this the group statistics' variance overflows float64
MAX_PUSH_ITEMS = 1024  # tasks in one POST /v1/push_many (the body limit bounds the samples)
PUSH_ITEM_FIELDS = ("task_id", "samples")


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
    note_request(field=where)
    return JSONResponse({"error": message, "field": where, "results": results},
                        status_code=first["status"])


def add_task_routes(app: FastAPI, core: Dataflow, config: DataflowConfig, access: BodyAccess,
                    wake: Wakeups) -> None:
    limit = config.max_body_bytes

    @app.post("/v1/lease")
    async def lease(request: Request):
        """Lease up to ``max_tasks``. With ``wait_s`` > 0 (at most ``max_pull_timeout_s``) an
        empty lease is a long poll: it is tried again whenever room may have opened (a pull
        served, a push accepted, tasks returned, ...: :meth:`Wakeups.notify_room`) and at least
        every second, and answers ``{"tasks": []}`` only once ``wait_s`` has passed (or the
        service stops, or the caller went away)."""
        msg = await run_in_threadpool(decode_map, await read_body(request, limit), limit,
                                      ("instance_id", "max_tasks", "wait_s"))
        instance_id, max_tasks = id_field(msg, "instance_id"), field(msg, "max_tasks", int)
        wait_s = min(num_field(msg, "wait_s", 0.0, MAX_SECONDS, 0.0), config.max_pull_timeout_s)
        access.own_instance(instance_id)
        tasks = await wake.long_poll(request, wake.room, lambda: core.lease(instance_id, max_tasks),
                                     lambda got: bool(got) or max_tasks == 0, wait_s)
        return msgpack_response({"tasks": tasks})

    def return_tasks(data: bytes) -> dict:
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
        access.own_instance(instance_id)
        return core.return_tasks(instance_id, task_ids, failed)

    msgpack_post(app, "/v1/return", limit, return_tasks, then=wake.notify_room)

    def check_run(msg: dict) -> None:
        """A push naming the ``run_id`` its samples were generated for is refused (409) by a
        dataflow of another run (:mod:`astralight.dataflow.run_id`)."""
        run_id = field(msg, "run_id", str, None)
        if run_id is not None:
            check_id(run_id, "run_id")
        core.check_run(run_id)

    def _push(data: bytes) -> dict:
        msg = decode_map(data, limit, ("instance_id", "task_id", "samples", "run_id"))
        samples = check_samples(field(msg, "samples", list))
        instance_id, task_id = id_field(msg, "instance_id"), id_field(msg, "task_id")
        access.own_instance(instance_id)
        check_run(msg)
        if access.foreign_tasks(instance_id, [task_id]):
            raise foreign_task_error(task_id)
        return core.push(instance_id, task_id, samples)

    @app.post("/v1/push")
    async def push(request: Request):
        result = await run_in_threadpool(_push, await read_body(request, limit))
        if result["accepted"]:
            wake.notify(core.model_ids)
        wake.notify_room()  # the task is closed (even a duplicate or all filtered)
        return msgpack_response(result)

    def _push_many(data: bytes) -> list[dict]:
        """Decode ``{instance_id, items: [{task_id, samples}]}``; push every well-formed item
        (:meth:`Dataflow.push_many`); one answer per item, in order: ``{status: 200, reply}``
        or ``{status, error, field}`` as ``POST /v1/push`` of that item alone would answer."""
        msg = decode_map(data, limit, ("instance_id", "items", "run_id"))
        instance_id = id_field(msg, "instance_id")
        access.own_instance(instance_id)
        check_run(msg)
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
        foreign = access.foreign_tasks(instance_id, [t for _, (t, _) in good])
        for i, (task_id, _) in [g for g in good if g[1][0] in foreign]:
            results[i] = push_item_error(foreign_task_error(task_id))
        good = [g for g in good if g[1][0] not in foreign]
        replies = core.push_many(instance_id, [item for _, item in good]) if good else []
        logged = set()  # items refused by a storage fault: logged once per episode already
        for (i, _), reply in zip(good, replies):
            results[i] = (push_item_error(reply) if isinstance(reply, ServiceError)
                          else {"status": 200, "reply": reply})
            if isinstance(reply, ServiceError) and reply.logged:
                logged.add(i)
        for i, r in enumerate(results):
            if r["status"] != 200 and i not in logged:
                log.warning("POST /v1/push_many items[%d] -> %d %s", i, r["status"], r["error"])
        if logged:
            note_request(quiet=True)
        return results

    @app.post("/v1/push_many")
    async def push_many(request: Request):
        """Many task groups in one request, each idempotent like ``POST /v1/push``; answered
        once every accepted item is durable. 200 if any item was accepted (or a duplicate),
        else the first refusal's 4xx; both carry every item's answer under ``results``."""
        results = await run_in_threadpool(_push_many, await read_body(request, limit))
        if any(r["status"] == 200 and r["reply"]["accepted"] for r in results):
            wake.notify(core.model_ids)
        wake.notify_room()
        if all(r["status"] != 200 for r in results):
            return push_many_refused(results)
        return msgpack_response({"results": results})
