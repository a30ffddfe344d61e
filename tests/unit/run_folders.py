"""Hand-made run folders for the report unit tests: a run's ``summary.json``
(:func:`write_summary`, from the per-version timings and counters :data:`WAIT_MS`,
:data:`STEP_MS`, :data:`ROLLOUTS`, :data:`TRAINED` and the balance report :func:`_balance`), the
``TwoBenchmarks`` eval source a run folder's dataflow config can name, a dataflow DB from before
``eval.n`` / ``eval.pass_k`` (:func:`_old_db`), and :func:`assert_png` for the plots.

Shared here so that tests never import from one another (no test module imports from a
``test_*`` module; ``tests/unit/test_no_cross_test_imports.py`` checks it).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from astralight.tasks.base import Prompt, PromptSource

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0

# per-version trainer timings (ms) of policy "policy": wait / step
WAIT_MS = {0: 9000, 1: 100, 2: 300, 3: 200, 4: 400}
STEP_MS = {0: 10000, 1: 1000, 2: 1000, 3: 1000, 4: 1000}
ROLLOUTS = {0: 40, 1: 30, 2: 20, 3: 25, 4: 35}
TRAINED = {0: 16, 1: 16, 2: 16, 3: 16, 4: 16}


class TwoBenchmarks(PromptSource):
    """A 4-prompt eval source: prompts 0, 1 are "aime", 2, 3 are "math500"."""

    def get(self, index: int) -> Prompt:
        if not 0 <= index < 4:
            raise IndexError(index)
        return Prompt(f"p{index}", f"{index}+1=",
                      {"answer": str(index + 1), "benchmark": "aime" if index < 2 else "math500"})

    def __len__(self) -> int:
        return 4


def _balance(model_id: str = "policy") -> dict:
    return {"versions": [2, 3], "wall_s": 2.0, "wait_fraction": 0.25, "produced": 45,
            "accepted": 45, "consumed": 32, "stale": 13,
            "decision": {"action": "scale_up", "pool": 1, "target": 2,
                         "reason": "trainer waited 25.0% of its steps (> 10%)"},
            "model_id": model_id, "current_version": 4}


def write_summary(run_dir: Path, **extra) -> dict:
    summary = {
        "eval_accuracy_start": 0.3, "eval_accuracy_end": 0.7, "eval_versions": [0, 4],
        "eval": {"0": {"avg_at_k": 0.3, "pass_at_k": 0.5, "k": 2, "n_prompts": 4},
                 "4": {"avg_at_k": 0.7, "pass_at_k": 1.0, "k": 2, "n_prompts": 4}},
        "versions": 4, "samples_trained": sum(TRAINED.values()),
        "rollouts_generated": sum(ROLLOUTS.values()),
        "counters": {"trainer_wait_ms": sum(WAIT_MS.values()),
                     "trainer_step_ms": sum(STEP_MS.values())},
        "per_version": {str(v): {"trainer_wait_ms": WAIT_MS[v], "trainer_step_ms": STEP_MS[v],
                                 "rollouts_generated": ROLLOUTS[v],
                                 "samples_trained": TRAINED[v]} for v in range(5)},
        "balance": _balance(), "trainer_seconds": 12.5, "wall_s": 42.5,
        "run_dir": str(run_dir), **extra}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    assert len(data) > 2000, f"{path.name} is suspiciously small ({len(data)} bytes)"


def _old_db(path):
    """A state folder from before eval.n / eval.pass_k (and n_team_correct) existed."""
    con = sqlite3.connect(str(path))
    con.executescript("""
        CREATE TABLE eval_runs (model_id TEXT NOT NULL, version INTEGER NOT NULL,
            n_prompts INTEGER NOT NULL, k INTEGER NOT NULL, scheduled_at REAL NOT NULL,
            PRIMARY KEY(model_id, version));
        CREATE TABLE eval_reports (model_id TEXT NOT NULL, version INTEGER NOT NULL,
            prompt_index INTEGER NOT NULL, task_id TEXT NOT NULL, n_samples INTEGER NOT NULL,
            n_correct INTEGER NOT NULL, sum_reward REAL NOT NULL, min_version INTEGER,
            max_version INTEGER, reported_at REAL NOT NULL,
            PRIMARY KEY(model_id, version, prompt_index));
        INSERT INTO eval_runs VALUES ('p', 3, 2, 4, 0.0);
        INSERT INTO eval_reports VALUES ('p', 3, 0, 't0', 4, 1, 1.0, 3, 3, 1.0);
        INSERT INTO eval_reports VALUES ('p', 3, 1, 't1', 4, 0, 0.0, 3, 3, 1.0);
    """)
    con.commit()
    con.close()
