"""A RaaS joining the pool: it sends its workflow's name, a dataflow that refuses it (another
``workflow:``) ends it with exit status 2 and the dataflow's message, and a dataflow that is not
there is waited for -- saying so -- until ``dataflow_give_up_s`` (exit 1) or a stop (exit 0).

The dataflow is :class:`tests.fakes.FakeDataflow` (refusing with the real service's
check), or a real client of a port nothing listens on."""

from __future__ import annotations

import io
import threading

import pytest

from astralight.dataflow import client as client_mod
from astralight.dataflow.client import DataflowClient
from astralight.engine import SamplingSpec
from astralight.raas.config import RaaSConfig
from astralight.raas.service import REFUSED_EXIT, RaaSService, _start
from astralight.rewards.toy import ExactMatchReward
from astralight.trainer.tinymodel import build_tokenizer
from astralight.workflows.single_turn import SingleTurnWorkflow
from tests.conftest import free_port
from tests.unit.engine_fakes import ScriptedEngine
from tests.fakes import FakeDataflow


def _service(client_factory, **overrides):
    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(temperature=1.0,
                                                                      max_tokens=4))
    cfg = RaaSConfig(dataflow="http://127.0.0.1:1", engines={"policy": {"model_path": "unused"}},
                     workflow=wf, model_ids=["policy"], max_concurrency=2, poll_interval_s=0.0,
                     progress_interval_s=1e9, weight_check_interval_s=3600.0, **overrides)
    out = io.StringIO()
    engine = ScriptedEngine(build_tokenizer(), ["1"])
    return RaaSService(cfg, client_factory=client_factory, engines={"policy": engine}, out=out), out


def test_the_registration_names_the_workflow_the_runner_matches_tasks_against():
    flow = FakeDataflow()
    svc, _ = _service(lambda: flow)
    try:
        assert _start(svc) is None
        assert flow.register_metas[0]["workflow"] == "single_turn" == svc.runner.workflow.name
    finally:
        svc.close()


def test_a_registration_refused_for_another_workflow_exits_2_naming_both_and_the_key():
    flow = FakeDataflow()
    flow.workflow = "multi_turn"  # the dataflow's `workflow:` setting
    svc, out = _service(lambda: flow)
    try:
        assert _start(svc) == REFUSED_EXIT == 2  # the launcher never restarts an exit 2
    finally:
        svc.close()
    text = out.getvalue()
    assert "refused this instance's registration" in text
    assert "'single_turn'" in text and "'multi_turn'" in text
    assert "`workflow:`" in text and "dataflow.workflow" in text  # the key to change
    assert flow.registrations == 0


def test_an_unreachable_dataflow_is_waited_for_saying_so_then_given_up_in_one_line(
        caplog, monkeypatch):
    monkeypatch.setattr(client_mod, "WAIT_LOG_AFTER_S", 0.0)
    monkeypatch.setattr(client_mod, "WAIT_LOG_EVERY_S", 0.2)
    url = f"http://127.0.0.1:{free_port()}"
    svc, out = _service(lambda: DataflowClient(url, retry_s=0.1), dataflow_give_up_s=1.0)
    try:
        with caplog.at_level("WARNING", logger="astralight.dataflow.client"):
            assert _start(svc) == 1
        # the registration waited dataflow_give_up_s, not the client's own 0.1 s, then put the
        # client's retry back (later calls fail over to the runner's accounting)
        assert svc.client.retry_s == 0.1 and svc.client.stop is None
    finally:
        svc.close()
    waiting = [r.getMessage() for r in caplog.records
               if r.getMessage().startswith(f"waiting for the dataflow at {url}")]
    assert len(waiting) >= 2 and "retrying for up to 1 s" in waiting[0]
    text = out.getvalue()
    assert "raas giving up" in text and "dataflow_give_up_s=1" in text and url in text


def test_a_stop_while_waiting_for_the_dataflow_ends_the_start_at_once():
    url = f"http://127.0.0.1:{free_port()}"
    svc, out = _service(lambda: DataflowClient(url, retry_s=0.1), dataflow_give_up_s=60.0)
    timer = threading.Timer(0.3, svc.stop_event.set)  # what a drain (SIGTERM) sets
    timer.start()
    try:
        assert _start(svc) == 0
    finally:
        timer.cancel()
        svc.close()
    assert "raas stopped before joining the pool" in out.getvalue()


@pytest.mark.parametrize("name", ["", None])
def test_a_workflow_without_a_name_registers_without_one(name):
    flow = FakeDataflow()
    flow.workflow = "multi_turn"
    svc, _ = _service(lambda: flow)
    svc.config.workflow.name = name  # runs any task: nothing for the dataflow to check
    try:
        assert _start(svc) is None
    finally:
        svc.close()
    assert flow.register_metas[0]["workflow"] == ""
