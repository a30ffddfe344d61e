"""``astralight report`` on a REAL run folder: a shortened toy recipe run by ``astralight run``
(dataflow service, vLLM RaaS and a Lightning trainer as processes), then the report as a
separate process, as a user would run it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.recipes import shortened_toy_recipe

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a real toy run, ~45 s: the slow suite

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPORT = ("import sys; from astralight.report import main; sys.exit(main(sys.argv[1:]))")


def test_report_of_a_real_toy_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "astralight.cli", "run", str(shortened_toy_recipe(tmp_path)),
         "--run-dir", str(run_dir), "--quiet"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    db_folder = sorted(p.name for p in (run_dir / "dataflow").iterdir())

    rep = subprocess.run([sys.executable, "-c", REPORT, str(run_dir)],
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stdout[-3000:] + rep.stderr[-3000:]
    out = run_dir / "report"
    # a toy run has every source: evals, counters, TensorBoard, publisher scalars, one instance
    for name in ("eval_accuracy.png", "wall_time.png", "reward.png", "entropy.png",
                 "wait_fraction.png", "staleness.png", "weights.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 2000, f"{name}: {len(data)} bytes"
    text = (out / "summary.txt").read_text()
    assert rep.stdout.startswith(text)
    # skipped, and only these: one fixed RaaS (no autoscaler), no tool workflow
    skipped = text.split("plots skipped:\n", 1)[1].splitlines()
    assert sorted(line.split(":")[0].strip() for line in skipped) == ["pool.png",
                                                                        "tool_calls.png"], text
    assert not (out / "pool.png").exists() and not (out / "tool_calls.png").exists()
    assert "versions: 4" in text
    assert "eval policy: v0 " in text and " -> v4 " in text
    assert "rollouts generated / samples trained: policy " in text and " / 64" in text
    assert "final balance decision: " in text and "none" not in text.split("final balance")[1][:20]
    # the report wrote only its own folder
    assert sorted(p.name for p in (run_dir / "dataflow").iterdir()) == db_folder
