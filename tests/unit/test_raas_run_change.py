"""A RaaS follows its dataflow into a new run, and stops when its instance id is taken over.

A dataflow restarted on a fresh ``state_dir`` is a new run (another run id; versions start again
at 0; task ids repeat). The RaaS must drop everything of the old run -- the weights it holds,
the samples of tasks leased in it -- and load the new run's published version in full, whatever
its number, before it leases again; if the new run has published nothing (its v0 is the initial
model, which the engine no longer holds) it exits ``RUN_CHANGED_EXIT``. A RaaS whose instance
id another process registered (403 ``instance_secret`` on its own calls) exits
``TAKEN_OVER_EXIT`` at once instead of retrying for ``dataflow_give_up_s``.

The dataflows are the shared fakes :class:`tests.fakes.RestartingDataflow` and
:class:`tests.fakes.TakeoverDataflow`; the weight store :class:`tests.fakes.FakeStore`.
"""

from __future__ import annotations

import io

import torch

from astralight.dataflow.client import DataflowError
from astralight.engine import SamplingSpec
from astralight.protocol import Task
from astralight.raas.config import RaaSConfig
from astralight.raas.membership import RUN_CHANGED_EXIT, TAKEN_OVER_EXIT
from astralight.raas.service import RaaSService
from astralight.raas.weight_sync import WeightSync
from astralight.rewards.toy import ExactMatchReward
from astralight.trainer.tinymodel import build_tokenizer
from astralight.weights.artifacts import ArtifactBuilder
from astralight.workflows.single_turn import SingleTurnWorkflow
from tests.fakes import FakeStore, RestartingDataflow, TakeoverDataflow
from tests.unit.engine_fakes import ScriptedEngine
from tests.unit.raas_fakes import states


class RunStore(FakeStore):
    """A weight store naming its run the way DataflowClient does (its ``run_id``)."""

    run_id = "run-1"

    def new_run(self, run_id: str) -> None:
        self.run_id, self.manifests, self.files = run_id, {}, {}


class LoadingEngine:
    """Records every load: ``(version, {name: tensor})``."""

    def __init__(self, version=0):
        self.version, self.loaded = version, []

    def update_weights(self, named_tensors, version):
        self.loaded.append((version, {k: v.clone() for k, v in named_tensors.items()}))
        self.version = version


def _publish(store, builder, versions, seed):
    out = states(len(versions), seed=seed)
    for v, state in zip(versions, out):
        store.add(builder.build(v, state))
    return out


def _same(tensors, state):
    return set(tensors) == set(state) and all(
        torch.equal(tensors[k], state[k].to(torch.bfloat16)) for k in state)


# ----------------------------------------------------------------------------- WeightSync


def test_a_new_run_below_the_held_version_is_pulled_in_full_and_loaded():
    store, engine = RunStore(), LoadingEngine()
    sync = WeightSync(lambda: store, "policy", engine, check_interval_s=0.0, background=False)
    _publish(store, ArtifactBuilder("policy", full_every=10), [1, 2, 3], seed=0)
    sync.refresh()
    assert engine.version == 3 and sync.run_id == "run-1"
    # the dataflow restarts on a fresh state_dir; its trainer publishes v1 of the new run
    store.new_run("run-2")
    new = _publish(store, ArtifactBuilder("policy", full_every=10), [1], seed=1)
    store.downloads.clear()
    assert sync.refresh() is not None  # (before: skipped, "v1 is not newer than v3")
    assert engine.version == 1 and _same(engine.loaded[-1][1], new[0])
    assert store.downloads == [(1, "model.safetensors")]  # a full pull, never a delta onto v3
    assert sync.run_id == "run-2" and sync.run_changes == 1 and not sync.engine_stale


def test_a_new_run_that_published_nothing_leaves_a_loaded_engine_marked_stale():
    store, engine = RunStore(), LoadingEngine()
    seen = []
    sync = WeightSync(lambda: store, "policy", engine, check_interval_s=0.0, background=False,
                      on_run=lambda run, where: seen.append((run, where)))
    _publish(store, ArtifactBuilder("policy"), [1, 2], seed=0)
    sync.refresh()
    store.new_run("run-2")
    assert sync.refresh() is None and engine.version == 2  # nothing of the new run to load
    assert sync.engine_stale and sync.new_run_unpublished
    assert seen == [("run-2", "weight check of policy")]
    # an engine that never loaded a published version still holds the initial model: v0
    fresh, other = RunStore(), LoadingEngine()
    idle = WeightSync(lambda: fresh, "policy", other, check_interval_s=0.0, background=False)
    idle.refresh()
    fresh.new_run("run-2")
    idle.refresh()
    assert idle.run_id == "run-2" and not idle.engine_stale and not idle.new_run_unpublished


# ----------------------------------------------------------------------------- the service


def _task(task_id, run):
    return Task(task_id=task_id, prompt="37+45=", n=2, model_ids=["policy"],
                metadata={"answer": "82", "run": run})


def _service(flow, engine, **overrides):
    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(temperature=0.8,
                                                                      max_tokens=4))
    settings = {"max_concurrency": 2, "poll_interval_s": 0.0, "progress_interval_s": 1e9,
                "weight_check_interval_s": 3600.0, **overrides}
    cfg = RaaSConfig(dataflow="mem://", engines={"policy": {"model_path": "unused"}}, workflow=wf,
                     model_ids=["policy"], **settings)
    out = io.StringIO()
    return RaaSService(cfg, client_factory=lambda: flow, engines={"policy": engine}, out=out), out


class RestartsBeforeAPush(RestartingDataflow):
    """Restarted on a fresh state while the next push is on its way (``then``: the new run's
    tasks and what it publishes)."""

    then = None

    def push_many(self, instance_id, items):
        if self.then is not None:
            (tasks, publish), self.then = self.then, None
            self.restart_fresh(tasks, "run-2")
            publish(self)
        return super().push_many(instance_id, items)


def _running_on_v3_of_run_1():
    flow = RestartsBeforeAPush([_task("train:0", "run-1"), _task("train:1", "run-1")])
    _publish(flow, ArtifactBuilder("policy", full_every=10), [1, 2, 3], seed=0)
    engine = ScriptedEngine(build_tokenizer(), ["82"], version=0)
    return flow, engine


def test_samples_of_the_old_run_never_reach_the_new_one_and_its_weights_are_loaded():
    flow, engine = _running_on_v3_of_run_1()
    svc, out = _service(flow, engine)
    svc.start()
    try:
        svc.syncs["policy"].refresh(force=True)
        assert engine.version == 3 and svc.run_cycle() == 2  # run 1 at v3: two tasks pushed
        # run 1 leases train:2; while its samples are pushed the dataflow restarts fresh, and the
        # new run (its own train:2, train:3) publishes v1
        flow.tasks = [_task("train:2", "run-1")]
        flow.then = ([_task("train:2", "run-2"), _task("train:3", "run-2")],
                     lambda f: _publish(f, ArtifactBuilder("policy"), [1], seed=1))
        assert svc.run_cycle() == 0  # (before: pushed again after the rejoin, into run 2)
        assert svc.run_id == "run-2" and svc.counters.cross_run_dropped == 1
        assert svc.run_cycle() == 2  # resynced in full to run 2's v1, then leased and pushed
    finally:
        svc.close()
    assert engine.version == 1 and engine.updates[-1] == (["a.weight", "b.bias"], 1)
    new_run = [(tid, s) for run, tid, samples in flow.accepted if run == "run-2" for s in samples]
    assert sorted({tid for tid, _ in new_run}) == ["train:2", "train:3"]
    assert all((s.versions[s.prompt_len:] == 1).all() for _, s in new_run)  # none made at v3
    text = out.getvalue()
    assert text.count("the dataflow's run changed (run-1 -> run-2") == 1
    assert "raas resynced to the dataflow's run run-2: policy=v1" in text
    assert svc.counters.run_changes == 1


def test_a_new_run_with_nothing_published_ends_a_raas_that_loaded_the_old_weights():
    flow, engine = _running_on_v3_of_run_1()
    svc, out = _service(flow, engine, max_cycles=3)
    svc.start()
    try:
        svc.syncs["policy"].refresh(force=True)
        flow.then = ([_task("train:0", "run-2")], lambda f: None)  # v0 only: the initial model
        assert svc.run_cycle() == 0
        code = svc.serve()  # (before: leased run 2's task and generated it with v3: exit 0)
    finally:
        svc.close()
    assert code == RUN_CHANGED_EXIT == 4
    assert [run for run, _, _ in flow.accepted] == []  # (the pushes came after the restart)
    assert flow.leased == ["train:0", "train:1"]  # nothing leased in run 2
    text = out.getvalue()
    assert "raas exiting 4: the dataflow's run run-2 has published no version of ['policy']" in text
    assert flow.deregistered  # it left run 2's pool before exiting


# ----------------------------------------------------------------------------- taken over


def test_a_lease_refused_for_a_taken_over_instance_id_ends_the_raas_at_once():
    flow = TakeoverDataflow([_task("train:0", "run-1")])
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]),
                        dataflow_give_up_s=0.5)
    svc.start()
    flow.taken_over = True  # another process registered our instance id
    try:
        code = svc.serve()  # (before: a lease every poll until dataflow_give_up_s, then exit 1)
    finally:
        svc.close()
    assert code == TAKEN_OVER_EXIT == 3
    assert flow.refused == ["lease"]  # no retry, no return, no deregistration as that id
    assert f"raas: instance {svc.instance_id} was taken over" in out.getvalue()


def test_a_heartbeat_refused_for_a_taken_over_instance_id_stops_the_raas():
    flow = TakeoverDataflow()
    svc, out = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.start()
    try:
        flow.taken_over = True
        assert svc.heartbeat_once() is None
        assert svc.taken_over and svc.stop_event.is_set()  # (before: a warning, then on again)
        assert "was taken over: the dataflow refused this process's instance secret on a " \
               "heartbeat" in out.getvalue()
    finally:
        svc.close()


def test_a_secret_refused_across_our_own_rejoin_is_not_a_takeover():
    flow = TakeoverDataflow()
    svc, _ = _service(flow, ScriptedEngine(build_tokenizer(), ["82"]))
    svc.start()
    try:
        refused = DataflowError(403, "wrong secret", "instance_secret")
        # the call went out before a registration of ours issued a new secret
        assert not svc.check_taken_over(refused, svc._registrations - 1, "a push")
        assert not svc.taken_over and not svc.stop_event.is_set()
        assert svc.check_taken_over(refused, svc._registrations, "a push")
    finally:
        svc.close()
