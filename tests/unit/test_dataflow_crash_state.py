"""Dataflow state after a crash (no clean close), in process on a real SQLite file: the prompt
curators come back exactly as they were, although their snapshots are only periodic."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from tests.unit.dataflow_fakes import publish, samples

CFG = dict(group_size=2, curators=["greso", "filter_solved"], plugin_state_every_s=3600.0,
           max_staleness=8)


def make(tmp_path) -> Dataflow:
    return Dataflow(DataflowConfig(state_dir=str(tmp_path / "state"), **CFG))


def drive(flow: Dataflow) -> None:
    """Outcomes before and after a publication (GRESO's on_version), all after the snapshot
    the first lease wrote."""
    iid = flow.register(["policy"], 16, None, {})["instance_id"]
    tasks = flow.lease(iid, 8)
    for t, rewards in zip(tasks[:4], ([1, 1], [0, 0], [1, 0], [1, 1])):
        flow.push(iid, t.task_id, samples(t, rewards))
    publish(flow, 1)
    for t, rewards in zip(tasks[4:], ([1, 1], [0, 0], [0, 1], [1, 1])):
        flow.push(iid, t.task_id, samples(t, rewards, version=1))


def test_curator_state_after_a_crash_equals_the_state_before(tmp_path):
    flow = make(tmp_path)
    drive(flow)
    before = [c.state_dict() for c in flow.curators]
    assert before[0]["streaks"] and before[1]["ewma"]  # they learned something
    pending = flow.store.conn.execute("SELECT COUNT(*) FROM plugin_journal").fetchone()[0]
    assert pending == 4  # the pushes after the publication's snapshot
    # no close(): the process "dies" here; a new service opens the same state
    again = make(tmp_path)
    assert [c.state_dict() for c in again.curators] == before
    again.close()
    # a clean close snapshots and empties the journal; the state is the same again
    third = make(tmp_path)
    assert third.store.conn.execute("SELECT COUNT(*) FROM plugin_journal").fetchone()[0] == 0
    assert [c.state_dict() for c in third.curators] == before
    third.close()


def test_curator_state_survives_kill9_of_a_real_process(tmp_path):
    """The same in a child process that is SIGKILLed after its last push (nothing flushed by
    Python or closed)."""
    script = textwrap.dedent(f"""
        import json, os, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.unit.test_dataflow_crash_state import make, drive
        from pathlib import Path
        flow = make(Path({str(tmp_path)!r}))
        drive(flow)
        print(json.dumps([c.state_dict() for c in flow.curators]), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    import json

    before = json.loads(proc.stdout.strip().splitlines()[-1])
    again = make(tmp_path)
    assert json.loads(json.dumps([c.state_dict() for c in again.curators])) == before
    s = again.stats()["models"]["policy"]
    assert s["samples_accepted"] + s["samples_filtered"] == 16 and s["current_version"] == 1
    again.close()


def test_a_batch_served_before_a_restart_gets_a_whole_ack_timeout_after_it(tmp_path):
    """The trainer holding it may ack once the service is back; re-serving it at once (its
    served_at is old) would train its samples twice."""
    cfg = DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2, batch_ack_timeout_s=5)
    flow = Dataflow(cfg)
    iid = flow.register(["policy"], 4, None, {})["instance_id"]
    for t in flow.lease(iid, 2):
        flow.push(iid, t.task_id, samples(t, [1, 0]))
    held = flow.pull("policy", 2)
    other = flow.pull("policy", 2)
    # the service dies; it is back long after both batches' timeouts would have passed
    again = Dataflow(cfg)
    assert again.requeue_expired_batches(now=again.opened_at + 4.9) == set()
    again.ack(held.batch_id)  # the trainer that trained it through the outage acks it
    assert again.requeue_expired_batches(now=again.opened_at + 5.0) == {"policy"}
    s = again.stats()["models"]["policy"]
    assert (s["samples_acked"], s["samples_requeued"], s["queue_depth"]) == (2, 2, 2)
    assert again.pull("policy", 2).samples[0].task_id == other.samples[0].task_id
    again.close()
