"""``BestEvalCheckpoint`` in a full run (issue 37): a shortened toy run with the callback among the
trainer's callbacks, as docs/how-to/logging.md shows it, then ``astralight export`` of what it
kept.

Checked: ``best.json`` names the best complete evaluation among the versions the trainer saved
(those of the dataflow's ``eval.every``, and the last one; the earliest of equals), with that
evaluation's avg@k as the dataflow reported it in ``summary.json``; ``best.ckpt`` is the
checkpoint of that version's step; no pending ``version=V.ckpt`` is left (not for the last
version, whose evaluation comes after training, nor for a version the publisher skipped); and the
kept checkpoint exports to a model folder that loads. The first run of this test found both of
those left behind and no ``best.ckpt`` at all.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from tests.integration.recipes import shortened_toy_recipe

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VERSIONS = 8
EVERY = 2


def test_the_best_evaluated_version_is_kept_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    path = shortened_toy_recipe(tmp_path, versions=VERSIONS)
    recipe = yaml.safe_load(path.read_text())
    recipe["dataflow"]["eval"]["every"] = EVERY
    recipe["trainers"][0]["trainer"]["callbacks"].append({
        "class_path": "astralight.callbacks.BestEvalCheckpoint",
        "init_args": {"dirpath": "{run_dir}/checkpoints/policy-best", "every_n_steps": 1}})
    path.write_text(yaml.safe_dump(recipe))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", str(path),
                           "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "versions" and summary["versions"] == VERSIONS, summary

    evals = {int(v): e["avg_at_k"] for v, e in summary["eval"].items()}
    # the callback saves the versions of eval.every and the last; a version the publisher
    # skipped (a fast trainer: it publishes only its newest snapshot) is never evaluated
    saved = sorted(v for v in evals if v > 0 and (v % EVERY == 0 or v == VERSIONS))
    assert VERSIONS in saved, sorted(evals)  # the last version is always evaluated
    best_version = max(saved, key=lambda v: (evals[v], -v))
    folder = run_dir / "checkpoints" / "policy-best"
    best = json.loads((folder / "best.json").read_text())
    print(json.dumps({"evals": evals, "best": best}))
    assert best == {"version": best_version, "avg_at_k": evals[best_version]}, (best, evals)
    assert sorted(p.name for p in folder.iterdir()) == ["best.ckpt", "best.json"]
    ckpt = torch.load(folder / "best.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == best_version  # one step per version (WeightPublisher every 1)

    out = tmp_path / "exported"
    exported = subprocess.run([sys.executable, "-m", "astralight.cli", "export",
                               str(folder / "best.ckpt"), "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stdout[-2000:] + exported.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0
