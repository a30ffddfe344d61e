"""In-memory state follows a transaction only once it committed: a request whose SQLite commit
fails (a full disk, say) leaves the fresh queues, replay pools, versions, curators, the pool's
limits and stats and the open task count as they were (the request is refused with 507 naming
``state_dir``), and the same request succeeds once commits work again; so does a request whose
plugin raises half-way through its transaction."""

from __future__ import annotations

import sqlite3

import pytest

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.curators import PromptCurator
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.store import Store
from tests.unit.dataflow_fakes import publish, samples


class FailingCommits:
    """A SQLite connection whose ``COMMIT`` fails while ``failing`` is set."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn, self.failing = conn, False

    def execute(self, sql: str, *args):
        if self.failing and sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self.conn.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self.conn, name)


class RejectThenFail(PromptCurator):
    """Rejects three prompts, then raises (a curator with a bug)."""

    calls = 0

    def should_submit(self, prompt, version: int) -> bool:
        type(self).calls += 1
        if type(self).calls > 3:
            raise RuntimeError("curator bug")
        return False


def memory(flow: Dataflow) -> dict:
    """Everything the service holds in memory that mirrors SQLite."""
    return {"versions": dict(flow.versions),
            "queues": {m: q.peek_order() for m, q in flow.queues.items()},
            "replay": {m: [(e.sample_id, e.uses) for e in p.entries()]
                       for m, p in flow.replay_pools.items()},
            "open_train": flow.open_train,
            "limits": dict(flow.pool.instance_limits), "stats": dict(flow.pool.instance_stats),
            "curators": [c.state_dict() for c in flow.curators],
            "journal_applied": flow.plugin_state.journal_applied,
            "skip_run": flow.plugin_state.skip_run, "saved_at": flow.plugin_state.saved_at,
            "weight_index": {m: list(e) for m, e in flow.weight_index.items()}}


def test_the_store_runs_after_commit_actions_only_once_committed(tmp_path):
    store = Store(tmp_path / "dataflow.db")
    conn = store.conn = FailingCommits(store.conn)
    ran: list[str] = []
    with store.tx() as tx:
        store.set_meta("k", 1)
        tx.after_commit(ran.append, "committed")
        tx.on_rollback(ran.append, "undone")
    assert ran == ["committed"]
    conn.failing = True
    with pytest.raises(ServiceError, match="disk is full") as refused:  # a 507 naming state_dir
        with store.tx() as tx:
            store.set_meta("k", 2)
            tx.after_commit(ran.append, "lost")
            tx.on_rollback(ran.append, "undo 1")
            tx.on_rollback(ran.append, "undo 2")
    conn.failing = False
    assert (refused.value.status, refused.value.field) == (507, "state_dir")
    assert ran == ["committed", "undo 2", "undo 1"]  # newest undo first, nothing after commit
    assert store.get_meta("k") == 1 and not conn.in_transaction
    with pytest.raises(RuntimeError, match="transaction is over"):
        tx.after_commit(ran.append, "too late")
    store.close()


def test_a_failed_commit_leaves_the_in_memory_state_unchanged(tmp_path):
    flow = Dataflow(DataflowConfig(
        state_dir=str(tmp_path / "state"), group_size=2, curators=["greso"], max_staleness=4,
        replay={"ratio": 0.5, "pool_size": 8, "max_staleness": 4}, plugin_state_every_s=1e-6))
    conn = flow.store.conn = FailingCommits(flow.store.conn)

    def refused_once(call, *args, **kw):
        before = memory(flow)
        conn.failing = True
        with pytest.raises(ServiceError, match="disk is full"):  # 507 naming state_dir
            call(*args, **kw)
        conn.failing = False
        assert memory(flow) == before
        return call(*args, **kw)  # the same request once commits work again

    iid = flow.register(["policy"], 8, None, {})["instance_id"]
    refused_once(flow.register, ["policy"], 8, "raas-b", {},
                 limits={"policy": {"vocab_size": 1000}})
    assert flow.pool.instance_limits["raas-b"] == {"policy": {"vocab_size": 1000}}
    refused_once(flow.heartbeat, iid, stats={"weight_pause_s": 1.5})
    tasks = refused_once(flow.lease, iid, 6)
    assert len(tasks) == 6 and flow.open_train == 6
    for t in tasks[:4]:
        refused_once(flow.push, iid, t.task_id, samples(t, [1, 0]))
    assert len(flow.queues["policy"]) == 8 and flow.open_train == 2
    batch = refused_once(flow.pull, "policy", 4)
    assert batch is not None and len(flow.queues["policy"]) == 4
    refused_once(flow.ack, batch.batch_id)
    assert len(flow.replay_pools["policy"]) == 4
    assert refused_once(flow.pull, "policy", 4) is not None  # half of it replayed
    refused_once(publish, flow, 1)
    assert flow.versions["policy"] == 1
    stats = flow.stats()["models"]["policy"]
    assert (stats["samples_accepted"], stats["batches_served"], stats["batches_acked"]) == (8, 2, 1)
    flow.close()


def test_a_plugin_failing_mid_transaction_changes_nothing_in_memory(tmp_path):
    RejectThenFail.calls = 0
    flow = Dataflow(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2,
                                   curators=[{"class_path": f"{__name__}.RejectThenFail"}]))
    iid = flow.register(["policy"], 4, None, {})["instance_id"]
    before = memory(flow)
    with pytest.raises(RuntimeError, match="curator bug"):
        flow.lease(iid, 1)
    assert memory(flow) == before and flow.plugin_state.skip_run == 0
    stats = flow.stats()["models"]["policy"]
    assert (stats["prompts_skipped"], stats["prompts_submitted"]) == (0, 0)  # rolled back
    flow.close()
