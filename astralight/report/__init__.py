"""``astralight report``: see a finished (or half-finished) run as PNG plots and a short summary.

    astralight report RUN_DIR [--out DIR] [--window N] [--tensorboard DIR ...] [--db PATH]

``RUN_DIR`` is a folder written by ``astralight run RECIPE --run-dir RUN_DIR``. Trainer metrics
come from every folder of TensorBoard event files under it (``tensorboard/<name>/``,
``lightning_logs/``, ...) and from each ``--tensorboard DIR`` (repeatable: a cluster trainer's
``default_root_dir``); the dataflow DB from ``RUN_DIR/dataflow/dataflow.db`` (or the
``state_dir`` of ``RUN_DIR/configs/dataflow.yaml``) unless ``--db PATH`` names it. The summary's
``sources:`` lines say what was read from where, and what was not found. The report goes to
``RUN_DIR/report/`` (or ``--out DIR``):

- ``eval_accuracy.png``: held-out avg@k per eval version of every policy (dataflow DB
  ``eval_runs`` / ``eval_reports``, else summary.json ``eval``); team accuracy, per-benchmark
  lines and their average when the eval has them.
- ``reward.png``: ``train/reward_mean`` per training step (TensorBoard), raw and smoothed.
- ``wait_fraction.png``: trainer ``trainer_wait_ms / trainer_step_ms`` per version (dataflow
  version counters), raw and over a ``--window``-version window, with the run's mean.
- ``staleness.png``: ``train/staleness_mean`` / ``train/staleness_max`` per step (TensorBoard).
- ``weights.png``: ``publish/sparsity`` and ``publish/bytes`` / ``delta_bytes`` / ``full_bytes``
  per published version (the WeightPublisher's TensorBoard scalars), full syncs marked.
- ``pool.png``: live rollout instances over time (the dataflow's instance table) and the
  autoscaler's target (``autoscale.jsonl``) when there is one.
- ``summary.txt``: recipe, the sources read, versions, wall time, eval start -> end per policy
  and a table of avg@k and pass@k per benchmark (and their average) at the last and at the best
  eval version (highest benchmark-average avg@k, as papers report the best checkpoint), rollouts
  generated / samples trained, mean wait fraction, the final balance decision, and which plots
  were skipped and why. Also printed to stdout.

A plot whose data is not in the run folder is skipped with its reason, never an error; a folder
that is not a run folder is (exit status 2, naming what is missing). Nothing in RUN_DIR is
modified except the report folder. The plots need matplotlib (a dependency); without it
``summary.txt`` is still written and says why the plots are missing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from astralight.report.rundata import RunData, RunFolderError, load_run

__all__ = ["Report", "RunFolderError", "main", "make_report"]

DEFAULT_WINDOW = 5


@dataclass
class Report:
    """What :func:`make_report` wrote: the plots, the skipped ones with their reasons, the text."""

    out_dir: Path
    written: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    text: str = ""
    data: RunData | None = None


def make_report(run_dir: str | Path, out_dir: str | Path | None = None,
                window: int = DEFAULT_WINDOW, tensorboard: list | tuple = (),
                db: str | Path | None = None) -> Report:
    """Write the plots and ``summary.txt`` of ``run_dir`` into ``out_dir`` (default
    ``run_dir/report``), also reading the ``tensorboard`` folders and the dataflow DB ``db``
    when given. Raises :class:`RunFolderError` for a non-run folder (or a missing ``db`` /
    ``tensorboard``). Without matplotlib (a dependency, so only on a broken install) every plot
    is skipped with the reason and ``summary.txt`` is still written."""
    from astralight.report import plots
    from astralight.report.text import summary_text

    if window < 1:
        raise ValueError(f"--window: must be >= 1 versions, got {window}")
    try:
        plots.require_matplotlib()
        no_plots = None
    except plots.MatplotlibMissing as exc:  # (a dependency; a broken install still gets text)
        no_plots = str(exc)
    data = load_run(run_dir, tensorboard=tensorboard, db=db)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir=out, data=data)
    for name, draw in plots.PLOTS:
        path = out / name
        reason = draw(data, path, window) if no_plots is None else no_plots
        if reason is None:
            report.written.append(name)
        else:
            report.skipped[name] = reason
            path.unlink(missing_ok=True)  # a stale plot of an earlier report would mislead
    report.text = summary_text(data, report.written, report.skipped, window)
    (out / "summary.txt").write_text(report.text)
    return report


def main(argv: list[str] | None = None) -> int:
    """``astralight report RUN_DIR [--out DIR] [--window N] [--tensorboard DIR ...] [--db PATH]``;
    returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="astralight report",
        description="PNG plots and a text summary of a run folder (see `astralight run`).")
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="the run folder (--run-dir of astralight run)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where to write the report (default RUN_DIR/report)")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, metavar="N",
                        help=f"smoothing window, in versions / steps (default {DEFAULT_WINDOW})")
    parser.add_argument("--tensorboard", action="append", default=[], metavar="DIR",
                        help="also read TensorBoard event files under DIR (repeatable), e.g. a "
                             "trainer's default_root_dir or lightning_logs/ outside RUN_DIR")
    parser.add_argument("--db", default=None, metavar="PATH",
                        help="the dataflow DB (<state_dir>/dataflow.db) when it is not "
                             "RUN_DIR/dataflow/dataflow.db")
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error(f"--window: must be >= 1, got {args.window}")
    try:
        report = make_report(args.run_dir, args.out, args.window, tensorboard=args.tensorboard,
                             db=args.db)
    except RunFolderError as exc:
        print(f"astralight report: {exc}", file=sys.stderr)
        return 2
    print(report.text, end="")
    print(f"report written to {report.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
