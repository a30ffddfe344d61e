"""``astralight run`` stopped by its time budget (``stop.max_wall_s``) on a real shortened toy run,
a time-only run (no ``stop.versions``, no ``max_steps``): the progress line shows no target and
the budget's ETA; the trainer gets SIGTERM and ends its fit as at ``max_steps`` (the last checkpoint at its last
step), the last version is evaluated although it is no multiple of ``eval.every``, and the
summary is written with ``stop_reason`` -- exit 0.

Where the budget ends is not known in advance, so every check is stated in terms of the version
the run stopped at (read from the summary).
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

BUDGET_S = 240  # prepare, vLLM and the trainer start well within it on 2 cores


def test_a_time_budget_stops_the_run_with_a_last_checkpoint_and_eval(tmp_path):
    path = shortened_toy_recipe(tmp_path)
    recipe = yaml.safe_load(path.read_text())
    del recipe["stop"]["versions"], recipe["trainers"][0]["trainer"]["max_steps"]  # time only
    recipe["stop"].update(max_wall_s=BUDGET_S, timeout_s=BUDGET_S + 600, final_eval_timeout_s=120)
    recipe["dataflow"]["eval"]["every"] = 1_000_000  # only version 0 is evaluated on schedule
    path.write_text(yaml.safe_dump(recipe))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", str(path),
                           "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "max_wall_s", summary["stop"]
    last = summary["versions"]
    assert last > 0, f"the budget ended before training started: {summary['stop']}"
    # the last version was evaluated on request, the summary's end accuracy is its
    assert summary["eval_version_end"] == last
    assert summary["eval_accuracy_end"] is not None and summary["stop"]["final_eval_complete"]
    assert summary["eval_versions"] == [0, last]
    # the trainer stopped politely: its last checkpoint is the last step (one version per step)
    ckpt = torch.load(run_dir / "checkpoints" / "policy" / "last.ckpt", map_location="cpu",
                      weights_only=False)
    assert ckpt["global_step"] == last
    trainer_log = (run_dir / "logs" / "trainer-policy.log").read_text(errors="replace")
    assert "SIGTERM: finishing the current step" in trainer_log
    launch_log = (run_dir / "launch.log").read_text()
    assert "restarting" not in launch_log
    # progress lines: the version without a placeholder target, the budget's ETA named
    lines = [line for line in launch_log.splitlines() if "] version " in line]
    assert lines and all("/" not in line.split("|")[0] for line in lines), lines[:3]
    assert any("(max_wall_s)" in line for line in lines), lines[-3:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["stop_reason"] == "max_wall_s"
