"""DataflowMonitor at the end of fit asks the dataflow to evaluate the trainer's last version when
``eval.every`` would skip it (``POST /v1/eval``), then waits for it as before; a service without
an eval source ends the wait at once. Fake client, stand-in trainer (no fit)."""

from __future__ import annotations

from astralight.dataflow.client import DataflowError
from tests.fakes import FakeMonitorClient as FakeClient
from tests.unit.monitor_fakes import monitor_with

STATS = {"models": {"policy": {"current_version": 7}}}
RESULT = {"complete": True, "avg_at_k": 0.75, "pass_at_k": 0.9}


def test_the_last_version_is_requested_then_logged():
    def run_eval(evals, version):
        evals[version] = dict(RESULT)

    monitor, trainer = monitor_with(STATS, {0: dict(RESULT)})
    fake = monitor.client = FakeClient(STATS, {0: dict(RESULT)}, on_request_eval=run_eval)
    monitor.wait_final_eval_s = 60.0
    monitor.on_fit_end(trainer, None)
    assert fake.eval_requests == [("policy", 7)]  # global_step 14 // 2 steps/version
    logger = trainer.loggers[0]
    steps = [step for metrics, step in logger.calls if "eval/avg_at_k" in metrics]
    assert steps == [0, 14] and 7 in monitor.logged_versions
    assert logger.calls[-1] == ({"finalize": "success"}, -1)


def test_an_already_scheduled_last_version_is_not_requested_again():
    monitor, trainer = monitor_with(STATS, {0: dict(RESULT), 7: dict(RESULT)})
    fake = monitor.client
    monitor.wait_final_eval_s = 60.0
    monitor.on_fit_end(trainer, None)
    assert fake.eval_requests == [] and 7 in monitor.logged_versions


def test_no_eval_source_ends_the_wait():
    def no_source(evals, version):
        raise DataflowError(409, "this service has no eval.source", "eval")

    monitor, trainer = monitor_with(STATS)
    fake = monitor.client = FakeClient(STATS, {}, on_request_eval=no_source)
    monitor.wait_final_eval_s = 600.0
    monitor.on_fit_end(trainer, None)
    assert fake.eval_requests == [("policy", 7)]  # asked once, then stopped waiting


def test_a_version_not_published_yet_is_asked_again():
    answers = iter([DataflowError(409, "not published yet", "version"), None])

    def later(evals, version):
        answer = next(answers)
        if answer is not None:
            raise answer
        evals[version] = dict(RESULT)

    monitor, trainer = monitor_with(STATS)
    fake = monitor.client = FakeClient(STATS, {}, on_request_eval=later)
    monitor.wait_final_eval_s = 60.0
    monitor.on_fit_end(trainer, None)
    assert fake.eval_requests == [("policy", 7), ("policy", 7)]
    assert 7 in monitor.logged_versions
