"""Evaluating a run's last version on request (``POST /v1/eval``, ``Dataflow.request_eval``),
whatever ``eval.every`` says, and balance windows that end at a chosen version (``last``), so
that the launcher's windows neither skip nor repeat a version."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from astralight.dataflow.app import create_app
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.protocol import decode, encode
from tests.unit.dataflow_fakes import publish, samples

EVAL = {"source": {"class_path": "astralight.tasks.arithmetic.ArithmeticSource",
                   "init_args": {"split": "eval", "eval_size": 3, "max_operand": 9}},
        "every": 10, "k": 2}


def _config(tmp_path, **kw) -> DataflowConfig:
    return DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2, **kw)


def test_the_current_version_is_evaluated_on_request_once(tmp_path):
    flow = Dataflow(_config(tmp_path, eval=EVAL))
    try:
        for v in (1, 2, 3):
            publish(flow, v)
        assert sorted(flow.eval_results("policy")) == [0]  # 3 is no multiple of eval.every
        reply = flow.request_eval("policy", 3)
        assert reply == {"model_id": "policy", "version": 3, "evals_scheduled": 3}
        assert flow.request_eval("policy", 3)["evals_scheduled"] == 0  # once
        assert flow.request_eval("policy", 0)["evals_scheduled"] == 0  # already evaluated
        table = flow.eval_results("policy")
        assert sorted(table) == [0, 3] and table[3]["n_prompts"] == 3
        assert not table[3]["complete"]
        # the eval tasks are leased before train tasks and score version 3
        flow.register(["policy"], 8, "raas-a", {})
        tasks = flow.lease("raas-a", 8)
        mine = [t for t in tasks if t.kind == "eval" and t.eval_version == 3]
        assert len(mine) == 3
        for t in mine:
            flow.push("raas-a", t.task_id, samples(t, [1.0, 0.0], version=3))
        done = flow.eval_results("policy")[3]
        assert done["complete"] and done["avg_at_k"] == 0.5
    finally:
        flow.close()


def test_only_the_current_version_can_be_newly_evaluated(tmp_path):
    flow = Dataflow(_config(tmp_path, eval=EVAL))
    try:
        publish(flow, 1)
        publish(flow, 2)
        with pytest.raises(ServiceError, match="not the current one") as info:
            flow.request_eval("policy", 1)
        assert (info.value.status, info.value.field) == (409, "version")
        with pytest.raises(ServiceError, match="not published yet") as info:
            flow.request_eval("policy", 5)
        assert info.value.status == 409
        with pytest.raises(ServiceError, match="unknown model_id"):
            flow.request_eval("ghost", 2)
    finally:
        flow.close()


def test_a_service_without_an_eval_source_refuses_with_the_key(tmp_path):
    flow = Dataflow(_config(tmp_path))
    try:
        with pytest.raises(ServiceError, match="dataflow.eval.source") as info:
            flow.request_eval("policy", 0)
        assert (info.value.status, info.value.field) == (409, "eval")
    finally:
        flow.close()


def test_the_route_schedules_and_checks_its_body(tmp_path):
    app = create_app(_config(tmp_path, eval=EVAL))
    mp = {"Content-Type": "application/msgpack"}
    with TestClient(app, base_url="http://127.0.0.1") as http:
        r = http.post("/v1/eval", content=encode({"model_id": "policy", "version": 0}), headers=mp)
        assert r.status_code == 200 and decode(r.content)["evals_scheduled"] == 0
        publish(app.state.dataflow, 1)
        r = http.post("/v1/eval", content=encode({"model_id": "policy", "version": 1}), headers=mp)
        assert r.status_code == 200 and decode(r.content)["evals_scheduled"] == 3
        assert "1" in http.get("/v1/eval/policy").json()
        for body, field in (({"model_id": "policy"}, "version"),
                            ({"model_id": "policy", "version": -1}, "version"),
                            ({"model_id": "policy", "version": 1, "x": 1}, "x")):
            r = http.post("/v1/eval", content=encode(body), headers=mp)
            assert r.status_code == 422 and field in r.json()["field"], (body, r.text)


def test_balance_windows_can_end_at_a_chosen_version(tmp_path):
    flow = Dataflow(_config(tmp_path))
    try:
        for v in range(1, 8):
            publish(flow, v)
        assert flow.balance("policy", window=3)["versions"] == [4, 6]  # the last completed
        assert flow.balance("policy", window=3, last=2)["versions"] == [0, 2]
        assert flow.balance("policy", window=3, last=5)["versions"] == [3, 5]
        assert flow.balance("policy", window=2, last=7)["versions"] == [6, 7]  # open window
        with pytest.raises(ServiceError, match="0..7") as info:
            flow.balance("policy", window=2, last=8)
        assert info.value.field == "last"
    finally:
        flow.close()


def test_complete_eval_runs_are_not_recomputed(tmp_path):
    """``eval_results`` reads the reports of runs still open and reuses complete ones (fixed
    once complete); the answers equal a fresh aggregate's."""
    from astralight.dataflow import evals

    flow = Dataflow(_config(tmp_path, eval=EVAL))
    try:
        flow.register(["policy"], 8, "raas-a", {})
        for t in flow.lease("raas-a", 8):
            if t.kind == "eval":  # version 0's eval, completed
                flow.push("raas-a", t.task_id, samples(t, [1.0, 0.0]))
        publish(flow, 1)
        flow.request_eval("policy", 1)  # scheduled, not reported: still open
        read = []
        real = flow.store.eval_reports
        flow.store.eval_reports = lambda m, v: read.append(v) or real(m, v)
        first = flow.eval_results("policy")
        assert first[0]["complete"] and not first[1]["complete"]
        assert sorted(read) == [0, 1]
        read.clear()
        again = flow.eval_results("policy")
        assert read == [1]  # the complete run came from the cache
        assert again == first == evals.aggregate(flow.store, "policy")
        again[0]["avg_at_k"] = -1.0  # a caller's change does not reach the cache
        assert flow.eval_results("policy")[0]["avg_at_k"] == 0.5
    finally:
        flow.close()
