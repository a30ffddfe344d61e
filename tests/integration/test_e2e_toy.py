"""The embedded default learns: ``astralight run`` on the toy recipe, unchanged, end to end.

Real processes on 127.0.0.1 (dataflow service, vLLM RaaS, Lightning trainer), real SQLite, the
recipe exactly as a newcomer runs it. Slow (about 10 minutes on two CPU cores): marked ``slow``,
run by ``.ci/run`` after the default suite.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from astralight.launch import _default_recipe

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SUMMARY_KEYS = ("eval_accuracy_start", "eval_accuracy_end", "versions", "samples_trained", "wall_s")


def test_toy_recipe_improves_heldout_accuracy(tmp_path):
    recipe = yaml.safe_load(_default_recipe().read_text())
    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", "--run-dir",
                           str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(proc.stdout[-3000:])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())  # the full record
    for key in SUMMARY_KEYS:
        assert key in summary and summary[key] is not None, f"{key} missing from {summary}"

    assert summary["versions"] == recipe["stop"]["versions"]
    batch = recipe["trainers"][0]["data"]["init_args"]["batch_size"]
    assert summary["samples_trained"] == recipe["stop"]["versions"] * batch
    start, end = summary["eval_accuracy_start"], summary["eval_accuracy_end"]
    # version 0 is the warm-started policy before any RL update
    assert start <= 0.40, summary
    assert end - start >= 0.20, f"RL did not improve held-out accuracy by 20 points: {summary}"
