"""astralight.dataflow.audit on states built through the real dataflow core (in process, real
SQLite): a balanced state with every task class, then hand-broken ones (a sample row deleted, a
task done without samples, a batch acked twice over, samples stranded in an acked batch) and the
real late-ack-after-requeue paths: samples served again are trained twice (counted by the
service, so the audit's ledgers agree), samples still queued are taken back."""

from __future__ import annotations

import json
import sqlite3

import pytest

from astralight.dataflow.audit import audit, main
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from tests.unit.dataflow_fakes import publish
from tests.unit.dataflow_fakes import samples as _samples


def samples(task, rewards, version=0):
    return _samples(task, rewards, version, token_ids=(5, 6, 7))


GROUP = 2


def make(tmp_path, **kw) -> Dataflow:
    return Dataflow(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=GROUP,
                                   max_staleness=0, sample_filters=["zero_advantage"], **kw))


def db(tmp_path):
    return tmp_path / "state" / "dataflow.db"


@pytest.fixture
def every_class(tmp_path):
    """A closed state holding each task class once or more:

    t0, t1 trained (acked batch), t2 in an unacked batch, t3 filtered (equal rewards), t4 stale
    (queued at version 0, then version 1 published with max_staleness 0), t5 queued (pushed at
    version 1), t6 leased and never pushed, t7 handed back (pending again)."""
    flow = make(tmp_path)
    iid = flow.register(["policy"], capacity=16, instance_id="raas-a", meta={})["instance_id"]
    tasks = flow.lease(iid, 6)
    for t in tasks[:3]:
        assert flow.push(iid, t.task_id, samples(t, [0, 1]))["accepted"] == GROUP
    assert flow.push(iid, tasks[3].task_id, samples(tasks[3], [1, 1]))["filtered"] == GROUP
    b1 = flow.pull("policy", 2 * GROUP)
    flow.ack(b1.batch_id)
    assert flow.pull("policy", GROUP) is not None  # t2's samples: served, never acked
    assert flow.push(iid, tasks[4].task_id, samples(tasks[4], [0, 1]))["accepted"] == GROUP
    publish(flow, 1)  # t4's queued samples are now stale (max_staleness 0)
    pushed = flow.push(iid, tasks[5].task_id, samples(tasks[5], [0, 1], version=1))
    assert pushed["accepted"] == GROUP
    more = flow.lease(iid, 2)
    flow.return_tasks(iid, [more[1].task_id])
    flow.close()
    return tmp_path


def test_balanced_state_accounts_for_every_task_once(every_class):
    r = audit(db(every_class))
    assert r["balanced"], r
    assert r["tasks_total"] == 8 and r["tasks_issued"] == 8
    assert r["tasks"] == {"trained": 2, "filtered": 1, "stale": 1, "pending": 4, "lost": 0}
    assert r["tasks_pending"] == {"unleased": 1, "leased": 1, "queued": 1, "in_batch": 1}
    assert sum(r["tasks"].values()) == r["tasks_total"]
    assert r["samples_accepted"] == 5 * GROUP
    assert r["samples_trained"] == 2 * GROUP
    assert r["samples_filtered"] == GROUP and r["samples_stale"] == GROUP
    assert r["samples_pending"] == 2 * GROUP
    assert r["samples_lost"] == 0 and r["duplicates_trained"] == 0 and r["mismatches"] == []
    assert r["batches"] == {"acked": 1, "served": 1}


def test_audit_reads_a_live_state_and_never_writes_it(tmp_path):
    flow = make(tmp_path)
    iid = flow.register(["policy"], capacity=4, instance_id="raas-a", meta={})["instance_id"]
    task = flow.lease(iid, 1)[0]
    flow.push(iid, task.task_id, samples(task, [0, 1]))
    with flow.lock:  # the service holds its connection open, data still in the WAL
        before = flow.store.conn.execute("SELECT COUNT(*), MAX(id) FROM samples").fetchone()
        r = audit(tmp_path / "state")  # a state_dir works as well as its dataflow.db
        after = flow.store.conn.execute("SELECT COUNT(*), MAX(id) FROM samples").fetchone()
    assert r["balanced"] and r["tasks_pending"]["queued"] == 1 and r["samples_accepted"] == GROUP
    assert tuple(before) == tuple(after)
    flow.close()
    data = db(tmp_path).read_bytes()
    audit(db(tmp_path))
    assert db(tmp_path).read_bytes() == data
    with pytest.raises(FileNotFoundError, match="db_path"):
        audit(tmp_path / "nowhere")


def _edit(tmp_path, sql: str, *args) -> None:
    conn = sqlite3.connect(db(tmp_path))
    conn.execute(sql, args)
    conn.commit()
    conn.close()


def test_a_deleted_sample_row_is_lost(every_class):
    _edit(every_class, "DELETE FROM samples WHERE id = (SELECT MIN(id) FROM samples"
                       " WHERE state='acked')")
    r = audit(db(every_class))
    assert not r["balanced"]
    assert r["samples_lost"] == 1 and r["samples_lost_by_model"] == {"policy": 1}
    assert any("rollouts_generated" in m for m in r["mismatches"]), r["mismatches"]
    assert any("samples_acked" in m for m in r["mismatches"]), r["mismatches"]


def test_a_task_done_without_samples_is_a_lost_task(every_class):
    _edit(every_class, "UPDATE tasks SET state='done' WHERE state='leased'")
    r = audit(db(every_class))
    assert not r["balanced"]
    assert r["tasks"]["lost"] == 1 and len(r["tasks_lost_ids"]) == 1
    assert r["samples_lost"] == GROUP  # the task's n, since no counter saw its samples


def test_samples_left_served_in_an_acked_batch_are_stranded(every_class):
    _edit(every_class, "UPDATE batches SET state='acked' WHERE state='served'")
    r = audit(db(every_class))
    assert r["samples_stranded"] == GROUP and r["samples_lost"] == GROUP and not r["balanced"]


def test_an_acked_batch_without_its_samples_is_a_duplicate(every_class):
    # a second acked batch claiming two samples it does not hold: trained twice over
    _edit(every_class, "INSERT INTO batches(batch_id, model_id, trainer_id, policy_version, n,"
                       " state, served_at, acked_at) VALUES('forged', 'policy', 't', 0, 2,"
                       " 'acked', 0, 0)")
    r = audit(db(every_class))
    assert r["duplicates_trained"] == 2 and not r["balanced"]


def test_late_ack_of_a_requeued_and_reserved_batch_trains_samples_twice(tmp_path):
    """The one real path to a duplicate: a batch neither acked nor extended within
    batch_ack_timeout_s is re-queued and served again; if the first trainer then acks it late
    (with the keep-alive, only a trainer frozen longer than the timeout does), its samples were
    trained twice. The service cannot un-train them: the ack says so and counts them, and the
    audit reports the duplicates, all of them counted (no mismatch), and is not balanced."""
    flow = make(tmp_path)
    iid = flow.register(["policy"], capacity=4, instance_id="raas-a", meta={})["instance_id"]
    task = flow.lease(iid, 1)[0]
    flow.push(iid, task.task_id, samples(task, [0, 1]))
    first = flow.pull("policy", GROUP)
    flow.requeue_expired_batches(now=1e12)  # the ack timeout passed
    second = flow.pull("policy", GROUP)
    assert {s.sample_index for s in second.samples} == {s.sample_index for s in first.samples}
    flow.ack(second.batch_id)
    r = audit(db(tmp_path))
    assert r["balanced"] and r["duplicates_trained"] == 0 and r["samples_trained"] == GROUP
    answer = flow.ack(first.batch_id)  # late: the trainer did train it
    assert answer["late"] and answer["trained_twice"] == GROUP and answer["taken_back"] == 0
    assert "trained twice" in answer["warning"] and first.batch_id in answer["warning"]
    c = flow.stats()["models"]["policy"]
    assert (c["late_acks"], c["late_acks_after_reserve"], c["samples_trained_twice"]) == (1, 1, GROUP)
    flow.close()
    r = audit(db(tmp_path))
    assert r["duplicates_trained"] == GROUP and not r["balanced"]
    assert r["duplicates_counted"] == GROUP and r["late_acks_after_reserve"] == 1
    assert r["mismatches"] == [] and r["samples_lost"] == 0
    assert r["samples_trained"] == GROUP  # distinct samples: still one each


def test_late_ack_of_a_batch_reserved_but_not_yet_acked_counts_the_duplicates(tmp_path):
    """The re-served batch is still out when the late ack comes: the same count, and the audit
    balances its ledgers once the second batch is acked too."""
    flow = make(tmp_path)
    iid = flow.register(["policy"], capacity=4, instance_id="raas-a", meta={})["instance_id"]
    tasks = flow.lease(iid, 2)
    for t in tasks:
        flow.push(iid, t.task_id, samples(t, [0, 1]))
    first = flow.pull("policy", 2 * GROUP)
    flow.requeue_expired_batches(now=1e12)
    second = flow.pull("policy", GROUP)  # half of the re-queued samples are served again
    answer = flow.ack(first.batch_id)
    assert (answer["trained_twice"], answer["taken_back"], answer["samples"]) == (GROUP, GROUP, GROUP)
    assert flow.pull("policy", GROUP, trainer_id="t") is None  # the other half was taken back
    flow.ack(second.batch_id)
    flow.close()
    r = audit(db(tmp_path))
    assert r["duplicates_trained"] == r["duplicates_counted"] == GROUP
    assert r["samples_trained"] == 2 * GROUP and r["samples_pending"] == 0
    assert r["mismatches"] == [] and r["batches"] == {"acked": 2}


def test_late_ack_before_any_reserve_takes_the_samples_back(tmp_path):
    """A re-queued batch acked before its samples were served again: they are taken back from
    the queue (trained once, never served again) and the audit balances."""
    flow = make(tmp_path)
    iid = flow.register(["policy"], capacity=4, instance_id="raas-a", meta={})["instance_id"]
    task = flow.lease(iid, 1)[0]
    flow.push(iid, task.task_id, samples(task, [0, 1]))
    first = flow.pull("policy", GROUP)
    assert flow.requeue_expired_batches(now=1e12) == {"policy"}
    assert flow.stats()["models"]["policy"]["queue_depth"] == GROUP
    answer = flow.ack(first.batch_id)
    assert answer["late"] and (answer["taken_back"], answer["trained_twice"]) == (GROUP, 0)
    assert "warning" not in answer
    stats = flow.stats()["models"]["policy"]
    assert stats["queue_depth"] == 0 and stats["late_acks"] == 1
    assert stats["late_acks_after_reserve"] == 0 and stats["samples_trained_twice"] == 0
    assert flow.pull("policy", GROUP) is None  # nothing to serve again
    flow.close()
    r = audit(db(tmp_path))
    assert r["balanced"], r
    assert r["samples_trained"] == GROUP and r["duplicates_trained"] == 0 and r["late_acks"] == 1


def test_a_duplicate_the_service_did_not_count_is_a_mismatch(every_class):
    _edit(every_class, "INSERT INTO batches(batch_id, model_id, trainer_id, policy_version, n,"
                       " state, served_at, acked_at) VALUES('forged', 'policy', 't', 0, 2,"
                       " 'acked', 0, 0)")
    r = audit(db(every_class))
    assert r["duplicates_counted"] == 0
    assert any("samples_trained_twice" in m for m in r["mismatches"]), r["mismatches"]


def test_cli_prints_json_and_exit_status_says_balanced(every_class, capsys):
    assert main([str(db(every_class)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["balanced"] is True and report["tasks_total"] == 8
    assert main([str(db(every_class))]) == 0
    assert "balanced: yes" in capsys.readouterr().out
    _edit(every_class, "DELETE FROM samples WHERE state='queued'")
    assert main([str(db(every_class))]) == 1
    assert "balanced: NO" in capsys.readouterr().out
    assert main([str(every_class / "missing.db")]) == 2
