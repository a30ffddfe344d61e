"""Pool membership with real processes: the dataflow service, vLLM RaaS instances on the tiny
model and a trainer-side client that pulls and acks everything.

One run, several RaaS processes (each start-up costs a vLLM warm-up, so scenarios share them):

* instance ``a`` is SIGKILLed holding leases: after ``lease_seconds`` its tasks are re-issued to
  the others, every one is done, and the trainer never sees a sample twice;
* instance ``h`` (a transformers engine: cheap to start) gets SIGTERM, then SIGTERM again while
  its cycle is still busy: it returns what it holds, deregisters, and exits 130 at once;
* instance ``b`` is started mid-run and pushes in its first lease cycle;
* instance ``c`` (episodes in flight, slowed by ``cycle_delay_s``) gets SIGTERM: it finishes its
  episodes, holds nothing, deregisters ("left") and exits 0;
* the dataflow is restarted on the same port, on its state folder and then on a fresh one:
  ``b`` rejoins each time (registering again under its id on the fresh one) and pushes again,
  never restarted; finally ``b`` is drained through the dataflow's route and exits 0.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from astralight.dataflow.client import DataflowClient
from tests.conftest import free_port

pytestmark = pytest.mark.vllm

LEASE_S = 4.0


def _vllm(model_dir):
    return {"model_path": str(model_dir), "dtype": "bfloat16", "max_model_len": 128,
            "kv_cache_memory_bytes": 64 << 20}


def _hf(model_dir):
    return {"class_path": "astralight.raas.hf_engine.HFEngine",
            "init_args": {"model_path": str(model_dir)}}


def _start_raas(tmp_path: Path, url: str, name: str, engine: dict, **overrides):
    config = {
        "engines": {"policy": engine},
        "workflow": {"class_path": "astralight.workflows.single_turn.SingleTurnWorkflow",
                     "init_args": {"reward": {"class_path":
                                              "astralight.rewards.toy.ExactMatchReward"},
                                   "sampling": {"temperature": 1.0, "max_tokens": 3}}},
        "instance_id": f"raas-{name}", "max_concurrency": 4, "poll_interval_s": 0.05,
        "weight_check_interval_s": 1.0, "progress_interval_s": 2.0, "seed": 0, **overrides,
    }
    cfg_path = tmp_path / f"raas-{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / f"raas-{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "astralight.raas.service", "--dataflow", url,
                                 "--config", str(cfg_path)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    return proc, log_path


class Trainer(threading.Thread):
    """Pulls and acks everything it can; records (task_id, model_id, sample_index) per sample."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.client = DataflowClient(url, retry_s=30)
        self.keys: list[tuple] = []
        self.halt = threading.Event()
        self.error: BaseException | None = None
        self.start()

    def run(self):
        try:
            while not self.halt.is_set():
                batch = self.client.pull_batch("policy", 2, timeout_s=0.3)
                if batch is None:
                    continue
                self.keys += [(s.task_id, s.model_id, s.sample_index) for s in batch.samples]
                self.client.ack(batch.batch_id)
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def stop(self) -> list[tuple]:
        self.halt.set()
        self.join(timeout=60)
        self.client.close()
        assert self.error is None, f"trainer failed: {self.error!r}"
        return self.keys


def _rows(db: Path, sql: str, *args) -> list:
    conn = sqlite3.connect(str(db), timeout=10)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def _instance(client: DataflowClient, instance_id: str) -> dict | None:
    return next((r for r in client.stats()["instances"] if r["instance_id"] == instance_id), None)


@pytest.fixture
def watch(tmp_path):
    """``watch(predicate, what, *procs, timeout)``: poll until truthy; on failure dump the logs."""
    def wait(predicate, what, *procs, timeout=90.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.1)
        logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                       for p in sorted(tmp_path.glob("*.log")))
        raise AssertionError(f"timed out waiting for {what} "
                             f"(rc={[p.poll() for p in procs]}):{logs}")
    return wait


@pytest.mark.slow  # 45-75 s of real processes: CI runs it in its slow suite
def test_kill_join_drain_and_rejoin(tmp_path, tiny_model_dir, dataflow_service, watch):
    port = free_port()
    flow_cfg = dict(port=port, group_size=2, lease_seconds=LEASE_S, max_inflight_tasks=32,
                    max_buffered_samples=64)
    svc = dataflow_service(tmp_path, state_dir=str(tmp_path / "s1"), **flow_cfg)
    db1 = tmp_path / "s1" / "dataflow.db"
    client = DataflowClient(svc.url, retry_s=30)
    trainer = Trainer(svc.url)
    procs: list[subprocess.Popen] = []
    try:
        text = lambda p: p.read_text(errors="replace")  # noqa: E731
        held = lambda iid: [r[0] for r in _rows(  # noqa: E731
            db1, "SELECT task_id FROM tasks WHERE instance_id=? AND state='leased'", iid)]

        # ---- a (never pushes: a 600 s delay), c (slowed), h (transformers engine)
        a, a_log = _start_raas(tmp_path, svc.url, "a", _vllm(tiny_model_dir), cycle_delay_s=600.0)
        c, c_log = _start_raas(tmp_path, svc.url, "c", _vllm(tiny_model_dir), cycle_delay_s=1.0,
                               push_concurrency=4)
        h, h_log = _start_raas(tmp_path, svc.url, "h", _hf(tiny_model_dir), cycle_delay_s=600.0)
        procs += [a, c, h]

        # ---- a: SIGKILL while it holds leases (generating, or sleeping before its push);
        # ---- h: SIGTERM (a drain that would wait out its delay), then SIGTERM again.
        # Both act on a lease within its 4 s (a 600 s delay outlasts it: after the deadline
        # the dataflow re-issues the tasks by itself), so they are watched together.
        seen: dict[str, list] = {}

        def act():
            if "a" not in seen and (tasks := held("raas-a")):
                a.kill()
                seen["a"] = tasks
            if "h" not in seen and (tasks := held("raas-h")):
                time.sleep(0.3)  # the lease reply reaches h: its cycle has started
                h.send_signal(signal.SIGTERM)
                watch(lambda: "raas stopping" in text(h_log), "h draining", h, timeout=10)
                h.send_signal(signal.SIGTERM)
                seen["h"] = tasks
            return len(seen) == 2

        watch(act, "a and h holding leases", a)  # (h exits on its own)
        a_tasks, h_tasks = seen["a"], seen["h"]
        assert a.wait(timeout=30) == -signal.SIGKILL
        assert h.wait(timeout=30) == 130
        assert "raas hard stop" in text(h_log) and "raas left the pool" in text(h_log)
        row = _instance(client, "raas-h")
        assert row["state"] == "left" and row["in_flight"] == 0
        assert row["tasks_returned"] >= len(h_tasks) and not held("raas-h")

        # ---- b joins mid-run and pushes in its first lease cycle
        b, b_log = _start_raas(tmp_path, svc.url, "b", _vllm(tiny_model_dir),
                               push_concurrency=4)
        procs.append(b)
        first = watch(lambda: [ln for ln in text(b_log).splitlines()
                               if "raas first push" in ln], "b's first push", b)
        # leasing follows free slots (a lease may come back empty while the others hold every
        # task): the first push comes from one of its first leases that brought tasks
        granted = int(first[0].split("(")[1].split(" with tasks")[0])
        assert granted <= 2, first[0]
        print(f"\nb: {first[0].split('raas ')[-1]}")

        # ---- a's tasks: re-issued after their lease expired, done by someone else
        done = lambda: all(r[0] == "done" for r in _rows(  # noqa: E731
            db1, f"SELECT state FROM tasks WHERE task_id IN ({','.join('?' * len(a_tasks))})",
            *a_tasks))
        watch(done, "a's tasks done elsewhere", b, c)
        owners = {r[0] for r in _rows(
            db1, f"SELECT instance_id FROM tasks WHERE task_id IN ({','.join('?' * len(a_tasks))})",
            *a_tasks)}
        assert "raas-a" not in owners
        assert client.stats()["models"]["policy"]["tasks_reissued"] >= len(a_tasks)

        # ---- c: SIGTERM drains (episodes in flight finish and push), deregisters, exits 0
        watch(lambda: held("raas-c"), "raas-c holding leases", c)
        c.send_signal(signal.SIGTERM)
        assert c.wait(timeout=60) == 0
        assert "raas left the pool" in text(c_log) and "hard stop" not in text(c_log)
        row = _instance(client, "raas-c")
        assert row["state"] == "left" and row["in_flight"] == 0 and not held("raas-c")
        # every lease it took ended in a push, a return, or (a slow cycle) an expiry
        ended = row["tasks_done"] + row["tasks_returned"] + row["tasks_failed"]
        assert row["tasks_leased"] <= ended

        # every task a held reaches the trainer, and no sample is served twice
        watch(lambda: set(a_tasks) <= {k[0] for k in trainer.keys}, "a's tasks trained", b)
        keys = trainer.stop()

        # ---- restart the dataflow on the same port and state: b pushes again, unrestarted
        before = _instance(client, "raas-b")["samples_pushed"]
        svc.proc.terminate()
        assert svc.proc.wait(timeout=30) == 0
        svc = dataflow_service(tmp_path, state_dir=str(tmp_path / "s1"), **flow_cfg)
        trainer = Trainer(svc.url)  # (none across the restart: no ack is in the air)
        watch(lambda: _instance(client, "raas-b")["samples_pushed"] > before,
              "b pushing to the restarted dataflow", b)
        keys += trainer.stop()
        dup = [k for k, n in Counter(keys).items() if n > 1]
        assert keys and not dup, f"samples served twice: {dup[:5]}"

        # ---- restart on a fresh state: b registers again under its id and pushes again
        svc.proc.terminate()
        assert svc.proc.wait(timeout=30) == 0
        svc = dataflow_service(tmp_path, state_dir=str(tmp_path / "s2"), **flow_cfg)
        fresh = lambda: (_instance(client, "raas-b") or {}).get("samples_pushed", 0)  # noqa: E731
        watch(lambda: fresh() > 0, "b pushing to the fresh dataflow", b)
        assert "registered again as raas-b" in text(b_log)
        assert _instance(client, "raas-b")["state"] == "active"

        # ---- drain b through the route: it finishes, deregisters, exits 0
        reply = client.drain("raas-b")
        assert reply["instance_id"] == "raas-b" and reply["state"] == "draining"
        assert b.wait(timeout=60) == 0
        out = text(b_log)
        assert "the dataflow's drain route" in out and "raas left the pool" in out
        row = _instance(client, "raas-b")
        assert row["state"] == "left" and row["in_flight"] == 0
        assert not _rows(tmp_path / "s2" / "dataflow.db",
                         "SELECT task_id FROM tasks WHERE instance_id='raas-b' AND state='leased'")
        progress = [ln for ln in out.splitlines() if ln.startswith("[raas")][-1]
        print(f"b: {progress}")
        assert "errors wf=0 push=0" in progress
    finally:
        trainer.halt.set()
        client.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
