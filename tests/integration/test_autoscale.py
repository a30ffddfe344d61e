"""The autoscaler against the real dataflow service and real RaaS processes (vLLM on CPU).

A fake trainer (pull, ack with chosen wait/step times, publish the next version) drives the
balance report. The autoscaler (in this process, its loop stepped by the test) starts real
``astralight.cli raas serve`` processes through :class:`LocalProcessBackend`:

1. the trainer reports waiting 75% of its steps: the report asks for ceil(1 / 0.25) = 4
   instances, the autoscaler launches one more (clamped to max_instances 2), which registers
   and pushes samples;
2. the trainer then waits 0% and consumes a fraction of what is accepted (the rest goes stale):
   the report asks to scale down, the autoscaler drains the least productive instance, which
   finishes, deregisters (state "left") and exits 0;
3. on shutdown the autoscaler drains the last one; every instance it started ends "left".
"""

from __future__ import annotations

import time

import pytest
import yaml

from astralight.autoscale.backends import LocalProcessBackend
from astralight.autoscale.policy import Policy, PolicyConfig
from astralight.autoscale.service import AutoscaleConfig, Autoscaler
from astralight.dataflow.client import DataflowClient
from astralight.weights.artifacts import ArtifactBuilder

pytestmark = pytest.mark.vllm

BATCH = 8
EVERY = 2


def raas_config(model_dir) -> dict:
    return {
        "engines": {"policy": {"model_path": str(model_dir), "dtype": "bfloat16",
                               "max_model_len": 128, "kv_cache_memory_bytes": 64 << 20}},
        "workflow": {"class_path": "astralight.workflows.single_turn.SingleTurnWorkflow",
                     "init_args": {"reward": {"class_path": "astralight.rewards.toy.ExactMatchReward"},
                                   "sampling": {"temperature": 1.0, "max_tokens": 3}}},
        "max_concurrency": 4, "poll_interval_s": 0.05, "weight_check_interval_s": 0.1,
        "heartbeat_interval_s": 0.5, "progress_interval_s": 5.0, "seed": 0,
    }


class FakeTrainer:
    """Pulls a batch, acks it with the wait and step times the test chooses, publishes the next
    version (the same weights: what matters here is the version count and the timings)."""

    def __init__(self, client: DataflowClient):
        from astralight.trainer.tinymodel import TinyModelSpec, build_model

        self.client = client
        self.builder = ArtifactBuilder("policy", full_every=0)
        self.state = {k: v.detach().clone()
                      for k, v in build_model(TinyModelSpec(seed=0)).state_dict().items()}
        self.version = 0

    def step(self, wait_s: float, step_s: float, between=lambda: None) -> None:
        batch = None
        deadline = time.monotonic() + 180
        while batch is None:
            assert time.monotonic() < deadline, "no batch within 180 s"
            batch = self.client.pull_batch("policy", BATCH, timeout_s=2.0)
            between()
        self.client.ack(batch.batch_id, wait_s=wait_s, step_s=step_s)
        self.version += 1
        art = self.builder.build(self.version, self.state)
        for name, data in art.files.items():
            self.client.upload_weight_file("policy", self.version, name, data)
        self.client.publish(art.manifest)


def rows(client) -> dict[str, dict]:
    return {r["instance_id"]: r for r in client.stats()["instances"]}


@pytest.mark.slow  # 45-75 s of real processes: CI runs it in its slow suite
def test_autoscaler_scales_up_then_drains_the_least_productive(tmp_path, tiny_model_dir,
                                                               dataflow_service):
    # max_staleness 0: every publication drops what is buffered, so a trainer that consumes
    # slowly sees far more accepted than it consumes
    svc = dataflow_service(tmp_path, group_size=2, max_inflight_tasks=16, max_buffered_samples=32,
                           lease_seconds=30, max_staleness=0)
    cfg_path = tmp_path / "raas.yaml"
    cfg_path.write_text(yaml.safe_dump(raas_config(tiny_model_dir)))
    client = DataflowClient(svc.url, retry_s=30)
    backend = LocalProcessBackend(cfg_path, svc.url, tmp_path / "logs", drain_timeout_s=90,
                                  kill_after_s=15)
    scaler = Autoscaler(Policy(PolicyConfig(min_instances=1, max_instances=2, cooldown_s=0)),
                        backend, client,
                        AutoscaleConfig(model_id="policy", every=EVERY, initial=1,
                                        decisions_log=str(tmp_path / "decisions.jsonl")))
    trainer = FakeTrainer(client)
    pool_sizes = []

    def poll():
        scaler.step()
        pool_sizes.append(len(scaler.managed))

    def wait_until(predicate, what, timeout=180):
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                               for p in sorted((tmp_path / "logs").glob("*.log")))
                raise AssertionError(f"timed out waiting for {what}; decisions "
                                     f"{[d['action'] for d in scaler.decisions]}{logs}")
            poll()
            time.sleep(0.3)

    try:
        scaler.start()
        assert list(scaler.managed) == ["auto-0"]

        # 1. a starving trainer: scale up, clamped to max_instances
        for _ in range(EVERY):
            trainer.step(wait_s=0.75, step_s=1.0, between=poll)
        poll()
        up = scaler.decisions[-1]
        assert up["action"] == "scale_up", scaler.decisions
        assert up["report"]["target"] == 4 and up["target"] == 2  # ceil(1 / (1 - 0.75)), clamped
        assert "clamped to max_instances 2" in up["reason"]
        assert up["launched"] == ["auto-1"]
        # the trainer goes on (the buffer is full until it consumes) until auto-1 contributes
        deadline = time.monotonic() + 120
        while rows(client).get("auto-1", {}).get("samples_pushed", 0) == 0:
            assert time.monotonic() < deadline, "auto-1 did not push within 120 s"
            trainer.step(wait_s=0.75, step_s=1.0, between=poll)
            poll()
        assert rows(client)["auto-1"]["status"] == "healthy"
        assert all(d["action"] == "hold" and "clamped to max_instances 2" in d["reason"]
                   for d in scaler.decisions[3:])  # at the bound: hold

        # 2. an overfed trainer: waits 0%, consumes BATCH of ~32 accepted per version
        def slow_consumer():
            time.sleep(2.0)  # the buffer fills; the publication then drops it as stale
            trainer.step(wait_s=0.0, step_s=1.0, between=poll)

        n_up, v_up = len(scaler.decisions), trainer.version
        while len(scaler.decisions) == n_up or scaler.decisions[-1]["action"] == "hold":
            assert trainer.version < v_up + 3 * EVERY, scaler.decisions[n_up:]
            slow_consumer()
            poll()
        down = scaler.decisions[-1]
        assert down["action"] == "scale_down", scaler.decisions[n_up:]
        assert down["report"]["wait_fraction"] == 0.0 and down["target"] == 1
        (retired,) = down["retire"]
        # the least productive of the pool the policy saw (ties: the newer)
        members = {m["instance_id"]: m for m in down["members"]}
        assert set(members) == {"auto-0", "auto-1"}
        other = ({"auto-0", "auto-1"} - {retired}).pop()
        assert members[retired]["samples_per_s"] <= members[other]["samples_per_s"]
        wait_until(lambda: not backend.alive(retired), f"{retired} to drain and exit", timeout=120)
        backend.retirements[retired].join(30)
        poll()
        assert backend.returncode(retired) == 0
        row = rows(client)[retired]
        assert row["state"] == "left" and row["in_flight"] == 0
        assert backend.events[0]["instance_id"] == retired and backend.events[0]["how"] == "drained"
        assert list(scaler.managed) == [other] and scaler.retired == [retired]

        # the other one keeps serving the trainer alone
        trainer.step(wait_s=0.0, step_s=1.0, between=poll)
        poll()
    finally:
        scaler.shutdown()
        client_rows = rows(client)
        client.close()

    # 3. shutdown drained the last one; bounds held throughout
    assert scaler.decisions[-1]["action"] == "shutdown" and scaler.decisions[-1]["retire"] == [other]
    assert all(not backend.alive(i) for i in ("auto-0", "auto-1"))
    assert backend.returncode(other) == 0
    assert {i: client_rows[i]["state"] for i in ("auto-0", "auto-1")} == {"auto-0": "left",
                                                                         "auto-1": "left"}
    assert max(pool_sizes) <= 2 and min(pool_sizes) >= 1
    assert all(1 <= d["target"] <= 2 for d in scaler.decisions if d["action"] != "shutdown")
    assert [d["action"] for d in scaler.decisions if d["action"] != "hold"] == \
        ["initial", "scale_up", "scale_down", "shutdown"]


@pytest.mark.slow  # 45-75 s of real processes: CI runs it in its slow suite
def test_launcher_runs_an_autoscaled_recipe(tmp_path):
    """``astralight run`` with ``autoscale:``: the autoscaler, not a fixed RaaS list, starts the
    instances; the run completes and its summary carries the pool history and capacity figures."""
    import copy
    import json
    import subprocess
    import sys
    from pathlib import Path

    from astralight.launch.recipe import load_recipe

    base_path = Path(__file__).resolve().parents[2] / "configs" / "toy" / "autoscale.yaml"
    trainers = copy.deepcopy(load_recipe(base_path)["trainers"])
    trainers[0]["trainer"]["max_steps"] = 6
    trainers[0]["data"]["init_args"]["batch_size"] = 64
    recipe = {"extends": str(base_path), "name": "autoscale-short",
              "prepare": {"kwargs": {"sft_steps": 20}},
              "stop": {"versions": 6, "timeout_s": 480, "progress_every_s": 5},
              "dataflow": {"eval": {"every": 6, "k": 2, "source": {"init_args": {"eval_size": 16}}}},
              "autoscale": {"every": 2, "cooldown_s": 5, "max_instances": 2},
              "trainers": trainers}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", str(path), "--run-dir",
                           str(run_dir)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())  # the full record
    assert summary["versions"] == 6 and summary["eval_accuracy_end"] is not None

    # the autoscaler started the pool; no fixed RaaS ran
    assert not (run_dir / "logs" / "raas-0.log").exists()
    assert (run_dir / "configs" / "raas-template.yaml").exists()
    assert (run_dir / "logs" / "auto-0.log").stat().st_size > 0
    pool = summary["pool"]
    assert pool[0]["action"] == "initial" and pool[0]["launched"] == ["auto-0"]
    assert all(1 <= p["target"] <= 2 for p in pool)
    assert summary["rollout_capacity_seconds"] > 0 and summary["trainer_seconds"] > 0

    # on stop it retired every instance it had started, and each one exited
    decisions = [json.loads(x) for x in (run_dir / "autoscale.jsonl").read_text().splitlines()]
    launched = [i for d in decisions for i in d["launched"]]
    assert decisions[-1]["action"] == "shutdown" and sorted(decisions[-1]["retire"]) == sorted(launched)
    log = (run_dir / "logs" / "autoscale.log").read_text()
    for iid in launched:
        assert f"{iid}: stopped (" in log
