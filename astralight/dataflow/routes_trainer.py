"""Routes of a trainer's batches: the long-polling pull, ack, the keep-alive of a served batch,
and ``trainer/resumed`` (a restart from a checkpoint). A trainer token bound to a model_id acts
on that model_id's batches only (:class:`~astralight.dataflow.http_access.BodyAccess`)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from astralight.dataflow.client_trainer import ACK_TIMEOUT_HEADER  # the pull's batch_ack_timeout_s
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.http_access import BodyAccess
from astralight.dataflow.http_bodies import (MAX_SECONDS, MSGPACK, decode_map, field, id_field,
                                             int_field, msgpack_post, num_field, read_body)
from astralight.dataflow.http_wakeups import Wakeups
from astralight.protocol import MAX_VERSION, encode


def add_trainer_routes(app: FastAPI, core: Dataflow, config: DataflowConfig, access: BodyAccess,
                       wake: Wakeups) -> None:
    limit = config.max_body_bytes

    @app.post("/v1/pull")
    async def pull(request: Request):
        msg = await run_in_threadpool(decode_map, await read_body(request, limit), limit,
                                      ("model_id", "size", "timeout_s", "trainer_id"))
        model_id = id_field(msg, "model_id")
        size = field(msg, "size", int)
        timeout_s = num_field(msg, "timeout_s", 0.0, MAX_SECONDS, 0.0)
        timeout_s = min(timeout_s, config.max_pull_timeout_s)
        trainer_id = id_field(msg, "trainer_id", None)
        access.own_model(model_id)
        core.check_pull(model_id, size)
        batch = await wake.long_poll(request, lambda: wake.event(model_id),
                                     lambda: core.pull(model_id, size, trainer_id),
                                     lambda got: got is not None, timeout_s)
        if batch is not None:
            wake.notify_room()  # the queue shrank: leases may grant tasks again
        # the ack timeout travels as a header (a client that does not read it is unaffected):
        # the trainer extends every batch it holds well within it (POST /v1/batches/extend)
        return Response(await run_in_threadpool(encode, batch), media_type=MSGPACK,
                        headers={ACK_TIMEOUT_HEADER: f"{config.batch_ack_timeout_s:g}"})

    def ack(data: bytes) -> dict:
        msg = decode_map(data, limit, ("batch_id", "wait_s", "step_s", "step"))
        timings = {k: field(msg, k, (int, float), None) for k in ("wait_s", "step_s")}
        for k, v in timings.items():
            if v is not None and not 0 <= v < MAX_SECONDS:
                raise ServiceError(422, k, f"must be seconds in [0, 1e7), got {v}")
        step = int_field(msg, "step", 0, MAX_VERSION, None)
        batch_id = id_field(msg, "batch_id")
        access.own_batch(batch_id)
        return core.ack(batch_id, **timings, step=step)

    msgpack_post(app, "/v1/ack", limit, ack, then=wake.notify_room)  # consumption moves demand

    def trainer_resumed(data: bytes) -> dict:
        """A trainer restarted from a checkpoint at ``step``: its acks after it are rolled back."""
        msg = decode_map(data, limit, ("model_id", "step"))
        model_id, step = id_field(msg, "model_id"), int_field(msg, "step", 0, MAX_VERSION)
        access.own_model(model_id)
        return core.trainer_resumed(model_id, step)

    msgpack_post(app, "/v1/trainer/resumed", limit, trainer_resumed)

    def extend_batch(data: bytes) -> dict:
        """Keep-alive of a served batch: its ack deadline moves to now + batch_ack_timeout_s."""
        batch_id = id_field(decode_map(data, limit, ("batch_id",)), "batch_id")
        access.own_batch(batch_id)
        return core.extend_batch(batch_id)

    msgpack_post(app, "/v1/batches/extend", limit, extend_batch)
