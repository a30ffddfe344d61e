"""The departures-from-parity table from ``bench_vs_trl.py --json`` outputs.

A row (one change from ``--config parity``) may have been run in several invocations, e.g. seed
0 one day and ``--first-seed 1 --seeds 2`` another; this merges every astralight run of a row's
files and gives, per row, the mean accuracy of its seeds at equal samples trained and at equal
wall time (each seed interpolated on its own eval points, never extrapolated past its last),
with the lowest and highest seed, then each row's difference from the first row (parity) at
the chosen sample count and time: its cost per sample and its gain per second.

    python tests/benchmarks/departures_table.py --samples 4000,8000 --times 40,80,120 \\
        --row parity=a.json,b.json --row bf16=c.json,d.json [--json]

Prints a Markdown table, or with ``--json`` one JSON object (``rows``: per row its seeds, the
per-seed and mean accuracies, samples trained and the differences).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def load_runs(paths: list[Path]) -> list[dict]:
    """Every astralight run (``astra_runs``) of the JSON outputs ``paths``; a seed that appears
    twice is an error (two invocations that overlap)."""
    runs, seen = [], {}
    for p in paths:
        data = json.loads(Path(p).read_text())
        for run in data.get("astra_runs") or []:
            if run["seed"] in seen:
                raise ValueError(f"seed {run['seed']} is in both {seen[run['seed']]} and {p}")
            seen[run["seed"]] = p
            runs.append(run)
    if not runs:
        raise ValueError(f"no astralight runs in {[str(p) for p in paths]}")
    return sorted(runs, key=lambda r: r["seed"])


def acc_at(curve: list, axis: int, x: float) -> float | None:
    """Accuracy at ``x`` on ``axis`` (0: seconds, 1: samples) of one run's ``[[t, samples,
    acc], ...]`` curve, interpolated linearly; None past the run's last point."""
    xs = [float(p[axis]) for p in curve]
    if x > xs[-1]:
        return None
    return float(np.interp(x, xs, [float(p[2]) for p in curve]))


def summarise(name: str, runs: list[dict], samples: list[float], times: list[float]) -> dict:
    """One row: per-seed and mean accuracies at ``samples`` and ``times``."""
    def point(axis, x):
        per_seed = [acc_at(r["curve"], axis, x) for r in runs]
        got = [a for a in per_seed if a is not None]
        # a mean only where every seed got there: a partial mean favours the fast seeds
        mean = float(np.mean(got)) if len(got) == len(per_seed) else None
        return {"x": x, "seeds": per_seed, "mean": mean,
                "low": min(got) if got else None, "high": max(got) if got else None}

    return {"name": name, "seeds": [r["seed"] for r in runs],
            "samples_trained": [(r.get("summary") or {}).get("samples_trained", r["curve"][-1][1])
                                for r in runs],
            "at_samples": [point(1, x) for x in samples],
            "at_seconds": [point(0, x) for x in times]}


def _cell(p: dict, spread: bool) -> str:
    if p["mean"] is None:
        return "-"
    if not spread or len(p["seeds"]) < 2:
        return f"{p['mean']:.2f}"
    return f"{p['mean']:.2f} [{p['low']:.2f}, {p['high']:.2f}]"


def markdown(rows: list[dict], samples: list[float], times: list[float], cost_at: float) -> str:
    head = ([f"{x / 1000:g}k samples" for x in samples] + [f"at {x:g} s" for x in times]
            + ["samples trained", f"per sample ({cost_at / 1000:g}k)",
               f"per second ({times[-1]:g} s)"])
    out = ["| change from parity | seeds | " + " | ".join(head) + " |",
           "| --- | --- |" + " ---: |" * len(head)]
    for r in rows:
        cells = ([_cell(p, True) for p in r["at_samples"]]
                 + [_cell(p, False) for p in r["at_seconds"]])
        cells.append(", ".join(f"{n / 1000:.1f}k" for n in r["samples_trained"]))
        cells += [_diff(r["cost_per_sample"]), _diff(r["gain_per_second"])]
        out.append(f"| {r['name']} | {len(r['seeds'])} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _diff(d: float | None) -> str:
    return "-" if d is None else f"{d:+.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", action="append", required=True, metavar="NAME=FILE[,FILE...]",
                    help="a row and its bench_vs_trl JSON outputs; the first row is the baseline")
    ap.add_argument("--samples", default="4000,8000", help="sample counts, comma-separated")
    ap.add_argument("--times", default="40,80,120", help="seconds, comma-separated")
    ap.add_argument("--per-sample-at", type=float, default=None,
                    help="the sample count of the per-sample difference (one of --samples; "
                         "default: the last)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        samples = [float(x) for x in args.samples.split(",")]
        times = [float(x) for x in args.times.split(",")]
    except ValueError:
        ap.error("--samples and --times: comma-separated numbers, e.g. --samples 4000,8000")
    cost_at = samples[-1] if args.per_sample_at is None else args.per_sample_at
    if cost_at not in samples:
        ap.error(f"--per-sample-at {cost_at:g}: must be one of --samples {args.samples}")
    rows = []
    for spec in args.row:
        name, sep, files = spec.partition("=")
        if not sep or not files:
            ap.error(f"--row {spec!r}: NAME=FILE[,FILE...]")
        try:
            rows.append(summarise(name, load_runs([Path(f) for f in files.split(",")]),
                                  samples, times))
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--row {name}: {e}")
    base = rows[0]
    for r in rows:
        def diff(key, i):
            a, b = r[key][i]["mean"], base[key][i]["mean"]
            return None if a is None or b is None else a - b
        r["cost_per_sample"] = diff("at_samples", samples.index(cost_at))
        r["gain_per_second"] = diff("at_seconds", -1)
    if args.json:
        print(json.dumps({"samples": samples, "times": times, "per_sample_at": cost_at,
                          "rows": rows}))
    else:
        print(markdown(rows, samples, times, cost_at))
    return 0


if __name__ == "__main__":
    sys.exit(main())
