"""Routes that show the dataflow's state, answered in JSON: ``/v1/info``, ``/v1/stats`` (with
the per-client counters of :class:`~astralight.dataflow.http_stats.ClientTracker`), the eval
results and a few sample completions per evaluated version, the balance report and per-version
counters; and ``POST /v1/eval`` (msgpack), which asks for an eval now."""

from __future__ import annotations

from fastapi import FastAPI, Path, Query
from starlette.concurrency import run_in_threadpool

from astralight.dataflow import evals
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.http_access import BodyAccess
from astralight.dataflow.http_bodies import MAX_COUNT, decode_map, id_field, int_field, msgpack_post
from astralight.dataflow.http_stats import ClientTracker
from astralight.protocol import MAX_VERSION


def add_observation_routes(app: FastAPI, core: Dataflow, config: DataflowConfig,
                           access: BodyAccess, tracker: ClientTracker) -> None:
    body_limit = config.max_body_bytes

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
        access.own_model(model_id)
        results = await run_in_threadpool(core.eval_results, model_id)
        return {str(v): r for v, r in results.items()}

    def request_eval(data: bytes) -> dict:
        """Evaluate ``{model_id, version}`` (the current version) now, whatever ``eval.every``
        says; once (:meth:`Dataflow.request_eval`)."""
        msg = decode_map(data, body_limit, ("model_id", "version"))
        model_id = id_field(msg, "model_id")
        version = int_field(msg, "version", 0, MAX_VERSION)
        access.own_model(model_id)
        return core.request_eval(model_id, version)

    msgpack_post(app, "/v1/eval", body_limit, request_eval)

    @app.get("/v1/eval/{model_id}/{version}/completions")
    async def eval_completions(model_id: str, version: int = Path(ge=0, le=MAX_VERSION),
                               limit: int = Query(evals.COMPLETIONS_PER_VERSION, ge=1,
                                                  le=evals.COMPLETIONS_PER_VERSION)):
        access.own_model(model_id)
        rows = await run_in_threadpool(core.eval_completions, model_id, version, limit)
        return {"model_id": model_id, "version": version, "completions": rows}

    @app.get("/v1/balance/{model_id}")
    async def balance_report(model_id: str, window: int = Query(10, ge=1, le=MAX_COUNT),
                             pool: int | None = Query(None, ge=0, le=MAX_COUNT),
                             last: int | None = Query(None, ge=0, le=MAX_VERSION)):
        access.own_model(model_id)
        return await run_in_threadpool(core.balance, model_id, window, pool, None, last)

    @app.get("/v1/counters/{model_id}")
    async def version_counters(model_id: str, since: int = Query(0, ge=0, le=MAX_VERSION)):
        access.own_model(model_id)
        counters = await run_in_threadpool(core.version_counters, model_id, since)
        return {"model_id": model_id, "versions": {str(v): c for v, c in counters.items()}}
