"""Crash consistency with real processes on loopback: kill -9 and come back with nothing lost.

* the dataflow service is SIGKILLed mid-run (a batch served and not acknowledged, samples queued,
  a curator with state, versions published) and restarted on its state folder: every counter,
  version, lease, queued sample and the curator's state are intact; the unacknowledged batch is
  re-served after ``batch_ack_timeout_s``, and no sample is acknowledged twice;
* a trainer (``astralight fit``) is SIGKILLed and resumed with ``--ckpt_path last``: versions
  continue upwards without publishing any number twice, its first version after the resume is
  full, and a :class:`~astralight.raas.weight_sync.WeightSync` follows the whole chain with every
  checksum verified;
* ``astralight run`` on a shortened toy recipe survives a SIGKILLed trainer (pid from
  ``pids.json``): the launcher restarts it from ``last.ckpt`` and the run completes with the
  restart counted; ``astralight run --resume`` completes a run folder whose launcher and
  components were all killed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from astralight.dataflow.client import DataflowClient
from astralight.protocol import Sample

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- helpers


def make_samples(task, rewards, version=0):
    out = []
    for k, reward in enumerate(rewards):
        ids = np.array([2, 5, 6, 7, 8 + k, 1], dtype=np.int32)
        mask = np.array([0, 0, 0, 1, 1, 1], dtype=np.uint8)
        out.append(Sample(task_id=task.task_id, sample_index=k, model_id="policy", token_ids=ids,
                          logprobs=np.where(mask > 0, -0.5, 0.0).astype(np.float32),
                          loss_mask=mask, versions=np.where(mask > 0, version, -1).astype(np.int32),
                          reward=float(reward), prompt_len=3,
                          metadata={"temperature": 1.0, "finish_reason": "stop"}))
    return out


def db_rows(state_dir: Path, sql: str, args=()):
    con = sqlite3.connect(str(state_dir / "dataflow.db"))
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None,
             log: Path | None = None, every: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
            raise AssertionError(f"{what}: process exited with {proc.returncode}\n{tail}")
        time.sleep(every)
    tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{tail}")


# ---------------------------------------------------------------- 1. dataflow kill -9


def test_dataflow_kill9_keeps_state_and_reserves_the_unacked_batch(tmp_path, dataflow_service,
                                                                    client_for):
    curator = {"class_path": "astralight.dataflow.curators.FilterSolved",
               "init_args": {"threshold": 0.99}}
    # curator snapshots only at publications: what it learned after is in the journal
    cfg = dict(group_size=2, max_staleness=4, batch_ack_timeout_s=3, curators=[curator],
               plugin_state_every_s=3600)
    url, proc, _ = dataflow_service(tmp_path, **cfg)
    c = client_for(url)
    iid = c.register(["policy"], capacity=8)["instance_id"]
    tasks = c.lease(iid, 6)
    assert len(tasks) == 6
    for t, rewards in zip(tasks[:3], ([1, 0], [1, 1], [0, 1])):
        assert c.push(iid, t.task_id, make_samples(t, rewards))["accepted"] == 2
    held = tasks[5]  # leased, never pushed: the lease must survive
    trained = c.pull_batch("policy", 4, timeout_s=1)
    c.ack(trained.batch_id)
    import torch

    from astralight.weights import ArtifactBuilder

    builder = ArtifactBuilder("policy")
    tensors = {"w": torch.arange(8, dtype=torch.float32).to(torch.bfloat16)}
    for v in (1, 2):
        art = builder.build(v, {"w": tensors["w"] + v})
        for name, data in art.files.items():
            c.upload_weight_file("policy", v, name, data)
        c.publish(art.manifest)
    for t, rewards in zip(tasks[3:5], ([1, 0], [1, 1])):  # learned after the last snapshot
        assert c.push(iid, t.task_id, make_samples(t, rewards, version=2))["accepted"] == 2
    unacked = c.pull_batch("policy", 4, timeout_s=1)  # served at version 2, never acked
    assert unacked is not None and len(unacked.samples) == 4
    before = c.stats()
    assert before["plugins"]["curators[0]"]["metrics"]["tracked_prompts"] == 5

    t_kill = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    url2, proc2, _ = dataflow_service(tmp_path, port=int(url.rsplit(":", 1)[1]), **cfg)
    restart_s = time.monotonic() - t_kill
    c2 = client_for(url2)
    after = c2.stats()
    m0, m1 = before["models"]["policy"], after["models"]["policy"]
    for key in ("tasks_issued", "samples_accepted", "samples_served", "batches_served",
                "samples_acked", "batches_acked", "prompts_submitted", "rollouts_generated"):
        assert m1[key] == m0[key], key
    assert m1["current_version"] == 2 and m1["batches_outstanding"] == 1
    assert m1["queue_depth"] == m0["queue_depth"] == 2
    assert after["tasks"]["source_cursor"] == before["tasks"]["source_cursor"]
    assert after["plugins"] == before["plugins"]  # the curator's state, journal replayed
    assert [m.version for m in (c2.manifest("policy", 1), c2.manifest("policy", 2))] == [1, 2]
    # the lease survived: the holder's push is accepted, a second one is a duplicate
    assert c2.push(iid, held.task_id, make_samples(held, [1, 0], version=2))["accepted"] == 2
    assert c2.push(iid, held.task_id, make_samples(held, [0, 0], version=2))["duplicate"] is True

    # the unacked batch comes back (after batch_ack_timeout_s), whole, in a new batch
    again = c2.pull_batch("policy", 6, timeout_s=20)
    assert again is not None and again.batch_id != unacked.batch_id
    keys = {(s.task_id, s.sample_index) for s in again.samples}
    assert {(s.task_id, s.sample_index) for s in unacked.samples} <= keys
    c2.ack(again.batch_id)
    acked_once = c2.stats()["models"]["policy"]["samples_acked"]
    c2.ack(unacked.batch_id)  # a late ack of the re-queued batch trains nothing twice
    s = c2.stats()["models"]["policy"]
    assert s["samples_acked"] == acked_once
    assert s["batches_requeued"] == 1 and s["samples_requeued"] == 4
    acked = db_rows(tmp_path / "state", "SELECT COUNT(*) FROM samples WHERE state='acked'")[0][0]
    assert acked == s["samples_acked"] == 4 + 6  # each sample acknowledged exactly once
    print(f"dataflow kill -9 -> serving again in {restart_s:.1f}s")
    proc2.send_signal(signal.SIGTERM)
    assert proc2.wait(timeout=20) == 0


# ---------------------------------------------------------------- 2. trainer kill -9 + resume


def fake_raas(url: str, stop: threading.Event, errors: list, task_s: float = 0.25) -> None:
    """Pushes random samples stamped with the current version (no model: the trainer computes
    its own log-probs; behaviour log-probs are a constant, fine for an M2PO step), one task per
    ``task_s`` seconds so that the trainer is mid-run when the test kills it."""
    try:
        rng = np.random.default_rng(0)
        client = DataflowClient(url, retry_s=60)
        instance = client.register(["policy"], capacity=8)["instance_id"]
        while not stop.is_set():
            tasks = client.lease(instance, 4)
            if not tasks:
                stop.wait(0.05)
                continue
            version = client.current_version("policy")
            for task in tasks:
                stop.wait(task_s)
                client.push(instance, task.task_id,
                            make_samples(task, rng.integers(0, 2, task.n), version=version))
        client.close()
    except Exception as exc:  # surfaced by the test
        if not stop.is_set():
            errors.append(exc)


def trainer_config(tmp_path: Path, url: str, model_dir, max_steps: int) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "precision": 32, "max_steps": max_steps,
            "default_root_dir": str(tmp_path / "trainer"), "enable_progress_bar": False,
            "enable_model_summary": False, "logger": False,
            "callbacks": [
                {"class_path": "astralight.callbacks.WeightPublisher",
                 "init_args": {"every_n_steps": 1, "full_every": 100}},
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True,
                               "every_n_train_steps": 3}},
            ]},
        "model": {"class_path": "astralight.policy.M2POPolicy",
                  "init_args": {"model_path": str(model_dir), "model_id": "policy", "lr": 1e-3}},
        "data": {"class_path": "astralight.datamodules.RolloutDataModule",
                 "init_args": {"dataflow_url": url, "model_id": "policy", "batch_size": 4,
                               "pull_timeout_s": 5, "max_wait_s": 120}},
    }
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class RecordingEngine:
    """A RaaS engine stand-in: WeightSync hands it verified tensors."""

    def __init__(self):
        self.version = 0
        self.updates: list[int] = []

    def update_weights(self, named_tensors, version):
        self.version = version
        self.updates.append(version)


def test_trainer_kill9_resumes_from_last_ckpt_with_versions_continuing(tmp_path, dataflow_service,
                                                                       tiny_model_dir):
    from astralight.raas.weight_sync import WeightSync

    service = dataflow_service(tmp_path, group_size=2, max_buffered_samples=16,
                               max_staleness=100, batch_ack_timeout_s=5, weights_gc=False)
    stop, errors = threading.Event(), []
    raas = threading.Thread(target=fake_raas, args=(service.url, stop, errors), daemon=True)
    raas.start()
    client = DataflowClient(service.url)
    engine = RecordingEngine()
    sync = WeightSync(lambda: DataflowClient(service.url), "policy", engine, background=False)
    config = trainer_config(tmp_path, service.url, tiny_model_dir, max_steps=16)
    log1, log2 = tmp_path / "fit-1.log", tmp_path / "fit-2.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        with open(log1, "wb") as out:
            fit = subprocess.Popen([sys.executable, "-m", "astralight.cli", "fit", "--config",
                                    str(config)], stdout=out, stderr=subprocess.STDOUT, env=env)
        last = tmp_path / "ckpt" / "last.ckpt"
        # a checkpoint exists (step 3 or 6) and the trainer has published past it
        wait_for(lambda: last.exists() and client.current_version("policy") >= 4, 240,
                 "a checkpoint and version 4", fit, log1)
        fit.send_signal(signal.SIGKILL)
        fit.wait()
        t_kill = time.monotonic()
        v_crash = client.current_version("policy")
        acked_at_kill = client.stats()["models"]["policy"]["batches_acked"]
        sync.refresh(force=True)  # a receiver holds the first life's chain
        assert engine.version == v_crash >= 4
        import torch

        ckpt = torch.load(last, map_location="cpu", weights_only=False)
        ckpt_step = ckpt["global_step"]
        assert 3 <= ckpt_step <= v_crash  # the checkpoint is older than what was published
        # the datamodule's position: one acknowledged batch per optimizer step, none pending
        position = ckpt["RolloutDataModule"]
        assert position["batches_acknowledged"] == position["batches_pulled"] == ckpt_step
        assert ckpt["callbacks"]["WeightPublisher"]["last_enqueued_step"] == ckpt_step
        with open(log2, "wb") as out:
            fit2 = subprocess.Popen([sys.executable, "-m", "astralight.cli", "fit", "--config",
                                     str(config), "--ckpt_path", "last"],
                                    stdout=out, stderr=subprocess.STDOUT, env=env)
        first_new = wait_for(lambda: client.current_version("policy") > v_crash and
                             client.current_version("policy"), 240, "a version after the resume",
                             fit2, log2)
        recovery_s = time.monotonic() - t_kill
        assert fit2.wait(timeout=240) == 0, log2.read_text()[-4000:]
    finally:
        stop.set()
        raas.join(timeout=30)
    assert not errors, errors
    text = log2.read_text()
    assert "Restoring states from the checkpoint" in text or "Restored all states" in text, text[-3000:]
    # versions went on upwards to max_steps; none was published twice (the dataflow refuses a
    # version number it holds: no 409 reached the publisher, and every manifest is unique)
    assert client.current_version("policy") == 16
    from astralight.protocol import decode

    manifests = [decode(bytes(blob)) for _, blob in db_rows(
        tmp_path / "state", "SELECT version, manifest FROM versions ORDER BY version")]
    versions = [m.version for m in manifests]  # (a publisher that falls behind skips some)
    assert versions[-1] == 16 and versions == sorted(set(versions))
    steps = [m.metadata["step"] for m in manifests]
    assert steps == [v for v in versions]  # every_n_steps=1: version = the step it was taken at
    # the first version after the resume is a full one (the delta base is not checkpointed)
    resumed = [m for m in manifests if m.version > v_crash]
    assert resumed[0].version == first_new or resumed[0].version < first_new
    assert resumed[0].kind == "full", [(m.version, m.kind) for m in resumed]
    assert not re.search(r"(?<![\d.])409(?![\d.])", text)  # (not a progress bar's "24099.6it/s")
    # the batches acked after the checkpoint's step were trained into the weights the kill lost:
    # the resumed trainer reported its step and the dataflow counts exactly those as rolled back
    stats = client.stats()["models"]["policy"]
    assert stats["batches_rolled_back"] == acked_at_kill - ckpt_step, (acked_at_kill, ckpt_step)
    assert stats["samples_rolled_back"] >= stats["batches_rolled_back"]
    assert f"resumed after {ckpt_step} acknowledged batches" in text
    assert f"the dataflow already holds version {v_crash} of 'policy' but this trainer is at " \
           f"version {ckpt_step} (step {ckpt_step})" in text or v_crash == ckpt_step
    # a RaaS that held the pre-crash chain follows onto the resumed one, every checksum verified
    sync.refresh(force=True)
    assert engine.version == 16 and sync.stats()["failures"] == 0
    # a batch the killed trainer pulled and never acked goes back to the queue (after
    # batch_ack_timeout_s): none stays out, every served batch was acked or re-queued
    wait_for(lambda: client.stats()["models"]["policy"]["batches_outstanding"] == 0, 60,
             "no batch left unacknowledged")
    stats = client.stats()["models"]["policy"]
    assert stats["batches_served"] == stats["batches_acked"] + stats["batches_requeued"]
    assert db_rows(tmp_path / "state", "SELECT COUNT(*) FROM samples WHERE state='served'")[0][0] == 0
    # and no sample was acknowledged (trained) twice
    acked = db_rows(tmp_path / "state", "SELECT COUNT(*) FROM samples WHERE state='acked'")[0][0]
    assert acked == stats["samples_acked"]
    print(f"trainer kill -9 at version {v_crash} (checkpoint step {ckpt_step}) -> version "
          f"{first_new} published {recovery_s:.1f}s later; batches re-queued: "
          f"{stats['batches_requeued']}")
    client.close()
    sync.close()


# ---------------------------------------------------------------- 3. the launcher


def crash_recipe(tmp_path: Path, versions: int = 6) -> Path:
    from tests.integration.recipes import shortened_toy_recipe

    path = shortened_toy_recipe(tmp_path, versions=versions)
    recipe = yaml.safe_load(path.read_text())
    recipe["dataflow"]["eval"]["every"] = versions // 2
    recipe["dataflow"]["batch_ack_timeout_s"] = 10
    recipe["supervise"] = {"max_restarts": 2, "backoff_s": 1}
    for cb in recipe["trainers"][0]["trainer"]["callbacks"]:
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"]["every_n_train_steps"] = 1
    path.write_text(yaml.safe_dump(recipe))
    return path


def start_run(recipe: Path, run_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``astralight run RECIPE --run-dir RUN_DIR`` in the background, its output in ``log``,
    once its three components run: ``(launcher, dataflow url)``. The launcher is killed if they
    never all start."""
    with open(log, "wb") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "astralight.cli", "run",
                                     str(recipe), "--run-dir", str(run_dir)],
                                    stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(read_pids(run_dir)) == 3, 300, "every component started", launcher, log)
    except BaseException:
        launcher.kill()
        launcher.wait()
        raise
    return launcher, dataflow_url(run_dir)


def dataflow_url(run_dir: Path) -> str:
    cfg = yaml.safe_load((run_dir / "configs" / "dataflow.yaml").read_text())
    return f"http://127.0.0.1:{cfg['port']}"


def current_version(url: str) -> int:
    try:
        with DataflowClient(url, retry_s=0, timeout=5) as c:
            return c.current_version("policy")
    except Exception:
        return -1


def read_pids(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.vllm
@pytest.mark.slow  # 45-75 s of real processes: CI runs it in its slow suite
def test_run_restarts_a_killed_trainer_from_last_ckpt(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "launch.log"
    # 30 versions, not 6: with the RaaS prewarmed it is up before the trainer has loaded, and
    # the trainer then trained 6 small batches from the buffer before the kill could land
    # between version 2 and the end (no progress left to recover: recovery_s stayed None)
    recipe = crash_recipe(tmp_path, versions=30)
    launcher, url = start_run(recipe, run_dir, log)
    try:
        pids = read_pids(run_dir)
        assert set(pids) == {"dataflow", "raas-0", "trainer-policy"}
        wait_for(lambda: current_version(url) >= 2 and
                 (run_dir / "checkpoints" / "policy" / "last.ckpt").exists(), 300,
                 "version 2 and last.ckpt", launcher, log)
        os.kill(pids["trainer-policy"], signal.SIGKILL)
        version_at_kill = current_version(url)
        # the launcher notices, restarts it from last.ckpt and writes its new pid
        new = wait_for(lambda: read_pids(run_dir).get("trainer-policy") not in
                       (None, pids["trainer-policy"]) and read_pids(run_dir), 120,
                       "the restarted trainer's pid", launcher, log)
        assert new["dataflow"] == pids["dataflow"] and new["raas-0"] == pids["raas-0"]
        assert launcher.wait(timeout=400) == 0, log.read_text()[-5000:]
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.wait(timeout=120)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 30 and summary["eval_versions"][-1] == 30
    assert 2 <= version_at_kill < 30  # killed mid-run: the restart had versions left to train
    assert summary["restarts"] == {"dataflow": 0, "raas-0": 0, "trainer-policy": 1}
    [event] = summary["restart_events"]
    assert event["component"] == "trainer-policy" and event["returncode"] == -signal.SIGKILL
    assert "last.ckpt" in event["detail"] and event["recovery_s"] is not None
    text = log.read_text()
    assert "trainer-policy exited with -9 (SIGKILL: on Linux usually the kernel's out-of-memory" \
        " killer" in text
    assert "; restarting in " in text
    assert "Restoring states from the checkpoint" in (run_dir / "logs" / "trainer-policy.log").read_text()
    acked = db_rows(run_dir / "dataflow", "SELECT COUNT(*) FROM samples WHERE state='acked'")[0][0]
    assert acked == summary["counters"]["samples_acked"]  # nothing acknowledged twice
    assert read_pids(run_dir) == {}  # everything stopped
    print(f"launcher: trainer restart recovered in {event['recovery_s']}s "
          f"(down {event['downtime_s']}s)")


@pytest.mark.vllm
@pytest.mark.slow  # 45-75 s of real processes: CI runs it in its slow suite
def test_run_resume_completes_an_interrupted_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "launch-1.log"
    # 30 versions, not 6: with the RaaS prewarmed, 6 versions were all trained before the kill
    # after version 2 could land, leaving the resume nothing to complete
    recipe = crash_recipe(tmp_path, versions=30)
    launcher, url = start_run(recipe, run_dir, log)
    try:
        wait_for(lambda: current_version(url) >= 2 and
                 (run_dir / "checkpoints" / "policy" / "last.ckpt").exists(), 300,
                 "version 2 and last.ckpt", launcher, log)
        # the machine "goes away": the launcher and every component die at once
        pids = read_pids(run_dir)
        launcher.send_signal(signal.SIGKILL)
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        launcher.wait()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    version_at_kill = max(v for (v,) in db_rows(run_dir / "dataflow",
                                                "SELECT version FROM versions"))
    assert (run_dir / "recipe.yaml").exists() and (run_dir / "models" / "init").is_dir()
    init_mtime = (run_dir / "models" / "init" / "config.json").stat().st_mtime
    time.sleep(1.0)  # the kill -9ed processes are gone from /proc
    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", "--resume", str(run_dir)],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "reusing prepared model" in proc.stdout
    assert (run_dir / "models" / "init" / "config.json").stat().st_mtime == init_mtime
    summary = json.loads((run_dir / "summary.json").read_text())  # the full record
    assert summary["versions"] == 30 and summary["eval_versions"][-1] == 30
    assert summary["resumes"] == 1
    assert summary["eval_versions"][0] == 0  # the whole run's evaluations, not just this launch's
    assert 2 <= version_at_kill < 30  # killed mid-run: the resume had versions left to train
    trainer_log = (run_dir / "logs" / "trainer-policy.log").read_text()
    assert "Restoring states from the checkpoint" in trainer_log
    acked = db_rows(run_dir / "dataflow", "SELECT COUNT(*) FROM samples WHERE state='acked'")[0][0]
    assert acked == summary["counters"]["samples_acked"]


@pytest.mark.vllm
@pytest.mark.slow  # ~2 minutes of real processes: CI runs it in its slow suite
def test_ctrl_c_is_the_normal_stop_and_the_resume_finishes_the_run(tmp_path):
    """The first Ctrl-C (SIGINT to the launcher) runs the normal stop: the trainer finishes its
    step, checkpoints and publishes, the last version is evaluated, the summary says
    ``interrupted`` and the resume command is printed; exit 130. ``--resume`` then finishes the
    run, and the summary labels each launch."""
    import torch
    run_dir = tmp_path / "run"
    log = tmp_path / "launch-1.log"
    recipe = crash_recipe(tmp_path, versions=30)
    launcher, url = start_run(recipe, run_dir, log)
    try:
        wait_for(lambda: current_version(url) >= 3, 300, "version 3", launcher, log)
        launcher.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the launcher
        assert launcher.wait(timeout=400) == 130, log.read_text()[-5000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = log.read_text()
    assert "[launch] stopping: interrupted (Ctrl-C or SIGTERM)" in text
    assert f"resume with: astralight run --resume {run_dir}" in text
    summary = json.loads((run_dir / "summary.json").read_text())
    first = summary["versions"]
    assert summary["stop_reason"] == "interrupted" and 3 <= first < 30
    assert summary["stop"]["final_eval_complete"] and summary["eval_version_end"] == first
    assert [r["stop_reason"] for r in summary["launches"]] == ["interrupted"]
    # the trainer stopped politely: no traceback, its last checkpoint at its last step
    trainer_log = (run_dir / "logs" / "trainer-policy.log").read_text(errors="replace")
    assert "SIGTERM: finishing the current step" in trainer_log
    assert "Traceback" not in trainer_log and "KeyboardInterrupt" not in trainer_log
    ckpt = torch.load(run_dir / "checkpoints" / "policy" / "last.ckpt", map_location="cpu",
                      weights_only=False)
    assert ckpt["global_step"] == first
    assert read_pids(run_dir) == {}  # everything stopped

    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", "--resume", str(run_dir)],
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 30 and summary["stop_reason"] == "versions"
    launches = summary["launches"]
    assert [(r["launch"], r["resumed"], r["stop_reason"]) for r in launches] == \
        [(1, False, "interrupted"), (2, True, "versions")]
    assert launches[0]["version_end"] == first and launches[1]["version_end"] == 30
    assert summary["wall_s"] == launches[1]["wall_s"]
    assert summary["wall_s_total"] == pytest.approx(launches[0]["wall_s"] + launches[1]["wall_s"],
                                                    abs=0.2)
    assert summary["eval_versions"][0] == 0  # the whole run's evaluations


@pytest.mark.vllm
@pytest.mark.slow  # ~1 minute of real processes: CI runs it in its slow suite
def test_a_second_ctrl_c_stops_every_component_at_once(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "launch.log"
    launcher, url = start_run(crash_recipe(tmp_path, versions=30), run_dir, log)
    try:
        wait_for(lambda: current_version(url) >= 2, 300, "version 2", launcher, log)
        launcher.send_signal(signal.SIGINT)  # the normal stop begins...
        wait_for(lambda: "[launch] stopping: interrupted" in log.read_text(), 60,
                 "the normal stop", launcher, log)
        launcher.send_signal(signal.SIGINT)  # ...and the second Ctrl-C cuts it short
        assert launcher.wait(timeout=120) == 130, log.read_text()[-5000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = log.read_text()
    assert "interrupted again: stopping every component now" in text
    assert f"resume with: astralight run --resume {run_dir}" in text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["versions"] >= 2
    assert [r["stop_reason"] for r in summary["launches"]] == ["interrupted"]
    assert read_pids(run_dir) == {}  # everything stopped
