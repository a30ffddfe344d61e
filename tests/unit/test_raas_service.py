"""RaaSService's episode runner against an in-memory dataflow (the HTTP path is covered by
tests/integration/test_raas_service.py and test_raas_membership.py): continuous leasing, every
task its own episode, batched pushes, counters, eval and sync-round catch-up, re-registration;
membership: in-flight tracking, drain (signal and the dataflow's request), hard stop that
cancels episodes, returned tasks, rejoin after a 404, dropped pushes."""

from __future__ import annotations

import asyncio
import io
import signal
import threading
import time

import pytest

from astralight.engine import SamplingSpec
from astralight.protocol import Task
from astralight.raas.config import RaaSConfig
from astralight.raas.service import RaaSService
from astralight.rewards.toy import ExactMatchReward
from astralight.trainer.tinymodel import build_tokenizer
from astralight.weights.artifacts import ArtifactBuilder
from astralight.workflows.single_turn import SingleTurnWorkflow
from tests.fakes import BatchingDataflow, FakeDataflow, NotFound
from tests.unit.raas_fakes import states as _states
from tests.unit.engine_fakes import ScriptedEngine


def _service(flow, engine, **overrides):
    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(temperature=0.8, max_tokens=4))
    settings = {"max_concurrency": 2, "poll_interval_s": 0.0, "progress_interval_s": 1e9,
                "weight_check_interval_s": 3600.0, **overrides}
    cfg = RaaSConfig(dataflow="mem://", engines={"policy": {"model_path": "unused"}}, workflow=wf,
                     model_ids=["policy"], **settings)
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


def test_an_empty_lease_is_a_long_poll_of_poll_interval_s_and_the_rest_is_napped():
    """serve() asks the dataflow to hold an empty lease for up to poll_interval_s (it answers
    when room opens); a lease answered at once (this fake) is followed by a nap of the rest, so
    the loop still polls every poll_interval_s, not in a busy loop."""
    flow = FakeDataflow([_task(0)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]), max_cycles=3,
                      poll_interval_s=0.05)
    naps, nap = [], svc.runner._nap

    async def recorded_nap(seconds):
        naps.append(seconds)
        await nap(seconds)

    svc.runner._nap = recorded_nap
    svc.start()
    try:
        assert svc.serve() == 0
    finally:
        svc.close()
    assert flow.lease_waits == [0.05] * 3 and list(flow.pushed) == ["t0"]
    # the second lease (empty) was followed by a nap of the rest; the third ended the loop
    assert len(naps) == 1 and 0 < naps[0] <= 0.05


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


def test_tasks_of_another_workflow_are_not_run_but_returned():
    flow = FakeDataflow([_task(0, workflow="multi_turn"), _task(1)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["1"]))
    svc.start()
    try:
        assert svc.run_cycle() == 1
    finally:
        svc.close()
    assert list(flow.pushed) == ["t1"] and svc.counters.unsupported_tasks == 1
    assert flow.returned == [("t0", False)]  # unfailed: another instance may run it
    assert svc.in_flight_count() == 0


def _once(when, action):
    """A push hook that runs ``action()`` the first time ``when()`` holds (a second stop
    request would be a hard stop)."""
    done = []

    def hook(task_id):
        if not done and when():
            done.append(task_id)
            action()

    return hook


class Refused(Exception):
    status = 422


class Unreachable(Exception):
    status = None


def test_a_stop_request_lets_the_episodes_in_flight_finish_and_push():
    flow = FakeDataflow([_task(i) for i in range(100)])
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["1"]))
    svc.start()
    flow.on_push = _once(lambda: True, svc.request_stop)  # SIGTERM after the first push
    try:
        assert svc.serve() == 0
    finally:
        svc.close()
    # every episode in flight finished and pushed; a lease on the wire when the drain began
    # was returned unstarted; nothing else was leased
    pushed, returned = set(flow.pushed), {t for t, failed in flow.returned if not failed}
    assert pushed | returned == set(flow.leased) and not pushed & returned
    assert len(returned) == len(flow.returned) and len(flow.leased) < 100  # it stopped early
    assert "raas stopping" in out.getvalue() and len(pushed) >= 1
    assert flow.deregistered == [svc.instance_id] and svc.in_flight_count() == 0


def test_refused_and_unreachable_pushes_are_counted_and_the_rest_delivered():
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
        assert svc.run_cycle() == 2
    finally:
        svc.close()
    assert sorted(flow.pushed) == ["t0", "t3"]  # every push was tried
    c = svc.counters
    assert (c.tasks_done, c.push_errors, c.samples_pushed, c.dataflow_errors) == (2, 2, 6, 1)
    assert flow.returned == [("t1", True)]  # refused samples: the task failed here
    assert all(name.startswith("raas-push") for name in flow.threads)
    assert svc.in_flight_count() == 0


class SlowWorkflow(SingleTurnWorkflow):
    """Single turn plus an awaited 'tool call'; records how many episodes were in flight."""

    def __init__(self, pause_s=0.05):
        super().__init__(ExactMatchReward(), sampling=SamplingSpec(temperature=0.8, max_tokens=4))
        self.in_flight = self.max_in_flight = 0
        self.pause_s = pause_s

    async def run(self, task, engines):
        self.in_flight += 1  # (the event loop's thread only)
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            out = await super().run(task, engines)
            await asyncio.sleep(self.pause_s)
            return out
        finally:
            self.in_flight -= 1


def _runner_service(flow, wf, engine, **overrides):
    cfg = RaaSConfig(dataflow="mem://", engines={"policy": {"model_path": "unused"}}, workflow=wf,
                     model_ids=["policy"], poll_interval_s=0.01, progress_interval_s=1e9,
                     weight_check_interval_s=3600.0, **overrides)
    return RaaSService(cfg, client_factory=lambda: flow, engines={"policy": engine},
                       out=io.StringIO())


def test_episodes_run_concurrently_up_to_max_concurrency_and_pushes_are_batched():
    flow = BatchingDataflow([_task(i) for i in range(40)])
    engine = ScriptedEngine(build_tokenizer(), ["82", "81"], version=3)
    wf = SlowWorkflow()
    svc = _runner_service(flow, wf, engine, max_concurrency=8, push_concurrency=2)
    svc.start()
    flow.on_push = _once(lambda: len(flow.pushed) == 40, svc.request_stop)
    try:
        assert svc.serve() == 0
    finally:
        svc.close()
    assert sorted(flow.pushed) == sorted(f"t{i}" for i in range(40))
    assert len(flow.push_log) == 40  # every task pushed exactly once
    assert 2 <= wf.max_in_flight <= 8 and svc.counters.peak_in_flight <= 8
    assert sum(flow.batches) == 40 and max(flow.batches) > 1  # several tasks per push request
    assert svc.counters.push_requests == len(flow.batches)
    assert all((s.versions[s.prompt_len:] == 3).all() for v in flow.pushed.values() for s in v)
    assert engine.requests == 120  # 3 completions per task, each its own request


def test_a_freed_slot_is_leased_again_without_waiting_for_the_other_episodes():
    """A long episode does not hold the short ones: while it runs, later tasks are leased,
    run and pushed (no lease cycle waits for its slowest task)."""
    gate = threading.Event()

    class OneSlow(SingleTurnWorkflow):
        async def run(self, task, engines):
            if task.task_id == "t0":
                await asyncio.get_running_loop().run_in_executor(None, gate.wait, 30)
            return await super().run(task, engines)

    flow = BatchingDataflow([_task(i) for i in range(12)])
    wf = OneSlow(ExactMatchReward(), sampling=SamplingSpec(max_tokens=4))
    svc = _runner_service(flow, wf, ScriptedEngine(build_tokenizer(), ["82"]), max_concurrency=3)
    svc.start()

    def on_push(task_id):
        if len(flow.pushed) == 11:  # everything but the slow one: now let it finish
            gate.set()
        if len(flow.pushed) == 12:
            svc.request_stop()  # (once: the twelfth push is the last)

    flow.on_push = on_push
    try:
        assert svc.serve() == 0
    finally:
        gate.set()
        svc.close()
    assert flow.push_log[-1] == "t0" and len(flow.push_log) == 12


def test_unsupported_tasks_start_no_episode_and_a_failed_rejoin_is_a_dataflow_error():
    flow = FakeDataflow([_task(0, workflow="multi_turn")])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.start()
    try:
        async def lease():
            svc.runner._setup()
            return await svc.runner._lease(2)

        assert asyncio.run(lease()) == 0  # returned, not run: the loop naps before leasing again
        assert flow.returned == [("t0", False)]

        def refuse(*a, **kw):
            raise NotFound("unknown instance", "instance_id")

        def cannot_register(*a, **kw):
            raise Unreachable("connection refused")

        flow.lease, flow.register = refuse, cannot_register
        svc.config.dataflow_give_up_s = 0.0
        assert svc.serve() == 1  # counted and given up on, not a traceback out of serve()
        assert svc.counters.dataflow_errors >= 1
    finally:
        svc.close()


def test_a_task_reissued_while_its_episode_runs_is_not_started_twice():
    class Reissue(FakeDataflow):
        def lease(self, instance_id, max_tasks, wait_s=0.0):
            out = super().lease(instance_id, max_tasks, wait_s)
            if self.leased == ["t0"]:
                self.tasks.append(_task(0))  # the dataflow hands t0 out again (lease expired)
            return out

    flow = Reissue([_task(0)])
    engine = ScriptedEngine(build_tokenizer(), ["82"], delay_s=0.2)
    svc, _ = _service(flow, engine, max_cycles=2)
    svc.config.max_concurrency = 4
    svc.start()
    try:
        assert svc.serve() == 0
    finally:
        svc.close()
    assert flow.leased == ["t0", "t0"] and flow.push_log == ["t0"]
    assert svc.counters.reissued_while_running == 1 and svc.in_flight_count() == 0


def test_samples_of_another_task_fail_the_task():
    class Confused(SingleTurnWorkflow):
        async def run(self, task, engines):
            samples = await super().run(task, engines)
            for s in samples:
                s.task_id = "someone-else"
            return samples

    flow = FakeDataflow([_task(0)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.config.workflow = Confused(ExactMatchReward())
    svc.runner = type(svc.runner)(svc)
    svc.start()
    try:
        assert svc.run_cycle() == 0
    finally:
        svc.close()
    assert flow.returned == [("t0", True)] and flow.pushed == {}
    assert svc.counters.workflow_errors == 1


def test_a_broken_workflow_stops_the_raas_with_exit_2_naming_it():
    """A workflow that raises BrokenWorkflowError (every episode fails alike) stops the RaaS:
    one line naming it, the task returned as failed, exit 2 (the launcher restarts nothing)."""
    from astralight.workflows.base import BrokenWorkflowError

    class Broken(SingleTurnWorkflow):
        async def run(self, task, engines):
            raise BrokenWorkflowError("the agent raised KeyError: 'answer' in every episode")

    flow = FakeDataflow([_task(i) for i in range(50)])
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.config.workflow = Broken(ExactMatchReward())
    svc.runner = type(svc.runner)(svc)
    svc.start()
    try:
        assert svc.serve() == 2
    finally:
        svc.close()
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("raas exiting 2"))
    assert "the workflow is broken" in line and "KeyError: 'answer'" in line
    assert ("t0", True) in flow.returned and flow.pushed == {}
    assert len(flow.leased) < 50  # it stopped leasing


def test_a_task_whose_episodes_all_failed_is_returned_at_once_as_failed(caplog):
    """Not left for its lease to expire (an eval task would hold its version's evaluation)."""
    from astralight.workflows.base import TaskFailedError

    class AllFailed(SingleTurnWorkflow):
        async def run(self, task, engines):
            raise TaskFailedError(f"every episode of task {task.task_id} failed before it left a "
                                  "sample (3 of 3; the first: RuntimeError: boom)")

    flow = FakeDataflow([_task(0)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.config.workflow = AllFailed(ExactMatchReward())
    svc.runner = type(svc.runner)(svc)
    svc.start()
    try:
        with caplog.at_level("WARNING"):
            assert svc.run_cycle() == 0
    finally:
        svc.close()
    assert flow.returned == [("t0", True)] and flow.pushed == {}
    assert "every episode of task t0 failed" in caplog.text and "Traceback" not in caplog.text


def test_a_weight_version_the_engine_can_never_load_stops_the_raas_with_exit_2():
    """A LoRA adapter published to an engine started without enable_lora: retrying cannot help
    and every rollout would go stale, so the RaaS stops with exit 2 and one line saying why (the
    launcher shows it and restarts nothing) instead of serving an ever older version."""
    from astralight.raas.weight_sync import EngineConfigError

    flow = FakeDataflow([_task(i) for i in range(50)])
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]),
                        weight_check_interval_s=0.01)

    def refresh(force=False):
        raise EngineConfigError("update_adapter: this engine was started without LoRA support; "
                                "set enable_lora: true")

    svc.start()  # builds the weight syncs
    assert svc.syncs
    for sync in svc.syncs.values():
        sync.refresh = refresh
    try:
        assert svc.serve() == 2
    finally:
        svc.close()
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("raas exiting 2"))
    assert "cannot be loaded by this engine" in line and "enable_lora: true" in line
    assert len(flow.leased) < 50  # it stopped leasing


def test_a_weight_version_lands_between_batches_while_episodes_run():
    engine = ScriptedEngine(build_tokenizer(), ["82"], version=1)
    first = engine.generate_batch([[5, 6]], SamplingSpec(max_tokens=4))
    engine.update_weights({"w": None}, 2)
    second = engine.generate_batch([[5, 6]], SamplingSpec(max_tokens=4))
    assert (first[0].versions, second[0].versions) == ([1, 1, 1], [2, 2, 2])
    assert engine.updates == [(["w"], 2)] and engine.version == 2
    engine.close()


def test_a_drain_asked_through_the_heartbeat_finishes_and_deregisters():
    flow = FakeDataflow([_task(i) for i in range(60)])
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.start()

    def drain_asked(task_id):
        flow.on_push = None
        flow.drain_requested = True  # the drain route was called
        svc.heartbeat_once()
        svc.heartbeat_once()  # the next heartbeat repeats it: still one drain, no hard stop

    flow.on_push = drain_asked
    try:
        assert svc.serve() == 0
    finally:
        svc.close()
    assert svc.draining and "the dataflow's drain route" in out.getvalue()
    pushed, returned = set(flow.pushed), {t for t, failed in flow.returned if not failed}
    assert pushed | returned == set(flow.leased) and not pushed & returned
    assert len(flow.leased) < 60 and svc.in_flight_count() == 0
    assert flow.deregistered == [svc.instance_id]
    assert "raas left the pool" in out.getvalue() and "hard stop" not in out.getvalue()


def test_after_a_signalled_drain_no_thread_of_the_service_outlives_close():
    """serve() then close() wait for every thread the service started (signal handler, drain
    timer and watch, heartbeat, engine worker, pools): a daemon thread still running when the
    interpreter finalizes is killed where it stands, and inside torch that aborts the process."""
    flow = FakeDataflow([_task(i) for i in range(60)])
    flow.info = lambda: {}  # the drain watch probes the dataflow for as long as it runs
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    before = set(threading.enumerate())

    def stop_asked(task_id):
        flow.on_push = None
        svc.request_stop(signal.SIGTERM)  # as the handler is called: the work on its own thread

    flow.on_push = stop_asked
    svc.start()
    try:
        assert svc.serve() == 0
        assert "drain: SIGTERM" in out.getvalue()
    finally:
        svc.close()
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == []
    assert flow.deregistered == [svc.instance_id]


def test_drain_under_load_accounts_for_every_lease():
    flow = BatchingDataflow([_task(i) for i in range(200)])
    wf = SlowWorkflow()
    svc = _runner_service(flow, wf, ScriptedEngine(build_tokenizer(), ["82"]),
                          max_concurrency=8, push_concurrency=4)
    svc.start()
    flow.on_push = _once(lambda: len(flow.pushed) >= 10, svc.request_stop)
    try:
        assert svc.serve() == 0
    finally:
        svc.close()
    pushed, returned = set(flow.pushed), {t for t, _ in flow.returned}
    assert set(flow.leased) == pushed | returned and not pushed & returned
    assert len(flow.leased) == len(set(flow.leased)) and len(flow.tasks) > 0  # it stopped early
    assert svc.in_flight_count() == 0 and flow.deregistered == [svc.instance_id]
    assert wf.max_in_flight >= 2


def test_a_workflow_exception_returns_its_task_as_failed():
    class Broken(SingleTurnWorkflow):
        async def run(self, task, engines):
            if task.task_id == "t0":
                raise RuntimeError("tool sandbox died")
            return await super().run(task, engines)

    flow = FakeDataflow([_task(0), _task(1)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.config.workflow = Broken(ExactMatchReward())
    svc.runner = type(svc.runner)(svc)
    svc.start()
    try:
        assert svc.run_cycle() == 1
    finally:
        svc.close()
    assert flow.returned == [("t0", True)] and list(flow.pushed) == ["t1"]
    assert svc.counters.workflow_errors == 1 and svc.in_flight_count() == 0


def test_a_synchronous_workflow_runs_through_the_adapter():
    class OldStyle:
        """The synchronous contract: run(tasks, engines) -> {task_id: samples}."""

        name = "single_turn"

        def __init__(self):
            self.inner = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(max_tokens=4))
            self.threads = set()

        def run(self, tasks, engines):
            self.threads.add(threading.current_thread().name)
            comps = engines["policy"].generate([[5, 6]], SamplingSpec(max_tokens=4))
            assert len(comps) == 1  # a blocking view of the async engine
            return asyncio.run(_all(self.inner, tasks, engines))

    async def _all(wf, tasks, engines):
        return {t.task_id: await wf.run(t, {k: e.inner for k, e in engines.items()})
                for t in tasks}

    flow = FakeDataflow([_task(0), _task(1)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    old = OldStyle()
    svc.config.workflow = old
    svc.runner = type(svc.runner)(svc)
    svc.start()
    try:
        assert svc.run_cycle() == 2
    finally:
        svc.close()
    assert sorted(flow.pushed) == ["t0", "t1"]
    assert all(s.reward == 1.0 for v in flow.pushed.values() for s in v)
    assert all(name.startswith("raas-exec") for name in old.threads)  # off the event loop


def test_a_task_whose_version_cannot_be_loaded_is_returned_unfailed():
    flow = FakeDataflow([_task(0), _task(1)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.start()

    async def no_weights(task):
        raise OSError("weight download failed")

    svc.runner._catch_up = no_weights
    try:
        assert svc.run_cycle() == 0
    finally:
        svc.close()
    assert sorted(flow.returned) == [("t0", False), ("t1", False)]
    assert svc.in_flight_count() == 0 and svc.counters.workflow_errors == 0


def test_a_hard_stop_cancels_episodes_waiting_on_the_engine():
    flow = FakeDataflow([_task(i) for i in range(2)])
    engine = ScriptedEngine(build_tokenizer(), ["82"], delay_s=0.5)
    svc, out = _service(flow, engine)
    server, codes, exits = _serve_in_thread(svc)
    try:
        _wait(lambda: svc.in_flight_count() == 2, "episodes in flight")
        svc.hard_stop("test")
        server.join(timeout=30)
        assert not server.is_alive()
    finally:
        svc.close()
    assert codes == exits == [130] and flow.pushed == {}
    assert sorted(t for t, _ in flow.returned) == ["t0", "t1"]
    assert svc.counters.episodes_cancelled == 2


# ---------------------------------------------------------------------- membership


def _serve_in_thread(svc):
    """Start ``svc`` and run ``serve()`` on a thread, a hard stop's exit recorded, not done:
    returns (the thread, serve's return codes, the exit codes the hard stop asked for)."""
    exits, codes = [], []
    svc._exit = exits.append
    svc.start()
    server = threading.Thread(target=lambda: codes.append(svc.serve()))
    server.start()
    return server, codes, exits


def _wait(predicate, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_register_sends_capacity_units_and_heartbeat_reports_in_flight():
    flow = FakeDataflow([_task(0)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]), capacity_units=2.5)
    svc.start()
    try:
        assert flow.register_calls[0][1] == 2.5
        svc._track(["a", "b"])
        assert svc.heartbeat_once()["drain"] is False
        assert flow.heartbeats[-1] == 2
        svc._untrack(["a", "b"])
        svc.heartbeat_once()
        assert flow.heartbeats[-1] == 0 and not svc.draining
    finally:
        svc.close()


def test_the_heartbeat_reports_the_engines_weight_pauses():
    engine = ScriptedEngine(build_tokenizer(), ["82"])
    engine.weight_updates, engine.weight_pause_s_total, engine.weight_pause_s_last = 2, 0.3, 0.1
    flow = FakeDataflow()
    svc, _ = _service(flow, engine)
    svc.start()
    try:
        svc.heartbeat_once()
    finally:
        svc.close()
    assert flow.heartbeat_stats[-1] == {"weight_updates": 2.0, "weight_pause_s": 0.3}


def test_tasks_leased_while_a_drain_begins_are_returned_unstarted():
    class DrainDuringLease(FakeDataflow):
        def lease(self, instance_id, max_tasks, wait_s=0.0):
            out = super().lease(instance_id, max_tasks, wait_s)
            svc.request_stop()  # SIGTERM lands while the lease is on the wire
            return out

    flow = DrainDuringLease([_task(i) for i in range(6)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.start()
    try:
        assert svc.serve() == 0
    finally:
        svc.close()
    assert flow.pushed == {}  # nothing was generated after the drain began
    assert flow.returned == [("t0", False), ("t1", False)]
    assert flow.deregistered == [svc.instance_id] and svc.counters.tasks_returned == 2


def test_a_second_stop_request_returns_everything_in_flight_and_exits_at_once():
    flow = FakeDataflow([_task(i) for i in range(6)])
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]), cycle_delay_s=600.0)
    server, codes, exits = _serve_in_thread(svc)
    try:
        _wait(lambda: svc.in_flight_count() == 2, "a cycle in its delay")  # generated, not pushed
        svc.request_stop()  # drain: would wait out the 600 s delay
        assert svc.draining and svc.in_flight_count() == 2
        svc.request_stop()  # the second one: hard stop
        server.join(timeout=30)
        assert not server.is_alive()
    finally:
        svc.close()
    assert codes == [130] and exits == [130]
    assert flow.returned == [("t0", False), ("t1", False)] and flow.pushed == {}
    assert flow.deregistered == [svc.instance_id]
    assert "raas hard stop" in out.getvalue()


def test_a_drain_that_outlasts_drain_timeout_s_becomes_a_hard_stop():
    flow = FakeDataflow([_task(i) for i in range(6)])
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]), cycle_delay_s=600.0,
                        drain_timeout_s=0.2)
    server, codes, exits = _serve_in_thread(svc)
    try:
        _wait(lambda: svc.in_flight_count() == 2, "a cycle in its delay")
        svc.drain("test")
        server.join(timeout=30)
        assert not server.is_alive()
    finally:
        svc.close()
    assert codes == exits == [130]
    assert sorted(t for t, _ in flow.returned) == ["t0", "t1"]
    assert "drain_timeout_s=0.2" in out.getvalue()


def test_a_cycle_delay_holds_the_generated_tasks_in_flight_until_pushed():
    flow = FakeDataflow([_task(i) for i in range(2)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]), cycle_delay_s=0.3)
    svc.start()
    seen = []
    watcher = threading.Thread(target=lambda: (
        _wait(lambda: svc.in_flight_count() > 0, "a lease"),
        seen.append((svc.in_flight_count(), len(flow.pushed)))))
    watcher.start()
    try:
        assert svc.run_cycle() == 2
    finally:
        watcher.join()
        svc.close()
    assert seen == [(2, 0)]  # held, generated and not yet pushed, while the cycle slept
    assert svc.in_flight_count() == 0 and sorted(flow.pushed) == ["t0", "t1"]


def test_a_heartbeat_404_rejoins_under_the_same_id_and_threads_register_once():
    class Forgetful(FakeDataflow):
        forget_heartbeat = False

        def heartbeat(self, instance_id, in_flight=None, stats=None):
            if self.forget_heartbeat:
                self.forget_heartbeat = False
                raise NotFound("unknown instance", "instance_id")
            return super().heartbeat(instance_id, in_flight, stats)

        def register(self, *a, **kw):
            time.sleep(0.05)  # slow enough for racing threads to overlap
            return super().register(*a, **kw)

    flow = Forgetful([_task(0)])
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.start()
    try:
        first = svc.instance_id
        flow.forget_heartbeat = True
        assert svc.heartbeat_once() is None
        assert flow.registrations == 2 and flow.register_calls[-1][0] == first
        # a restart noticed by several threads at once (lease, heartbeat, pushes): one register
        seen = svc._registrations
        racers = [threading.Thread(target=svc.rejoin, args=(seen,)) for _ in range(4)]
        for t in racers:
            t.start()
        for t in racers:
            t.join()
        assert flow.registrations == 3 and svc.counters.rejoins == 2
        assert svc.instance_id == first and "registered again" in out.getvalue()
    finally:
        svc.close()


def test_pushes_of_tasks_a_fresh_dataflow_forgot_are_dropped_and_the_loop_goes_on():
    flow = FakeDataflow([_task(i) for i in range(4)])
    flow.unknown_tasks = {"t0"}
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.start()
    flow.on_push = _once(lambda: len(flow.push_log) == 4, svc.request_stop)
    try:
        assert svc.serve() == 0
    finally:
        svc.close()
    c = svc.counters
    assert (c.pushes_dropped, c.push_errors, c.tasks_done) == (1, 0, 3)
    assert sorted(flow.pushed) == ["t1", "t2", "t3"] and svc.in_flight_count() == 0
    assert "dropped 1" in out.getvalue().strip().splitlines()[-1]


def test_a_push_refused_for_an_unknown_instance_rejoins_and_is_pushed_again():
    class Restarted(FakeDataflow):
        forgotten = True

        def push(self, instance_id, task_id, samples):
            if self.forgotten:
                raise NotFound("unknown instance", "instance_id")
            return super().push(instance_id, task_id, samples)

        def register(self, *a, **kw):
            self.forgotten = False
            return super().register(*a, **kw)

    flow = Restarted([_task(0)])
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.start()
    flow.forgotten = True  # the dataflow restarted on a fresh state after we registered
    try:
        assert svc.run_cycle() == 1
    finally:
        svc.close()
    assert list(flow.pushed) == ["t0"] and flow.registrations == 2
    assert svc.counters.rejoins == 1 and svc.counters.pushes_dropped == 0


@pytest.mark.parametrize("key,value", [("capacity_units", "0"), ("cycle_delay_s", "-1"),
                                       ("drain_timeout_s", "0"), ("concurrent_cycles", "4")])
def test_membership_config_keys_are_validated(key, value):
    from astralight.raas.config import parse_config

    with pytest.raises(ValueError, match=key):
        parse_config(["--engines", '{"policy": {"model_path": "m"}}', f"--{key}", value])


def test_membership_config_keys_parse():
    from astralight.raas.config import parse_config

    cfg = parse_config(["--engines", '{"policy": {"model_path": "m"}}', "--capacity_units", "2",
                        "--cycle_delay_s", "0.5", "--drain_timeout_s", "30"])
    assert (cfg.capacity_units, cfg.cycle_delay_s, cfg.drain_timeout_s) == (2.0, 0.5, 30.0)


class GoneDataflow(FakeDataflow):
    """A dataflow that stops answering once ``gone`` is set (the whole run was killed)."""

    gone = False

    def info(self):
        from astralight.dataflow.client import DataflowUnreachable

        if self.gone:
            raise DataflowUnreachable("dataflow at mem:// unreachable for 0 s: refused")
        return {"model_ids": ["policy"]}


def test_a_drain_whose_dataflow_is_gone_becomes_a_hard_stop():
    flow = GoneDataflow([_task(i) for i in range(6)])
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]), cycle_delay_s=600.0)
    svc.drain_unreachable_s = 0.5
    server, codes, exits = _serve_in_thread(svc)
    try:
        _wait(lambda: svc.in_flight_count() == 2, "a cycle in its delay")
        svc.drain("test")  # would wait out the 600 s delay (drain_timeout_s: 120 s)
        time.sleep(1.5)
        assert server.is_alive() and not exits  # the dataflow answers: the drain goes on
        flow.gone = True
        server.join(timeout=30)
        assert not server.is_alive()
    finally:
        svc.close()
    assert codes == exits == [130]
    assert "unreachable for 0.5 s during the drain" in out.getvalue()


def test_held_weights_report_records_an_engine_that_cannot_read_back(tmp_path):
    class Sharded(ScriptedEngine):
        def held_weights(self, shapes=None):
            raise NotImplementedError("held_weights: tensor_parallel_size=2: not built")

    svc, out = _service(FakeDataflow(), Sharded(build_tokenizer(), ["82"]))
    try:
        report = svc.write_held_weights_report(str(tmp_path / "held.json"))
    finally:
        svc.close()
    entry = report["policy"]
    assert entry["error"] == "NotImplementedError: held_weights: tensor_parallel_size=2: not built"
    assert "held" not in entry and "mismatched" not in entry
    assert "held_weights: tensor_parallel_size=2" in out.getvalue()
    assert (tmp_path / "held.json").exists()
