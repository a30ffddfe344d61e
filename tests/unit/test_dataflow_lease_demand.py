"""Lease sizing by demand: the dataflow creates no more train tasks than its trainers consume
before the samples would go stale (``lease_demand_versions``, default ``max_staleness + 1``
versions of the measured consumption), on top of ``max_inflight_tasks`` / ``max_buffered_samples``.
The core runs in process on a real SQLite file."""

from __future__ import annotations


import pytest

from astralight.dataflow import demand
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from tests.unit.dataflow_fakes import publish, samples

GROUP = 8
#: the toy recipe's caps; a small-batch trainer pulling 2 tasks' worth per version
TOY_CAPS = dict(group_size=GROUP, max_staleness=1, max_inflight_tasks=32, max_buffered_samples=512,
                lease_demand_versions=None)  # opted in: max_staleness + 1 versions
SMALL_BATCH = 2 * GROUP


def make(tmp_path, name="state", **kw) -> Dataflow:
    return Dataflow(DataflowConfig(state_dir=str(tmp_path / name), **{**TOY_CAPS, **kw}))


def mixed_rewards(i: int) -> list[int]:
    """A group whose rewards differ (kept by every filter)."""
    return [(i + k) % 2 for k in range(GROUP)]


def train_versions(flow: Dataflow, iid: str, versions: int, batch: int) -> None:
    """``versions`` rounds of: lease and push one batch's tasks, the trainer pulls and acks it,
    then publishes the next version."""
    for _ in range(versions):
        version = flow.versions["policy"]
        for i, task in enumerate(flow.lease(iid, batch // GROUP)):
            flow.push(iid, task.task_id, samples(task, mixed_rewards(i), version))
        served = flow.pull("policy", batch, "trainer")
        assert served is not None and len(served.samples) == batch
        flow.ack(served.batch_id)
        publish(flow, version + 1)


# ---------------------------------------------------------------------- the pure functions


def counted(batches: int, per_batch: int = 16) -> dict:
    return {"batches_served": batches, "samples_served": batches * per_batch}


def test_consumption_is_whole_batches_per_completed_version():
    # one batch per version, but one pulled before the dataflow recorded version 1 (counted at
    # version 0) and one before it recorded version 3: 2, 0, 2, 0 -- still one batch a version
    bunched = {0: counted(2), 1: {}, 2: counted(2), 3: {}, 4: counted(99)}
    assert demand.measured_per_version(bunched, current=4) == 16.0  # version 4 is not complete
    # at the window's edge the early pull of the next version is missing: 3 batches in 4 versions
    assert demand.measured_per_version({1: counted(1), 2: counted(1), 3: counted(1), 4: {}},
                                       current=5) == 16.0  # a plain mean: 12
    # four ranks x every_n_steps 2 = 8 batches per version; replay: 10 fresh samples per batch
    assert demand.measured_per_version({v: counted(8, 10) for v in range(4)}, current=4) == 80.0
    assert demand.measured_per_version({}, current=0) is None  # nothing completed
    assert demand.measured_per_version({1: {}}, current=2) is None  # nothing served to go by


def test_accept_fraction_and_the_cap_floor():
    counters = {3: {"rollouts_generated": 40, "samples_accepted": 10},
                4: {"rollouts_generated": 40, "samples_accepted": 30, "samples_served": 16}}
    assert demand.accept_fraction(counters, current=4) == 0.5
    assert demand.accept_fraction({}, current=4) == 1.0
    d = demand.policy_demand({3: counted(4, 5)}, current=4, versions=2, configured=None,
                             largest_pull=0)
    assert (d.per_version, d.source, d.cap) == (5.0, "measured", 10.0)
    # never below the largest batch pulled, or that batch could never be filled
    floored = demand.policy_demand({3: counted(4, 5)}, current=4, versions=2, configured=None,
                                   largest_pull=16)
    assert floored.cap == 16.0
    assert demand.policy_demand({}, 0, 2, configured=24, largest_pull=0).cap == 48.0
    assert demand.policy_demand({}, 0, 2, configured=None, largest_pull=16).cap is None
    assert demand.policy_demand({3: counted(4, 5)}, 4, 0, None, 16).cap is None  # off


# ---------------------------------------------------------------------- the lease route


def test_a_small_batch_trainer_gets_only_what_it_consumes_before_staleness(tmp_path):
    flow = make(tmp_path)
    iid = flow.register(["policy"], 64, None, {})["instance_id"]
    train_versions(flow, iid, 2, SMALL_BATCH)
    d = flow.lease_demand()["policy"]
    assert (d.per_version, d.source, d.cap) == (SMALL_BATCH, "measured", 2 * SMALL_BATCH)

    # the RaaS asks for all its free slots; max_inflight_tasks alone granted 32 tasks (256
    # samples, 16 versions of this trainer's consumption: most would have gone stale)
    tasks = flow.lease(iid, 32)
    assert len(tasks) == (1 + 1) * SMALL_BATCH // GROUP == 4
    assert flow.lease(iid, 32) == []  # in flight = the cap
    version = flow.versions["policy"]
    for i, task in enumerate(tasks[:2]):  # one batch arrives: queued + in flight still the cap
        flow.push(iid, task.task_id, samples(task, mixed_rewards(i), version))
    assert flow.lease(iid, 32) == []
    batch = flow.pull("policy", SMALL_BATCH, "trainer")  # the trainer takes it: room for 2 tasks
    assert len(flow.lease(iid, 32)) == 2
    assert flow.stats()["models"]["policy"]["lease_demand"]["cap"] == 2 * SMALL_BATCH
    flow.ack(batch.batch_id)
    flow.close()


def test_lease_demand_versions_zero_is_the_old_behaviour(tmp_path):
    flow = make(tmp_path, lease_demand_versions=0)
    iid = flow.register(["policy"], 64, None, {})["instance_id"]
    train_versions(flow, iid, 2, SMALL_BATCH)
    assert flow.lease_demand()["policy"].cap is None
    assert len(flow.lease(iid, 64)) == 32  # max_inflight_tasks
    flow.close()


def test_explicit_caps_tighter_than_the_demand_are_unchanged(tmp_path):
    """The toy recipe (batch 256 = 32 tasks, max_staleness 1, max_inflight_tasks 32,
    max_buffered_samples 512) leases exactly what it leased without the demand cap."""
    granted = []
    for name, extra in (("demand", {}), ("off", {"lease_demand_versions": 0})):
        flow = make(tmp_path, name, **extra)
        iid = flow.register(["policy"], 64, None, {})["instance_id"]
        train_versions(flow, iid, 1, 256)
        assert flow.lease_demand()["policy"].cap == (512 if not extra else None)
        granted.append(len(flow.lease(iid, 64)))
        flow.close()
    assert granted == [32, 32]


def test_the_configured_demand_sizes_the_first_version(tmp_path):
    flow = make(tmp_path, trainer_samples_per_version={"policy": SMALL_BATCH})
    iid = flow.register(["policy"], 64, None, {})["instance_id"]
    assert flow.lease_demand()["policy"].source == "configured"
    assert len(flow.lease(iid, 32)) == 4  # 2 versions x 16 samples / 8 per task
    flow.close()
    unknown = make(tmp_path, "unknown")  # nothing configured or measured: the explicit caps only
    iid = unknown.register(["policy"], 64, None, {})["instance_id"]
    assert unknown.lease_demand()["policy"].source == "unknown"
    assert len(unknown.lease(iid, 64)) == 32
    unknown.close()


def test_filtered_groups_count_at_their_acceptance(tmp_path):
    """With dynamic sampling dropping half the groups an open task delivers half a group, so
    twice as many tasks may be in flight for the same demand."""
    flow = make(tmp_path, sample_filters=["zero_advantage"])
    iid = flow.register(["policy"], 64, None, {})["instance_id"]
    for _ in range(2):
        version = flow.versions["policy"]
        tasks = flow.lease(iid, 2 * SMALL_BATCH // GROUP)
        for i, task in enumerate(tasks):  # every second group all-correct: filtered
            rewards = [1] * GROUP if i % 2 else mixed_rewards(i)
            flow.push(iid, task.task_id, samples(task, rewards, version))
        batch = flow.pull("policy", SMALL_BATCH, "trainer")
        flow.ack(batch.batch_id)
        publish(flow, version + 1)
    d = flow.lease_demand()["policy"]
    assert (d.accept_fraction, d.cap) == (0.5, 2 * SMALL_BATCH)
    assert len(flow.lease(iid, 32)) == 8  # 8 tasks x 8 samples x 0.5 = the cap of 32
    flow.close()


@pytest.mark.parametrize("value", [0.5, -1, float("inf")])
def test_bad_lease_demand_versions_names_the_field(value):
    with pytest.raises(ValueError, match=r"lease_demand_versions: must be null"):
        DataflowConfig(lease_demand_versions=value)


def test_bad_trainer_samples_per_version_names_the_field():
    with pytest.raises(ValueError, match=r"trainer_samples_per_version: 'solver' is not one of"):
        DataflowConfig(trainer_samples_per_version={"solver": 16})
    with pytest.raises(ValueError, match=r"trainer_samples_per_version\.policy: must be a pos"):
        DataflowConfig(trainer_samples_per_version={"policy": 0})
    assert DataflowConfig(max_staleness=3, lease_demand_versions=None).demand_versions() == 4.0
    assert DataflowConfig(max_staleness=3).demand_versions() == 0.0  # off by default
