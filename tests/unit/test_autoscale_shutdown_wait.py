"""The autoscaler does not exit before its retired instances have (issue 40, breakage 7).

Under a command backend the retire command (``scancel --signal=TERM``) returns at once, while the
RaaS drains for a few seconds more; whatever the job script stops after the autoscaler (the
dataflow) must outlive those drains. :meth:`Autoscaler.shutdown` therefore waits until the
backend -- or, when it cannot tell, the dataflow's instance table -- says every retired instance
has exited, at most ``shutdown_grace_s``. The live Slurm test (tests/integration/
test_slurm_cluster.py) runs it against real jobs.
"""

from __future__ import annotations

import io

import pytest

from astralight.autoscale.policy import Policy, PolicyConfig
from astralight.autoscale.service import AutoscaleConfig, Autoscaler, build_parser, check_args
from tests.fakes import FakeAutoscaleDataflow as FakeDataflow
from tests.unit.autoscale_fakes import Clock, FakeBackend


class SlowToStop(FakeBackend):
    """Retiring only asks the instance to stop (like scancel --signal=TERM); it exits after
    ``polls`` more liveness checks. ``tell=False``: a backend that cannot tell liveness."""

    def __init__(self, polls: int, tell: bool = True):
        super().__init__()
        self.polls, self.tell, self.stopping = polls, tell, {}

    def retire(self, instance_id, n=None):
        self.calls.append(("retire", instance_id, n))
        self.stopping[instance_id] = self.polls

    def alive(self, instance_id):
        if not self.tell:
            return None
        left = self.stopping.get(instance_id)
        if left is None:
            return instance_id in self.running
        if left <= 0:
            self.running.discard(instance_id)
            return False
        self.stopping[instance_id] = left - 1
        return True


def scaler_with(backend, grace=30.0):
    clock, flow = Clock(), FakeDataflow()
    scaler = Autoscaler(Policy(PolicyConfig(min_instances=2, max_instances=2)), backend, flow,
                        AutoscaleConfig(initial=2, poll_s=1.0, shutdown_grace_s=grace),
                        clock=clock, wall=lambda: 1000.0 + clock.t, out=io.StringIO(),
                        sleep=clock.sleep)
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        clock.t += s

    scaler.sleep = sleep
    return scaler, flow, clock, sleeps


def test_shutdown_waits_until_the_retired_instances_have_exited():
    backend = SlowToStop(polls=3)
    scaler, _, clock, sleeps = scaler_with(backend)
    scaler.start()
    scaler.shutdown()
    assert {c[1] for c in backend.calls if c[0] == "retire"} == {"auto-0", "auto-1"}
    assert all(v <= 0 for v in backend.stopping.values())  # both exited before it returned
    assert sleeps and clock.t < 30.0
    assert sorted(scaler.retired) == ["auto-0", "auto-1"] and not scaler.retiring


def test_shutdown_wait_is_bounded_by_the_grace_period():
    backend = SlowToStop(polls=10_000)  # never exits
    scaler, _, clock, _ = scaler_with(backend, grace=5.0)
    scaler.start()
    scaler.shutdown()
    assert 5.0 <= clock.t <= 6.0
    assert "still running after 5s (--shutdown-grace-s)" in scaler.out.getvalue()


def test_without_liveness_the_dataflow_table_says_when_they_left():
    backend = SlowToStop(polls=0, tell=False)
    scaler, flow, clock, sleeps = scaler_with(backend)
    scaler.start()
    for iid in ("auto-0", "auto-1"):
        flow.rows[iid] = {"instance_id": iid, "model_ids": ["policy"], "status": "draining"}
    original = flow.stats

    def stats():  # the instances deregister on the third poll
        if len(sleeps) >= 2:
            for row in flow.rows.values():
                row["status"] = row["state"] = "left"
        return original()

    flow.stats = stats
    scaler.shutdown()
    assert len(sleeps) == 2 and clock.t == 2.0


def test_shutdown_grace_flag():
    args = build_parser().parse_args(["--backend", "command", "--launch-cmd", "x {instance}",
                                      "--retire-cmd", "y {instance}", "--shutdown-grace-s", "-1"])
    assert "--shutdown-grace-s" in check_args(args)
    assert build_parser().parse_args([]).shutdown_grace_s == 120.0


def test_a_deregistered_instance_is_done_while_its_job_still_tears_down():
    """What the dataflow needs from a retired instance ends with its deregistration: the wait
    does not also sit out the job's teardown (vLLM's exit, the scheduler's bookkeeping)."""
    backend = SlowToStop(polls=10_000)  # the backend keeps saying "alive"
    scaler, flow, clock, sleeps = scaler_with(backend)
    scaler.start()
    flow.rows["auto-0"] = {"instance_id": "auto-0", "model_ids": ["policy"], "status": "left",
                           "state": "left"}
    flow.rows["auto-1"] = {"instance_id": "auto-1", "model_ids": ["policy"], "status": "draining"}
    original = flow.stats

    def stats():  # auto-1 deregisters after one more poll
        if sleeps:
            flow.rows["auto-1"].update(status="left", state="left")
        return original()

    flow.stats = stats
    scaler.shutdown()
    assert len(sleeps) == 1 and clock.t == 1.0


def test_an_injected_clock_needs_the_sleep_that_advances_it():
    """With a test's clock and the real sleep the shutdown wait never reached its deadline: a
    unit test of adoption hung in it for good."""
    with pytest.raises(ValueError, match="sleep: give the sleep that advances the injected clock"):
        Autoscaler(Policy(PolicyConfig()), object(), FakeDataflow(), AutoscaleConfig(),
                   clock=Clock(), out=io.StringIO())
