"""Fault injection on real processes (dataflow service, vLLM RaaS, Lightning trainer) on loopback.

Each test runs one scenario of :mod:`tests.fault_harness` in a short form (the tiny random model,
8 versions, the fault at version 3): kill -9 and restart of the dataflow, of the RaaS, of the
trainer (from its last.ckpt), a partition between RaaS and dataflow longer than a heartbeat, a
full disk under the weight store and one under the whole state folder, and a RaaS pushing
garbage. After each the run must reach its target version and the audit of the dataflow's
database must balance exactly: every train task accounted for once, no sample lost, none
trained twice. ``tests/benchmarks/bench_faults.py``
runs the same scenarios longer and prints their figures.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess

import pytest

from tests.fault_harness import FaultRun, Settings, garbage_pushes, run_scenario, vocab_size

pytestmark = [pytest.mark.vllm]

VERSIONS = 8
BATCH = 64


def settings(**kw) -> Settings:
    base = dict(versions=VERSIONS, fault_at=3, batch_size=BATCH, lease_seconds=12.0,
                batch_ack_timeout_s=30.0, ckpt_every=2, partition_s=6.0, disk_full_refusals=2,
                max_concurrency=16, timeout_s=240.0)
    base.update(kw)
    return Settings(**base)


def ran(r: dict) -> dict:
    """The scenario ran to its end (else show why, with the components' logs)."""
    assert "error" not in r, r["error"]
    return r


def assert_run_balanced(r: dict, trained_at_least: bool = False, batch: int = BATCH,
                        versions: int = VERSIONS) -> None:
    """The run reached its target and the audit balances exactly."""
    ran(r)
    assert r["completed"] and r["trainer_rc"] == 0 and r["final_version"] == versions, r
    assert r["balanced"], r["audit"]
    assert r["samples_lost"] == 0 and r["duplicates_trained"] == 0, r
    assert r["audit"]["mismatches"] == [] and r["audit"]["tasks"]["lost"] == 0
    # every version trained one batch; a trainer restarted from an older checkpoint trains the
    # steps after it again, and reports the step, so the dataflow counts exactly those acks as
    # rolled back: trained minus rolled back is one batch per version
    assert r["samples_trained"] - r["samples_rolled_back"] == versions * batch, r
    if not trained_at_least:
        assert r["samples_rolled_back"] == 0, r
    assert r["samples_accepted"] >= r["samples_trained"] and r["tasks_issued"] > 0
    assert r["recovery_s"] is not None and r["recovery_s"] >= 0, r  # both paths came back


def instances(r: dict) -> list[str]:
    conn = sqlite3.connect(f"file:{r['work']}/dataflow/dataflow.db?mode=ro", uri=True)
    try:
        return [row[0] for row in conn.execute("SELECT instance_id FROM instances")]
    finally:
        conn.close()


def test_dataflow_kill9_and_restart(tmp_path, tiny_model_dir):
    r = run_scenario("dataflow_kill", tmp_path, tiny_model_dir, settings())
    assert_run_balanced(r)
    log = (tmp_path / "dataflow_kill" / "logs" / "dataflow.log").read_text()
    assert log.count("dataflow serving on http://") == 2  # the restart, on the same port
    assert len(instances(r)) == 1  # the RaaS lived through it under the same instance id
    dead = r["detail"]["audit_after_kill"]  # the state exactly as kill -9 left it
    assert dead["balanced"] and dead["samples_lost"] == 0 and dead["tasks_issued"] > 0, dead


@pytest.mark.slow  # 45-75 s of real processes: CI runs it in its slow suite
def test_raas_kill9_and_a_new_one(tmp_path, tiny_model_dir):
    r = run_scenario("raas_kill", tmp_path, tiny_model_dir, settings())
    assert_run_balanced(r)
    assert len(instances(r)) == 2  # the dead one and its replacement


@pytest.mark.slow  # 45-75 s of real processes: CI runs it in its slow suite
def test_trainer_kill9_and_resume_from_last_ckpt(tmp_path, tiny_model_dir):
    r = run_scenario("trainer_kill", tmp_path, tiny_model_dir, settings())
    assert_run_balanced(r, trained_at_least=True)
    log = (tmp_path / "trainer_kill" / "logs" / "trainer.log").read_text()
    assert "Restoring states from the checkpoint path" in log and "last.ckpt" in log


def test_partition_between_raas_and_dataflow(tmp_path, tiny_model_dir):
    s = settings()
    assert s.partition_s > s.lease_seconds / 3  # longer than a heartbeat
    r = ran(run_scenario("partition", tmp_path, tiny_model_dir, s))
    assert_run_balanced(r)
    link = r["detail"]["link"]
    assert link["partitions"] == 1 and link["connections_reset"] > 0, link


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -rm` (user + mount namespaces) "
                                                  "to put a small tmpfs under the weight store")
def test_full_disk_under_the_weight_store(tmp_path, tiny_model_dir):
    # more versions than the others: the trainer does not wait for publication, and must still
    # be training once the disk has room again (recovery_s is measured from there)
    r = ran(run_scenario("disk_full", tmp_path, tiny_model_dir, settings(versions=2 * VERSIONS)))
    d = r["detail"]
    assert d["uploads_refused"] >= 2 and d["other_upload_errors"] == 0, d
    assert d["trainer_publish_errors"] >= 2, d  # the publisher saw them and went on
    assert d["refusal"].startswith("507 disk:"), d["refusal"]
    assert str(tmp_path / "disk_full" / "dataflow" / "weights") in d["refusal"]
    assert d["version_when_freed"] < 2 * VERSIONS, d  # else the run ended during the outage
    assert d["published_after_free"], d
    assert_run_balanced(r, versions=2 * VERSIONS)


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -rm` (user + mount namespaces) "
                                                  "to put a small tmpfs under the state folder")
@pytest.mark.slow  # 65 s of real processes: CI runs it in its slow suite
def test_full_disk_under_the_state_folder(tmp_path, tiny_model_dir):
    # the SQLite state (and the weight store) on a full volume: every write is refused with 507
    # naming state_dir, the clients send those requests again, nothing is lost, and the dataflow
    # logs the episode in two lines, without a traceback or a 500
    r = ran(run_scenario("state_disk_full", tmp_path, tiny_model_dir,
                         settings(versions=2 * VERSIONS)))
    d = r["detail"]
    assert d["state_refusals"] >= 2 and d["episodes_started"] >= 1, d
    assert d["episodes_ended"] == d["episodes_started"], d
    assert d["tracebacks"] == 0 and d["answers_500"] == 0, d
    assert str(tmp_path / "state_disk_full" / "dataflow") in d["state_full_line"], d
    assert_run_balanced(r, versions=2 * VERSIONS)


def test_garbage_raas_is_refused_and_stores_nothing(tmp_path, tiny_model_dir):
    # more versions than the others, since training goes on during the garbage and must still
    # be running once it ends (recovery_s is measured from there)
    r = ran(run_scenario("garbage_raas", tmp_path, tiny_model_dir,
                         settings(versions=2 * VERSIONS)))
    d = r["detail"]
    assert d["accepted_bad"] == [] and d["server_errors"] == [], d["cases"]
    assert all(400 <= st < 500 for st in d["cases"].values()), d["cases"]
    assert d["stored_bad"] == []  # nothing of it queued (read from the database right after)
    assert_run_balanced(r, versions=2 * VERSIONS)


def test_out_of_vocab_tokens_are_refused(tmp_path, tiny_model_dir):
    run = FaultRun(tmp_path / "oov", tiny_model_dir, settings())
    try:
        run.start_dataflow()
        g = garbage_pushes(run.url, vocab_size(tiny_model_dir), 8, run.db,
                           skip=tuple(k for k in _case_names() if k != "token_out_of_vocab"))
    finally:
        run.close()
    assert g["stored_bad"] == [] and 400 <= g["cases"]["token_out_of_vocab"] < 500, g["cases"]


def _case_names() -> list[str]:
    from tests.fault_harness import garbage_cases

    return list(garbage_cases(100))
