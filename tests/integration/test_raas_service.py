"""The RaaS service process against the real dataflow service on loopback.

`python -m astralight.raas.service --dataflow URL --config raas.yaml` must: announce readiness,
lease and push samples the dataflow accepts, pick up a published weight version (full, then a
delta) and tag later tokens with it, and on SIGTERM finish its cycle and exit 0.
Run with the transformers test engine and with real vLLM on CPU (marked ``vllm``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import yaml

from astralight.dataflow.client import DataflowClient
from astralight.weights.artifacts import ArtifactBuilder


def _engine_config(kind, model_dir):
    if kind == "hf":
        return {"class_path": "astralight.raas.hf_engine.HFEngine",
                "init_args": {"model_path": str(model_dir)}}
    return {"model_path": str(model_dir), "dtype": "bfloat16", "max_model_len": 128,
            "kv_cache_memory_bytes": 64 << 20}


def _state(seed, sharpen=4.0):
    from astralight.trainer.tinymodel import TinyModelSpec, build_model

    sd = {k: v.detach().clone() for k, v in build_model(TinyModelSpec(seed=seed)).state_dict().items()}
    sd["lm_head.weight"] *= sharpen
    return sd


def _publish(client, builder, version, state):
    art = builder.build(version, state)
    for name, data in art.files.items():
        client.upload_weight_file("policy", version, name, data)
    client.publish(art.manifest)
    return art.manifest


def _wait_for(predicate, what, proc, log_path, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                   for p in sorted(log_path.parent.glob("*.log")))
    raise AssertionError(f"timed out waiting for {what} (raas rc={proc.poll()}):{logs}")


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_raas_serves_refreshes_weights_and_stops_cleanly(kind, tmp_path, tiny_model_dir,
                                                         dataflow_service):
    svc = dataflow_service(tmp_path, group_size=2, max_inflight_tasks=8, max_buffered_samples=32,
                           lease_seconds=30)
    config = {
        "engines": {"policy": _engine_config(kind, tiny_model_dir)},
        "workflow": {"class_path": "astralight.workflows.single_turn.SingleTurnWorkflow",
                     "init_args": {"reward": {"class_path": "astralight.rewards.toy.ExactMatchReward"},
                                   "sampling": {"temperature": 1.0, "max_tokens": 3}}},
        "max_concurrency": 4, "poll_interval_s": 0.05, "weight_check_interval_s": 0.1,
        "progress_interval_s": 0.2, "seed": 0,
    }
    cfg_path = tmp_path / "raas.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "raas.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "astralight.raas.service", "--dataflow",
                                 svc.url, "--config", str(cfg_path)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    client = DataflowClient(svc.url, retry_s=5)
    try:
        text = lambda: log_path.read_text(errors="replace")  # noqa: E731
        _wait_for(lambda: "raas ready" in text(), "raas ready", proc, log_path)

        # samples of the initial model (version 0) arrive and are well formed
        batch = _wait_for(lambda: client.pull_batch("policy", 4, timeout_s=1.0), "a batch", proc,
                          log_path)
        for s in batch.samples:
            p = s.prompt_len
            assert s.loss_mask[:p].sum() == 0 and s.loss_mask[p:].all()
            assert (s.versions[:p] == -1).all() and (s.versions[p:] == 0).all()
            assert s.metadata["temperature"] == 1.0
        client.ack(batch.batch_id)

        # publish v1 (full) and v2 (delta); later samples carry version 2 on every generated token
        builder = ArtifactBuilder("policy", full_every=10)
        assert _publish(client, builder, 1, _state(1)).kind == "full"
        assert _publish(client, builder, 2, _state(2)).kind == "delta"

        def newest_samples():
            b = client.pull_batch("policy", 2, timeout_s=1.0)
            if b is None:
                return None
            client.ack(b.batch_id)
            fresh = [s for s in b.samples if s.min_version == 2]
            return fresh or None

        fresh = _wait_for(newest_samples, "samples of version 2", proc, log_path)
        for s in fresh:
            assert (s.versions[s.prompt_len:] == 2).all()
        _wait_for(lambda: "policy=v2" in text(), "progress line with v2", proc, log_path)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, text()[-4000:]
        out = text()
        assert "raas stopping" in out
        lines = out.splitlines()
        progress = [line for line in lines if line.startswith("[raas")]
        print(f"\n{kind}: {next(line for line in lines if 'raas ready' in line)}\n{kind}: {progress[-1]}")
        assert "refreshes" in progress[-1] and "errors wf=0 push=0" in progress[-1]
        stats = client.stats()
        assert stats["models"]["policy"]["samples_accepted"] > 0
        assert stats["models"]["policy"]["current_version"] == 2
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
