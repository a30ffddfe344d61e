"""tests/gpu/check.sh in its CPU mode: the GPU check's whole pipeline on the tiny model.

``tests/gpu/check.sh --device cpu --tiny`` runs what the GPU check runs (a real dataflow service,
vLLM, Lightning M2PO steps with the production WeightPublisher, the RaaS WeightSync refresh into
vLLM) with the tiny model on CPU, and prints one JSON line. ``--engine hf`` runs it with the
transformers engine instead (what the check falls back to on a machine without vLLM);
``--strategy fsdp2`` trains under Lightning's ``ModelParallelStrategy`` (FSDP2, the GPU default;
one gloo rank here). The assertions are on its structure
and on values that hold on any machine (no timings are compared with anything).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "check.sh"
HEADLINE = ("engine", "throughput_tokens_per_s", "refresh_pause_s", "refresh_full_pause_s",
            "delta_sparsity", "delta_compression", "steps_s", "timings")
STAGES = ("build_model", "dataflow_start", "engine_start", "generate", "train", "teardown")


def test_script_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.parametrize("engine,strategy", [("vllm", None), ("hf", None), ("hf", "fsdp2")])
def test_cpu_tiny_mode_reports_every_figure(engine, strategy):
    extra = ["--strategy", strategy] if strategy else []
    out = subprocess.run([str(SCRIPT), "--device", "cpu", "--tiny", "--engine", engine,
                          "--hf-batch-size", "8", *extra], capture_output=True, text=True,
                         timeout=400, cwd=ROOT)
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one JSON line, got:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    report = json.loads(lines[0])
    model = report["models"]["tiny"]
    assert out.returncode == 0 and report["ok"], (model.get("error"), model.get("trace"),
                                                  out.stderr[-4000:])
    for key in HEADLINE:
        assert report[key] is not None, key
    assert report["model"] == "tiny" and report["device"] == "cpu"
    assert report["engine"] == model["engine"] == engine

    # throughput: every rollout generated tokens
    assert report["throughput_tokens_per_s"] > 0
    assert model["generated_sequences"] == 32 and model["generated_tokens"] >= 32

    # three M2PO steps, each timed; version 1 full, then deltas onto the previous version
    assert len(report["steps_s"]) == 3 and all(s > 0 for s in report["steps_s"])
    published = model["published"]
    assert [p["version"] for p in published] == [1, 2, 3]
    assert [p["kind"] for p in published] == ["full", "delta", "delta"]
    assert [p["base_version"] for p in published[1:]] == [1, 2]
    assert 0.0 <= report["delta_sparsity"] < 1.0      # the steps changed some weights ...
    assert report["delta_compression"] > 1.0          # ... and a delta is smaller than a full
    assert all(p["bytes"] < published[0]["bytes"] for p in published[1:])

    # the RaaS refresh: full route into the engine first, then deltas pushing only what changed,
    # each verified bit for bit against the engine's weights
    refreshes = model["refreshes"]
    assert [r["route"] for r in refreshes] == ["full", "delta", "delta"]
    assert [r["engine_version"] for r in refreshes] == [1, 2, 3]
    assert all(r["error"] is None and r["verified_tensors"] > 0 for r in refreshes)
    assert refreshes[0]["tensors_pushed"] == refreshes[0]["tensors_total"]
    assert all(0 < r["tensors_pushed"] < r["tensors_total"] for r in refreshes[1:])  # partial
    assert report["refresh_pause_s"] >= 0 and report["refresh_full_pause_s"] >= 0
    assert model["refresh_verified"] is True

    # per-stage timings, and the M2PO metrics of the last step
    assert set(STAGES) <= set(report["timings"]) and all(v >= 0 for v in report["timings"].values())
    metrics = model["train_metrics"]
    assert {"train/m2_before", "train/masked_fraction", "train/kl_k3"} <= set(metrics)
    assert model["train_settings"] == {"strategy": strategy or "auto", "kl_coef": 0.001}
    assert "train_errors" not in model  # the first attempt trained (no fallback)

    # the LoRA stage: adapter steps under the same strategy, version 1 full then a delta, each
    # manifest read back naming adapter tensors only
    lora = model["lora"]
    assert lora["ok"] is True, (lora.get("error"), lora.get("trace"))
    assert lora["settings"]["strategy"] == (strategy or "auto")
    assert [p["kind"] for p in lora["published"]] == ["full", "delta"]
    assert [m["version"] for m in lora["manifests"]] == [1, 2]
    assert lora["published"][1]["bytes"] < lora["published"][0]["bytes"]
    assert lora["published"][0]["bytes"] < published[0]["bytes"]  # an adapter, not the model
