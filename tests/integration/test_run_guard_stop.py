"""The run guard on a real run (issue 37): a shortened toy run whose reward falls to 0 after its
first rollouts (a reward plugin that stops paying, loaded by import path) is caught from the
trainer's own TensorBoard curve, warned about, and -- with ``guard.stop: true`` -- stopped through
the usual stop sequence: ``stop_reason: guard``, the event in ``summary.json`` and the warning in
the last line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.integration.recipes import shortened_toy_recipe

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VERSIONS = 400  # never reached: the guard stops the run first

FALLING_REWARD = '''
"""Pays 1.0 for the first rewards it gives, then nothing: a train reward that collapses."""
from astralight.rewards.base import Reward


class FallingReward(Reward):
    cheap = True

    def __init__(self, paid: int = 300):
        self.left = paid

    def __call__(self, completion, metadata):
        self.left -= 1
        return 1.0 if self.left >= 0 else 0.0
'''


def test_a_collapsing_reward_is_caught_and_stops_the_run(tmp_path):
    path = shortened_toy_recipe(tmp_path, versions=VERSIONS)
    (tmp_path / "falling_reward.py").write_text(FALLING_REWARD)
    recipe = yaml.safe_load(path.read_text())
    recipe["pythonpath"] = ["."]
    recipe["raas"][0]["workflow"]["init_args"]["reward"] = {
        "class_path": "falling_reward.FallingReward", "init_args": {"paid": 300}}
    # the eval would see the fall too (its first eval is paid, the next not); off here, so the
    # train curve read from the trainer's TensorBoard is what must catch it
    recipe["guard"] = {"window": 3, "stop": True, "eval_drop": None}
    recipe["stop"].update(timeout_s=900, final_eval_timeout_s=120, progress_every_s=2)
    path.write_text(yaml.safe_dump(recipe))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "astralight.cli", "run", str(path),
                           "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "guard", summary["stop"]
    # the guard fires as soon as the windowed mean falls past half the best, which may be before
    # it reaches 0 (how far depends on how the steps' rollouts straddle the reward's cut-off)
    detail = re.fullmatch(r"guard\.stop: train reward fell to ([0-9.]+) \(mean of the last 3 "
                          r"steps\) from its best ([0-9.]+) \(more than guard\.reward_drop=0\.5 "
                          r"of the best\)", summary["stop"]["detail"])
    assert detail, summary["stop"]["detail"]
    fell_to, best = float(detail[1]), float(detail[2])
    assert best == 1.0 and fell_to < 0.5 * best, detail[0]
    assert 0 < summary["versions"] < VERSIONS
    drops = [e for e in summary["guard_events"] if (e["kind"], e["source"]) == ("reward_drop", "policy")]
    assert drops and drops[0]["value"] < drops[0]["threshold"] == 0.5, summary["guard_events"]
    assert "[guard] WARNING policy: train reward fell" in proc.stdout
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["stop_reason"] == "guard" and "reward_drop (policy)" in last["warnings"]
