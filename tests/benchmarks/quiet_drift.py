"""Did a policy move while it had nothing to learn from? Reads a run's trainer TensorBoard.

    python tests/benchmarks/quiet_drift.py RUN_DIR [RUN_DIR ...]

A *quiet* step is one whose updates all had a zero gradient, as had the three steps before it
(more than the staleness the defaults train on). Left alone, the weights then equal those that
sampled every trained token, so every ratio is 1 up to the bf16 publication; a step whose
``train/ratio_min`` is below 0.9 is *drift*: the optimizer moved the policy anyway (AdamW
stepping on momentum alone; what ``skip_empty_updates`` prevents). One JSON line per run:
``steps``, ``zero_grad_steps``, ``quiet_steps``, ``drift_steps`` and the lowest train reward of
the run's second half. RUN_DIR is an ``astralight run`` folder (``bench_vs_trl.py``'s
``seedN/astra_run``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

#: quiet steps before a step for it to count (the defaults' max_staleness is 2)
QUIET_BEFORE = 3
#: a ratio under this on a quiet step is drift
DRIFT_RATIO = 0.9


def drift_figures(run_dir: Path) -> dict:
    """The figures of the module docstring for one run folder."""
    events = sorted(run_dir.glob("tensorboard/*/*/events*"))
    if not events:
        raise SystemExit(f"{run_dir}: no trainer TensorBoard under tensorboard/")
    acc = EventAccumulator(str(events[-1]), size_guidance={"scalars": 0})
    acc.Reload()
    series = {tag: {e.step: e.value for e in acc.Scalars(tag)}
              for tag in ("train/grad_norm", "train/ratio_min", "train/reward_mean")}
    grad, ratio_min, reward = series.values()
    zero = [s for s in grad if grad[s] == 0]
    quiet = [s for s in zero if all(grad.get(s - k, 1.0) == 0 for k in range(1, QUIET_BEFORE + 1))]
    drift = [s for s in quiet if ratio_min.get(s, 1.0) < DRIFT_RATIO]
    late = sorted(reward)[len(reward) // 2:]
    return {"run": str(run_dir), "steps": len(grad), "zero_grad_steps": len(zero),
            "quiet_steps": len(quiet), "drift_steps": len(drift),
            "min_train_reward_second_half": round(min(reward[s] for s in late), 3) if late else None}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    for run in argv:
        print(json.dumps(drift_figures(Path(run))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
