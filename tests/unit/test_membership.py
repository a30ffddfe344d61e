"""Pool membership: statuses, lease allowances and the instance table (pure functions), then the
dataflow core on a real SQLite file with injected clocks: failures from expired leases and
returned tasks, probes, slow instances, drain / deregister / rejoin, eval time, wall time and an
old state folder opening after the migration."""

from __future__ import annotations

import sqlite3
import time

import pytest

from astralight.dataflow import membership as mb
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from tests.unit.dataflow_fakes import publish, samples

EVAL_SOURCE = {"class_path": "astralight.tasks.arithmetic.ArithmeticSource",
               "init_args": {"split": "eval", "eval_size": 2}}


# ----------------------------------------------------------------------------- pure functions


def test_status_from_state_missed_heartbeats_and_failed_tasks():
    st = lambda state="active", idle=0.0, fails=0: mb.status(state, idle, fails, 10.0, 3)  # noqa: E731
    assert st() == "healthy" and st(idle=5.0) == "healthy"  # a heartbeat every third of a lease
    assert st(idle=5.01) == "suspect" and st(idle=10.0) == "suspect"
    assert st(idle=10.01) == "gone"
    assert st(fails=2) == "healthy" and st(fails=3) == "suspect"
    assert st(idle=11.0, fails=5) == "gone"
    assert st("draining", idle=100.0) == "draining" and st("left", fails=9) == "left"
    assert mb.is_live("draining", 9.0, 10.0) and not mb.is_live("draining", 11.0, 10.0)
    assert not mb.is_live("left", 0.0, 10.0) and not mb.is_live("active", 10.5, 10.0)


def test_lease_allowance_capacity_draining_probe_and_slow():
    allow = mb.lease_allowance
    assert allow(8, capacity=4, held=0) == 4  # never more held than capacity
    assert allow(8, capacity=4, held=3) == 1 and allow(2, capacity=4, held=0) == 2
    assert allow(8, capacity=4, held=6) == 0  # over capacity (capacity lowered): nothing
    assert allow(8, capacity=4, held=0, state="draining") == 0
    assert allow(8, capacity=4, held=0, state="left") == 0
    # failing: one probe at a time
    assert allow(8, capacity=4, held=0, fail_streak=3) == 1
    assert allow(8, capacity=4, held=1, fail_streak=3) == 0
    assert allow(8, capacity=4, held=0, fail_streak=2) == 4
    assert allow(8, capacity=4, held=0, fail_streak=1, suspect_failures=1) == 1
    # slow: more than slow_factor x the pool median, with enough timed tasks
    assert allow(8, capacity=8, held=0, mean_s=4.0, tasks_timed=3, median_s=1.0) == 2  # ceil(8/4)
    assert allow(8, capacity=8, held=1, mean_s=4.0, tasks_timed=3, median_s=1.0) == 1
    assert allow(8, capacity=8, held=0, mean_s=100.0, tasks_timed=5, median_s=1.0) == 1  # max(1,.)
    assert allow(8, capacity=8, held=0, mean_s=2.9, tasks_timed=3, median_s=1.0) == 8
    assert allow(8, capacity=8, held=0, mean_s=9.0, tasks_timed=2, median_s=1.0) == 8  # too few
    assert allow(8, capacity=8, held=0, mean_s=4.0, tasks_timed=3, median_s=1.0,
                 slow_factor=5.0) == 8


def test_pool_median_counts_only_instances_with_enough_timed_tasks():
    assert mb.pool_median([(1.0, 3), (2.0, 5), (30.0, 3), (99.0, 2), (None, 0)]) == 2.0
    assert mb.pool_median([(5.0, 1)]) is None
    assert mb.slow_ratio(6.0, 3, 2.0) == 3.0 and mb.slow_ratio(6.0, 2, 2.0) is None
    assert mb.mean_task_s(6.0, 4) == 1.5 and mb.mean_task_s(0.0, 0) is None


def _row(iid, **kw):
    row = {"instance_id": iid, "model_ids": '["policy"]', "capacity": 4, "capacity_units": 1.0,
           "state": "active", "registered_at": 100.0, "left_at": None, "last_seen": 150.0,
           "alive_prior_s": 0.0, "reported_in_flight": None, "tasks_leased": 0, "tasks_done": 0,
           "tasks_failed": 0, "tasks_returned": 0, "fail_streak": 0, "busy_s": 0.0,
           "tasks_timed": 0, "samples_pushed": 0}
    row.update(kw)
    return row


def test_instance_table_rows():
    rows = [_row("a", samples_pushed=300, busy_s=12.0, tasks_timed=4, tasks_done=5),
            _row("b", samples_pushed=100, state="left", left_at=120.0, alive_prior_s=30.0,
                 capacity_units=2.0)]
    a, b = mb.instance_table(rows, now=156.0, held={"a": 2}, lease_seconds=10.0)
    assert a["model_ids"] == ["policy"] and a["status"] == "suspect" and a["live"]
    assert (a["alive_s"], a["samples_per_s"], a["in_flight"]) == (50.0, 6.0, 2)
    assert (a["mean_task_s"], a["throughput_share"]) == (3.0, 0.75)
    assert (b["status"], b["live"], b["in_flight"], b["capacity_units"]) == ("left", False, 0, 2.0)
    assert b["alive_s"] == 50.0 and b["samples_per_s"] == 2.0  # 30 earlier + 20 until it left
    assert b["mean_task_s"] is None and b["throughput_share"] == 0.25


# ----------------------------------------------------------------------------- the core


def make(tmp_path, **kw) -> Dataflow:
    kw.setdefault("lease_seconds", 10.0)
    return Dataflow(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2, **kw))


def table(flow: Dataflow, now: float) -> dict[str, dict]:
    return {r["instance_id"]: r for r in flow.stats(now=now)["instances"]}


def test_expired_leases_count_against_the_holder_and_a_failing_instance_gets_probes(tmp_path):
    flow = make(tmp_path)
    t0 = time.time()
    a = flow.register(["policy"], 4, "a", {}, now=t0)["instance_id"]
    b = flow.register(["policy"], 8, "b", {}, now=t0)["instance_id"]
    first = flow.lease(a, 3, now=t0)
    fourth = flow.lease(a, 3, now=t0)
    assert (len(first), len(fourth)) == (3, 1)  # capacity 4, 3 held
    assert table(flow, t0)["a"]["in_flight"] == 4
    # a is silent: after its deadline b gets the same tasks, each a failure of a
    again = flow.lease(b, 4, now=t0 + 11)
    assert [t.task_id for t in again] == [t.task_id for t in first + fourth]
    rows = table(flow, t0 + 11)
    assert (rows["a"]["tasks_failed"], rows["a"]["fail_streak"], rows["a"]["status"]) == \
        (4, 4, "gone")
    assert (rows["a"]["in_flight"], rows["b"]["in_flight"], rows["b"]["tasks_failed"]) == (0, 4, 0)
    assert flow.stats(now=t0 + 11)["models"]["policy"]["tasks_reissued"] == 4
    # a comes back: healthy again by heartbeat, still suspect by its failures, one probe only
    flow.heartbeat(a, now=t0 + 12)
    assert table(flow, t0 + 12)["a"]["status"] == "suspect"
    [probe] = flow.lease(a, 4, now=t0 + 12)
    assert flow.lease(a, 4, now=t0 + 12) == []  # the probe is out
    flow.push(a, probe.task_id, samples(probe, [1, 0]), now=t0 + 13)
    rows = table(flow, t0 + 13)
    assert (rows["a"]["status"], rows["a"]["fail_streak"], rows["a"]["tasks_done"]) == \
        ("healthy", 0, 1)
    assert rows["a"]["mean_task_s"] == pytest.approx(1.0, abs=1e-3)  # lease at +12, push at +13
    assert len(flow.lease(a, 8, now=t0 + 13)) == 4  # a success lifts the throttle
    flow.close()


def test_returned_tasks_are_leasable_at_once_and_only_failed_ones_count_as_failures(tmp_path):
    flow = make(tmp_path)
    t0 = time.time()
    a = flow.register(["policy"], 4, "a", {}, now=t0)["instance_id"]
    b = flow.register(["policy"], 4, "b", {}, now=t0)["instance_id"]
    t1, t2, t3 = flow.lease(a, 3, now=t0)
    [tb] = flow.lease(b, 1, now=t0)
    # someone else's task, a done one and an unknown id are ignored
    flow.push(a, t3.task_id, samples(t3, [1, 0]), now=t0 + 1)
    reply = flow.return_tasks(a, [t1.task_id, tb.task_id, t3.task_id, "nope", t1.task_id],
                              now=t0 + 1)
    assert reply == {"returned": 1}
    assert flow.return_tasks(a, [t2.task_id], failed=True, now=t0 + 1) == {"returned": 1}
    rows = table(flow, t0 + 1)
    assert (rows["a"]["tasks_returned"], rows["a"]["tasks_failed"], rows["a"]["fail_streak"]) == \
        (2, 1, 1)
    assert (rows["a"]["in_flight"], rows["b"]["in_flight"]) == (0, 1)
    # long before the lease deadline, b gets both back; the re-issue blames nobody
    got = flow.lease(b, 3, now=t0 + 2)
    assert [t.task_id for t in got] == [t1.task_id, t2.task_id, got[2].task_id]
    rows = table(flow, t0 + 2)
    assert (rows["a"]["tasks_failed"], rows["b"]["tasks_failed"]) == (1, 0)
    counters = flow.stats(now=t0 + 2)["models"]["policy"]
    assert (counters["tasks_returned"], counters["tasks_reissued"]) == (2, 2)
    with pytest.raises(ServiceError) as err:
        flow.return_tasks("ghost", [t1.task_id])
    assert err.value.status == 404 and err.value.field == "instance_id"
    flow.close()


def test_a_slow_instance_holds_fewer_tasks(tmp_path):
    flow = make(tmp_path, lease_seconds=100.0, max_inflight_tasks=64)
    t0 = time.time()
    for iid in ("fast1", "fast2", "slow"):
        flow.register(["policy"], 4, iid, {}, now=t0)
    for iid, took in (("fast1", 1.0), ("fast2", 1.5), ("slow", 8.0)):
        now = t0
        for _ in range(3):
            [t] = flow.lease(iid, 1, now=now)
            now += took
            flow.push(iid, t.task_id, samples(t, [1, 0]), now=now)
    rows = table(flow, t0 + 25)
    assert (rows["slow"]["mean_task_s"], rows["fast2"]["mean_task_s"]) == (8.0, 1.5)
    # median 1.5 s: slow is 5.3x slower (> 3): at most ceil(4 / 5.33) = 1 task held
    assert len(flow.lease("slow", 4, now=t0 + 25)) == 1
    assert flow.lease("slow", 4, now=t0 + 25) == []
    assert len(flow.lease("fast1", 4, now=t0 + 25)) == 4
    flow.close()


def test_drain_deregister_and_rejoin_keep_the_counters(tmp_path):
    flow = make(tmp_path)
    t0 = time.time()
    a = flow.register(["policy"], 4, "a", {}, capacity_units=2.0, now=t0)["instance_id"]
    b = flow.register(["policy"], 4, "b", {}, now=t0)["instance_id"]
    t1, t2 = flow.lease(a, 2, now=t0)
    assert flow.heartbeat(a, in_flight=2, now=t0)["drain"] is False
    assert flow.drain(a, now=t0 + 1) == {"instance_id": "a", "state": "draining", "in_flight": 2}
    assert flow.lease(a, 4, now=t0 + 1) == []  # no new task while draining
    assert flow.heartbeat(a, in_flight=2, now=t0 + 1)["drain"] is True
    rows = table(flow, t0 + 1)
    assert (rows["a"]["status"], rows["a"]["live"], rows["a"]["reported_in_flight"]) == \
        ("draining", True, 2)
    flow.push(a, t1.task_id, samples(t1, [1, 0]), now=t0 + 2)  # finishes what it runs ...
    assert flow.deregister(a, now=t0 + 3) == {"returned": 1}  # ... and returns the rest
    assert [t.task_id for t in flow.lease(b, 1, now=t0 + 3)] == [t2.task_id]
    assert flow.drain(a, now=t0 + 4)["state"] == "left"  # a drain does not revive it
    assert flow.heartbeat(a, now=t0 + 4)["drain"] is True
    report = flow.balance("policy", window=1, now=t0 + 4)
    assert (report["live_instances"], report["decision"]["pool"], report["capacity_units"]) == \
        (1, 1, 1.0)
    rows = table(flow, t0 + 4)
    assert (rows["a"]["status"], rows["a"]["left_at"], rows["a"]["alive_s"]) == ("left", t0 + 3, 3.0)
    # an hour later it registers again: active, counters kept, the gap not counted as alive
    flow.register(["policy"], 4, "a", {}, capacity_units=2.0, now=t0 + 3600)
    rows = table(flow, t0 + 3601)
    assert (rows["a"]["state"], rows["a"]["status"], rows["a"]["left_at"]) == ("active", "healthy",
                                                                               None)
    assert (rows["a"]["tasks_done"], rows["a"]["tasks_returned"], rows["a"]["samples_pushed"]) == \
        (1, 1, 2)
    assert rows["a"]["alive_s"] == pytest.approx(3.0)  # 3 s before it left + 0 s since
    assert flow.heartbeat(a, now=t0 + 3601)["drain"] is False
    assert len(flow.lease(a, 4, now=t0 + 3601)) == 4
    report = flow.balance("policy", window=1, now=t0 + 3601)
    assert report["capacity_units"] == 2.0  # b went silent an hour ago: gone
    with pytest.raises(ServiceError) as err:
        flow.register(["policy"], 4, "c", {}, capacity_units=0.0)
    assert err.value.field == "capacity_units"
    with pytest.raises(ServiceError) as err:
        flow.heartbeat(a, in_flight=-1)
    assert err.value.field == "in_flight"
    flow.close()


def test_eval_time_and_wall_time_in_the_balance_report_survive_a_restart(tmp_path):
    flow = make(tmp_path, eval={"source": EVAL_SOURCE, "every": 1, "k": 2})
    t0 = time.time() - 100  # the tasks ran in the past; the version is published now
    a = flow.register(["policy"], 8, "a", {}, capacity_units=4.0, now=t0)["instance_id"]
    e1, e2, tr = flow.lease(a, 3, now=t0)
    assert (e1.kind, e2.kind, tr.kind) == ("eval", "eval", "train")
    flow.push(a, e1.task_id, samples(e1, [1, 0]), now=t0 + 2.5)
    flow.push(a, e2.task_id, samples(e2, [1, 1]), now=t0 + 0.5)
    flow.push(a, tr.task_id, samples(tr, [1, 0]), now=t0 + 9.0)  # train time is not eval time
    assert flow.version_counters("policy")[0]["eval_task_ms"] == 3000
    publish(flow, 1)
    published = flow.store.version_times("policy")[1]
    flow.heartbeat(a, now=published)
    report = flow.balance("policy", window=1, now=published + 1)
    assert report["versions"] == [0, 0] and report["eval_s"] == 3.0
    wall = published - flow.started_at
    assert report["wall_s"] == pytest.approx(wall, abs=1e-3)  # start -> publication of v1
    assert report["produced"] == 2 and report["capacity_units"] == 4.0
    assert report["rates"]["produced"] == pytest.approx(2 / wall, rel=1e-2)
    assert report["throughput_per_capacity_unit"] == pytest.approx(2 / wall / 4.0, rel=1e-2)
    started = flow.started_at
    flow.close()
    flow = make(tmp_path, eval={"source": EVAL_SOURCE, "every": 1, "k": 2})
    assert flow.started_at == started
    again = flow.balance("policy", window=1, now=published + 200)
    assert (again["wall_s"], again["eval_s"]) == (report["wall_s"], 3.0)
    flow.close()


OLD_SCHEMA = """
CREATE TABLE instances (
    instance_id TEXT PRIMARY KEY, model_ids TEXT NOT NULL, capacity INTEGER NOT NULL,
    meta TEXT NOT NULL, registered_at REAL NOT NULL, last_seen REAL NOT NULL,
    tasks_leased INTEGER NOT NULL DEFAULT 0, samples_pushed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE tasks (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, task_id TEXT NOT NULL UNIQUE, kind TEXT NOT NULL,
    model_ids TEXT NOT NULL, target_model TEXT, eval_version INTEGER, prompt_index INTEGER,
    payload BLOB NOT NULL, state TEXT NOT NULL, instance_id TEXT, deadline REAL,
    lease_count INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL, done_at REAL);
CREATE TABLE versions (
    model_id TEXT NOT NULL, version INTEGER NOT NULL, manifest BLOB NOT NULL,
    published_at REAL NOT NULL, PRIMARY KEY(model_id, version));
"""


def test_a_state_folder_from_before_membership_opens_and_keeps_its_instances(tmp_path):
    (tmp_path / "state").mkdir()
    conn = sqlite3.connect(str(tmp_path / "state" / "dataflow.db"))
    conn.executescript(OLD_SCHEMA)
    now = time.time()
    conn.execute("INSERT INTO instances VALUES('old', '[\"policy\"]', 2, '{}', ?, ?, 7, 40)",
                 (now - 50, now - 1))
    conn.commit()
    conn.close()
    flow = make(tmp_path)
    old = table(flow, now)["old"]
    assert (old["state"], old["capacity_units"], old["tasks_leased"], old["samples_pushed"]) == \
        ("active", 1.0, 7, 40)
    assert old["alive_s"] == pytest.approx(49.0) and old["status"] == "healthy"
    flow.register(["policy"], 2, "old", {}, now=now)
    [t] = flow.lease("old", 1, now=now)
    flow.push("old", t.task_id, samples(t, [1, 0]), now=now + 2)
    old = table(flow, now + 2)["old"]
    assert (old["tasks_done"], old["samples_pushed"], old["mean_task_s"]) == (1, 42, 2.0)
    flow.close()


def test_heartbeat_stats_reach_the_instance_table_and_the_balance_report(tmp_path):
    flow = make(tmp_path)
    t0 = time.time()
    a = flow.register(["policy"], 4, "a", {}, now=t0)["instance_id"]
    b = flow.register(["policy"], 4, "b", {}, now=t0)["instance_id"]
    flow.heartbeat(a, in_flight=1, now=t0 + 1, stats={"weight_pause_s": 0.25, "weight_updates": 3})
    flow.heartbeat(b, now=t0 + 1, stats={"weight_pause_s": 0.5})
    rows = table(flow, t0 + 2)
    assert rows[a]["reported"] == {"weight_pause_s": 0.25, "weight_updates": 3}
    assert flow.balance("policy", now=t0 + 2)["weight_pause_s"] == 0.75
    flow.heartbeat(a, now=t0 + 3)  # no stats: the last report stands
    assert table(flow, t0 + 3)[a]["reported"]["weight_pause_s"] == 0.25


def test_a_registration_naming_another_workflow_is_refused_with_both_names_and_the_key():
    mb.check_workflow({"workflow": "single_turn"}, "single_turn")  # the same: fine
    mb.check_workflow({}, "single_turn")  # an older RaaS or a client of one's own: not checked
    mb.check_workflow({"workflow": ""}, "single_turn")  # a workflow that runs any task
    with pytest.raises(ServiceError) as info:
        mb.check_workflow({"workflow": "my_task"}, "single_turn")
    err = info.value
    assert err.status == 409 and err.field == "workflow"
    assert "'my_task'" in err.message and "'single_turn'" in err.message
    assert "`workflow: my_task`" in err.message  # the fix, spelled as the setting
