"""RaaSService's lease cycle against an in-memory dataflow (the HTTP path is covered by
tests/integration/test_raas_service.py): pushes, counters, eval and sync-round catch-up,
re-registration."""

from __future__ import annotations

import io
import threading
import time

import pytest

from astralight.protocol import Task
from astralight.raas.config import RaaSConfig
from astralight.raas.engine import SamplingSpec, SerializedEngine
from astralight.raas.service import RaaSService
from astralight.rewards.toy import ExactMatchReward
from astralight.tinymodel import build_tokenizer
from astralight.weights.artifacts import ArtifactBuilder
from astralight.workflows.single_turn import SingleTurnWorkflow
from tests.unit.test_raas_weight_sync import FakeStore, _states
from tests.unit.test_single_turn_workflow import ScriptedEngine


class NotFound(Exception):
    status = 404


class FakeDataflow(FakeStore):
    """Register / heartbeat / lease / push in memory, plus FakeStore's weight routes."""

    def __init__(self, tasks=()):
        super().__init__()
        self.tasks = list(tasks)
        self.pushed = {}
        self.registrations = 0
        self.forget_instance = False

    def register(self, model_ids, capacity, instance_id=None, meta=None):
        self.registrations += 1
        return {"instance_id": instance_id or "i0", "lease_seconds": 30.0}

    def heartbeat(self, instance_id):
        return {}

    def lease(self, instance_id, max_tasks):
        if self.forget_instance:
            self.forget_instance = False
            raise NotFound("unknown instance")
        out, self.tasks = self.tasks[:max_tasks], self.tasks[max_tasks:]
        return out

    def push(self, instance_id, task_id, samples):
        dup = task_id in self.pushed
        self.pushed.setdefault(task_id, samples)
        return {"accepted": 0 if dup else len(samples), "duplicate": dup}


def _service(flow, engine, **overrides):
    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(temperature=0.8, max_tokens=4))
    cfg = RaaSConfig(dataflow="mem://", engines={"policy": {"model_path": "unused"}}, workflow=wf,
                     model_ids=["policy"], max_concurrency=2, poll_interval_s=0.0,
                     progress_interval_s=1e9, weight_check_interval_s=3600.0, **overrides)
    out = io.StringIO()
    svc = RaaSService(cfg, client_factory=lambda: flow, engines={"policy": engine}, out=out)
    return svc, out


def _task(i, **kw):
    return Task(task_id=f"t{i}", prompt="37+45=", n=3, model_ids=["policy"],
                metadata={"answer": "82"}, **kw)


def test_cycles_lease_run_and_push_every_task():
    flow = FakeDataflow([_task(i) for i in range(3)])
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]), max_cycles=3)
    svc.start()
    try:
        assert out.getvalue().startswith("raas ready instance=raas-")
        assert svc.serve() == 0
    finally:
        svc.close()
    assert sorted(flow.pushed) == ["t0", "t1", "t2"]
    assert all(len(s) == 3 and all(x.reward == 1.0 for x in s) for s in flow.pushed.values())
    c = svc.counters
    assert (c.tasks_done, c.samples_pushed, c.tokens_generated) == (3, 9, 27)  # "82" + EOS
    last = out.getvalue().strip().splitlines()[-1]
    assert "tasks 3 | samples 9 (dup 0)" in last and "policy=v7" in last


def test_an_eval_task_ahead_of_the_engine_loads_its_version_first():
    flow = FakeDataflow()
    engine = ScriptedEngine(build_tokenizer(), ["82"], version=0)
    svc, _ = _service(flow, engine)
    svc.start()  # the background check finds nothing published
    try:
        flow.add(ArtifactBuilder("policy").build(1, _states(1)[0]))
        flow.tasks = [_task(0, kind="eval", eval_version=1)]
        assert svc.run_cycle() == 1
    finally:
        svc.close()
    samples = flow.pushed["t0"]
    assert engine.version == 1
    assert all((s.versions[s.prompt_len:] == 1).all() for s in samples)


def test_a_sync_task_loads_the_round_version_before_generating():
    flow = FakeDataflow()
    engine = ScriptedEngine(build_tokenizer(), ["82"], version=0)
    svc, _ = _service(flow, engine)
    svc.start()
    try:
        flow.add(ArtifactBuilder("policy").build(1, _states(1)[0]))
        flow.tasks = [_task(0, min_versions={"policy": 1})]
        assert svc.run_cycle() == 1
    finally:
        svc.close()
    assert engine.version == 1
    assert all((s.versions[s.prompt_len:] == 1).all() for s in flow.pushed["t0"])


def test_a_forgotten_instance_registers_again():
    flow = FakeDataflow([_task(0)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["1"]))
    svc.start()
    try:
        flow.forget_instance = True
        assert svc.run_cycle() == 0 and flow.registrations == 2
        assert svc.run_cycle() == 1
    finally:
        svc.close()


def test_tasks_of_another_workflow_are_not_run():
    flow = FakeDataflow([_task(0, workflow="multi_turn"), _task(1)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["1"]))
    svc.start()
    try:
        assert svc.run_cycle() == 1
    finally:
        svc.close()
    assert list(flow.pushed) == ["t1"] and svc.counters.unsupported_tasks == 1


def test_stop_request_ends_serve_after_the_cycle():
    flow = FakeDataflow([_task(i) for i in range(100)])
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["1"]))
    svc.start()
    try:
        original = svc.run_cycle

        def cycle_then_stop():
            n = original()
            svc.request_stop()
            return n

        svc.run_cycle = cycle_then_stop
        assert svc.serve() == 0
    finally:
        svc.close()
    assert len(flow.pushed) == 2  # one cycle of max_concurrency tasks, fully pushed
    assert "raas stopping" in out.getvalue()
    with pytest.raises(KeyboardInterrupt):  # a second signal stops at once
        svc.request_stop()


class Refused(Exception):
    status = 422


class Unreachable(Exception):
    status = None


def test_concurrent_pushes_count_refusals_and_raise_when_unreachable():
    import threading

    class Flaky(FakeDataflow):
        def __init__(self, tasks):
            super().__init__(tasks)
            self.threads = set()

        def push(self, instance_id, task_id, samples):
            self.threads.add(threading.current_thread().name)
            if task_id == "t1":
                raise Refused("samples[0].token_ids: bad")
            if task_id == "t2":
                raise Unreachable("connection refused")
            return super().push(instance_id, task_id, samples)

    flow = Flaky([_task(i) for i in range(4)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]), push_concurrency=4)
    svc.config.max_concurrency = 4
    svc.start()
    try:
        with pytest.raises(Unreachable):
            svc.run_cycle()
    finally:
        svc.close()
    assert sorted(flow.pushed) == ["t0", "t3"]  # every push was tried before raising
    c = svc.counters
    assert (c.tasks_done, c.push_errors, c.samples_pushed) == (2, 2, 6)
    assert all(name.startswith("raas-push") for name in flow.threads)


class SlowWorkflow(SingleTurnWorkflow):
    """Single turn plus a 'tool call' that keeps the cycle busy; records cycles in flight."""

    def __init__(self):
        super().__init__(ExactMatchReward(), sampling=SamplingSpec(temperature=0.8, max_tokens=4))
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0

    def run(self, tasks, engines):
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            out = super().run(tasks, engines)
            time.sleep(0.05)
            return out
        finally:
            with self.lock:
                self.in_flight -= 1


class LockedFakeDataflow(FakeDataflow):
    def __init__(self, tasks=()):
        super().__init__(tasks)
        self.lock = threading.Lock()

    def lease(self, instance_id, max_tasks):
        with self.lock:
            return super().lease(instance_id, max_tasks)

    def push(self, instance_id, task_id, samples):
        with self.lock:
            return super().push(instance_id, task_id, samples)


def test_concurrent_cycles_overlap_share_engines_and_push_every_task_once():
    flow = LockedFakeDataflow([_task(i) for i in range(24)])
    engine = ScriptedEngine(build_tokenizer(), ["82", "81"], version=3)
    wf = SlowWorkflow()
    cfg = RaaSConfig(dataflow="mem://", engines={"policy": {"model_path": "unused"}}, workflow=wf,
                     model_ids=["policy"], max_concurrency=8, concurrent_cycles=4,
                     poll_interval_s=0.01, progress_interval_s=1e9, weight_check_interval_s=3600.0)
    svc = RaaSService(cfg, client_factory=lambda: flow, engines={"policy": engine}, out=io.StringIO())
    svc.start()
    assert isinstance(svc.engines["policy"], SerializedEngine)
    stopper = threading.Thread(target=lambda: (time.sleep(0.1), [time.sleep(0.05) for _ in
                                                                 range(200) if flow.tasks],
                                               svc.request_stop()))
    stopper.start()
    try:
        assert svc.serve() == 0
    finally:
        stopper.join()
        svc.close()
    assert sorted(flow.pushed) == sorted(f"t{i}" for i in range(24))
    assert wf.max_in_flight >= 2  # cycles really overlapped
    assert all((s.versions[s.prompt_len:] == 3).all() for v in flow.pushed.values() for s in v)


def test_serialized_engine_stamps_the_version_of_each_generate_call():
    engine = SerializedEngine(ScriptedEngine(build_tokenizer(), ["82"], version=1))
    ids = [[5, 6]]
    first = engine.generate(ids, SamplingSpec(max_tokens=4))
    engine.update_weights({}, 2)
    second = engine.generate(ids, SamplingSpec(max_tokens=4))
    assert (first[0].version, second[0].version, engine.version) == (1, 2, 2)
    engine.version = 5  # the weight sync moves a bit-identical version
    assert engine.inner.version == 5
