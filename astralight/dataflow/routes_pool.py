"""Routes of the RaaS pool's membership: register (which answers the instance's secret),
heartbeat, drain and deregister. Each acts on an instance only with that instance's secret
(:meth:`~astralight.dataflow.http_access.BodyAccess.own_instance`; admin: any)."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from astralight.dataflow import auth, membership
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.http_access import BodyAccess
from astralight.dataflow.http_bodies import (MAX_COUNT, MAX_LIST, check_id, check_json_value,
                                             decode_map, field, id_field, int_field,
                                             msgpack_post, msgpack_response, num_field,
                                             only_fields)
from astralight.dataflow.http_wakeups import Wakeups
from astralight.protocol import ProtocolError

HEARTBEAT_STATS = ("weight_pause_s", "weight_updates", "requests_spanning_update",
                   "requests_restarted")
"""What a RaaS may report in its heartbeat's ``stats`` (cumulative, non-negative numbers)."""


def add_pool_routes(app: FastAPI, core: Dataflow, config: DataflowConfig,
                    access: BodyAccess, wake: Wakeups) -> None:
    limit = config.max_body_bytes
    secrets = access.secrets

    def register(data: bytes) -> dict:
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
        caller = auth.current()
        with core.lock:  # (re-entrant: the check, the registration and the secret as one step)
            held = (secrets.matches(instance_id, caller.instance_secret)
                    if instance_id is not None else None)
            if (held is False and not caller.principal.admin
                    and access.instance_is_live(instance_id)):
                raise ServiceError(403, "instance_secret", (
                    f"instance {instance_id!r} is registered and live; registering it again "
                    f"needs its secret in the {auth.INSTANCE_SECRET_HEADER} header (the client "
                    f"that registered it sends it). Register under another instance_id, or "
                    f"again once it has been silent for lease_seconds={config.lease_seconds:g} s "
                    f"or deregistered"))
            reply = core.register(model_ids, capacity, instance_id, meta, capacity_units=units,
                                  limits=field(msg, "limits", dict, None))  # checked by the core
            secret = caller.instance_secret if held else secrets.issue(reply["instance_id"])
        return {**reply, "instance_secret": secret}

    msgpack_post(app, "/v1/register", limit, register)

    def heartbeat(data: bytes) -> dict:
        msg = decode_map(data, limit, ("instance_id", "in_flight", "stats"))
        in_flight = int_field(msg, "in_flight", 0, MAX_COUNT, None)
        stats = field(msg, "stats", dict, None)
        if stats is not None:
            only_fields(stats, HEARTBEAT_STATS)
            stats = {k: num_field(stats, k, 0.0, 1e12) for k in stats}
        instance_id = id_field(msg, "instance_id")
        access.own_instance(instance_id)
        return core.heartbeat(instance_id, in_flight, stats=stats)

    msgpack_post(app, "/v1/heartbeat", limit, heartbeat)

    @app.post("/v1/instances/{instance_id}/drain")
    async def drain(instance_id: str):
        check_id(instance_id, "instance_id")
        await run_in_threadpool(access.own_instance, instance_id)
        return msgpack_response(await run_in_threadpool(core.drain, instance_id))

    def deregister(data: bytes) -> dict:
        instance_id = id_field(decode_map(data, limit, ("instance_id",)), "instance_id")
        access.own_instance(instance_id)
        return core.deregister(instance_id)

    msgpack_post(app, "/v1/deregister", limit, deregister, then=wake.notify_room)  # tasks freed
