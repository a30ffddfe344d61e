"""Do the shipped examples learn on every seed, engine precision and machine load? (issue 37)

    python tests/benchmarks/bench_examples_learn.py --json --seeds 3 --dtype float32,bfloat16 --contend
    python tests/benchmarks/bench_examples_learn.py --examples tool_use --seeds 3 --dtype float32 --contend

Each run is the example's own recipe (``examples/NAME/recipe.yaml``, read with its ``extends``
and ``pythonpath`` resolved) started with ``astralight run`` (the real launcher: dataflow, vLLM
RaaS, Lightning trainers), with only these keys changed:

- the RL seed: the recipe's ``seed``, every trainer's ``seed_everything`` and every RaaS's
  ``seed`` (the warm start keeps the recipe's own seed: it is built once per example, in
  ``OUT/NAME/_prepared``, and copied into every run folder, data files included);
- every engine's ``dtype`` (``--dtype``);
- ``--versions``: a shorter run (``stop.versions``, the trainers' ``max_steps`` and, where
  needed, ``dataflow.eval.every`` follow it);
- ``--set KEY=VALUE``: any other recipe key (``trainers.0.model.init_args.lr=3e-4``).

Conditions: ``quiet`` (nothing else started) and, with ``--contend``, ``contended``: one busy
process per CPU core runs for the whole run, so every component shares its core with a spinner
(what a loaded node, a straggler or a slow tool does to the timing of an asynchronous run).
``--conditions contended`` runs only that one.

Per run, from the launcher's ``summary.json`` and the trainers' TensorBoard curves:
eval avg@k at the start, best (and its version) and end; ``tool_call_rate_start/_end`` (tool
workflows); the malformed share of tool calls and the mean train reward over the first and last
``--window`` steps; the guard's warnings; wall time; the load average before and after.
Per example, precision and condition: the spread over seeds, and whether every seed met the
example's goal (``GOALS``: an end accuracy at least ``end_at_least``, an end at least
``rise_at_least`` above the start, a run within ``within_s`` seconds, an end at least ``hold`` x
the run's own best, and an end above the start).

Progress goes to stderr; with ``--json`` stdout carries one JSON object per run, then one
``{"summary": ...}`` line last. A failed run is reported (exit code, log tail) and the others
still run; the script exits 1 if any run failed to finish.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make the tests package importable
    sys.path.insert(0, str(ROOT))

from tests.benchmarks.bench_data_algorithms import _publisher_every, eval_every_for  # noqa: E402
from astralight.launch.recipe import RecipeError, apply_overrides  # noqa: E402
from tests.benchmarks.bench_vs_trl import _load  # noqa: E402

EXAMPLES = ROOT / "examples"
#: the examples that claim learning, in the order they run
LEARNING_EXAMPLES = ("toy", "tool_use", "openai_agent", "multi_agent", "search_agent", "text_game")
#: what each example's README (or recipe header) promises, checked per run
GOALS: dict[str, dict[str, float | bool]] = {
    "toy": {"end_at_least": 0.85, "hold": 0.9},
    "tool_use": {"end_at_least": 0.5, "hold": 0.9},
    "openai_agent": {"hold": 0.9},
    "multi_agent": {"hold": 0.9},
    "search_agent": {"hold": 0.9},
    "text_game": {"hold": 0.9},
    "smollm2_math": {"rise_at_least": 0.15, "within_s": 1800, "hold": 0.9},
    # issue 38: the tool variant must raise both the accuracy and the rate of calling the tool
    "smollm2_math/tools": {"rise_at_least": 0.15, "tool_calls_rise": True, "hold": 0.9},
}
CONDITIONS = ("quiet", "contended")
#: the trainers' curves read for the first/last-window figures
MALFORMED_TAG, CALLS_TAG, REWARD_TAG = ("agent/tool_errors/malformed", "agent/tool_calls",
                                        "train/reward_mean")
#: commands a text game did not accept, per episode (environment workflows have no tool calls)
INVALID_TAG = "agent/invalid_actions"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ recipes


def example_path(name: str) -> Path:
    """``NAME`` is ``examples/NAME/recipe.yaml``; ``NAME/VARIANT`` is an example's other recipe,
    ``examples/NAME/VARIANT.yaml`` (e.g. ``smollm2_math/tools``)."""
    folder, _, variant = name.partition("/")
    return EXAMPLES / folder / f"{variant or 'recipe'}.yaml"


def example_recipe(name: str) -> dict:
    """The example's recipe, ``extends`` merged and ``pythonpath`` absolute (so it can be
    written anywhere)."""
    from astralight.launch.recipe import load_recipe

    path = example_path(name)
    if not path.is_file():
        raise SystemExit(f"--examples: {name!r} has no {path.relative_to(ROOT)}; "
                         f"choose from {', '.join(LEARNING_EXAMPLES)}, or NAME/VARIANT for "
                         f"examples/NAME/VARIANT.yaml (e.g. smollm2_math/tools)")
    return load_recipe(path)


def run_recipe(base: dict, seed: int, dtype: str | None, versions: int | None,
               overrides: list[str]) -> dict:
    """``base`` with this run's seed, engine precision, length and ``overrides`` set."""
    recipe = copy.deepcopy(base)
    recipe["seed"] = seed
    for trainer_cfg in recipe.get("trainers") or []:
        trainer_cfg["seed_everything"] = seed
    for raas in recipe.get("raas") or []:
        raas["seed"] = seed
        if dtype is not None:
            for engine in (raas.get("engines") or {}).values():
                engine["dtype"] = dtype
    if versions is not None:
        if versions < 1:
            raise SystemExit(f"--versions: must be >= 1, got {versions}")
        recipe["stop"]["versions"] = versions
        for trainer_cfg in recipe.get("trainers") or []:
            trainer_cfg.setdefault("trainer", {})["max_steps"] = versions * _publisher_every(trainer_cfg)
        ev = (recipe.get("dataflow") or {}).get("eval") or {}
        if ev.get("every") and versions % int(ev["every"]):
            ev["every"] = eval_every_for(versions, int(ev["every"]))
    try:
        return apply_overrides(recipe, overrides)
    except RecipeError as exc:
        raise SystemExit(str(exc)) from None


def prepare_recipe(base: dict, overrides: list[str]) -> dict:
    """The recipe the shared warm start is built from: ``base`` at its own seed, with the
    ``--set`` overrides (so ``--set prepare.kwargs.sft_steps=1200`` reaches the warm start)."""
    return run_recipe(base, base.get("seed", 0), None, None, overrides)


def prepare_once(name: str, recipe: dict, out: Path) -> Path | None:
    """Build the example's warm start once into ``out/NAME/_prepared`` (its ``models/init`` and
    whatever else the prepare step writes under ``{run_dir}``, e.g. the search agent's data)."""
    from astralight.launch import prepare_initial_model
    from astralight.launch.recipe import substitute

    if not recipe.get("prepare"):
        return None
    shared = out / name / "_prepared"
    prepared = substitute(recipe, {"run_dir": shared, "seed": recipe.get("seed", 0)})
    t0 = time.monotonic()
    log(f"[{name}] preparing the warm start in {shared} ...")
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the results
        prepare_initial_model(prepared, shared)
    log(f"[{name}] warm start ready in {time.monotonic() - t0:.0f} s")
    return shared


# ------------------------------------------------------------------------------ one run


class Contention:
    """One busy process per CPU core while the block runs (``active=False``: none)."""

    def __init__(self, active: bool):
        self.active = active
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Contention":
        if self.active:
            self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                          for _ in range(os.cpu_count() or 1)]
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def window_means(run_dir: Path, window: int) -> dict[str, Any]:
    """First and last ``window`` steps of the first trainer's curves: the mean train reward and
    the malformed share of tool calls (None where the run logged no tool calls) and the invalid
    commands per episode of an environment workflow (None where it logged none)."""
    from astralight.launch.guard import TrainCurves

    curves = TrainCurves(run_dir, (MALFORMED_TAG, CALLS_TAG, REWARD_TAG, INVALID_TAG)).read()
    out: dict[str, Any] = {}
    for logger, series in sorted(curves.items()):
        reward, invalid = series.get(REWARD_TAG, []), series.get(INVALID_TAG, [])
        malformed, calls = series.get(MALFORMED_TAG, []), series.get(CALLS_TAG, [])
        n = min(len(malformed), len(calls))

        def share(lo: int, hi: int) -> float | None:
            made = sum(calls[lo:hi])
            return round(sum(malformed[lo:hi]) / made, 4) if made else None

        out[logger] = {
            "train_reward_first": round(sum(reward[:window]) / len(reward[:window]), 4) if reward else None,
            "train_reward_last": round(sum(reward[-window:]) / len(reward[-window:]), 4) if reward else None,
            "malformed_share_first": share(0, min(window, n)) if n else None,
            "malformed_share_last": share(max(0, n - window), n) if n else None,
            "invalid_actions_first": round(sum(invalid[:window]) / len(invalid[:window]), 4)
            if invalid else None,
            "invalid_actions_last": round(sum(invalid[-window:]) / len(invalid[-window:]), 4)
            if invalid else None,
            "steps": len(reward),
        }
    return out


def goal_met(name: str, row: dict) -> dict[str, bool | None]:
    """Each of the example's goals for one finished run (None: not measurable, e.g. no eval)."""
    goal = GOALS.get(name, {"hold": 0.9})
    start, best, end = (row.get(k) for k in ("eval_accuracy_start", "eval_accuracy_best",
                                             "eval_accuracy_end"))
    met: dict[str, bool | None] = {}
    if "end_at_least" in goal:
        met["end_at_least"] = None if end is None else end >= goal["end_at_least"]
    if "rise_at_least" in goal:
        met["rise_at_least"] = (None if end is None or start is None
                                else end - start >= goal["rise_at_least"])
    if "within_s" in goal:
        met["within_s"] = None if row.get("wall_s") is None else row["wall_s"] <= goal["within_s"]
    if "hold" in goal:
        met["hold"] = None if end is None or best is None else end >= goal["hold"] * best
    if goal.get("tool_calls_rise"):
        first, last = row.get("tool_call_rate_start"), row.get("tool_call_rate_end")
        met["tool_calls_rise"] = None if first is None or last is None else last > first
    met["rose"] = None if end is None or start is None else end > start
    return met


def plot(rows: list[dict], path: Path) -> None:
    """Eval accuracy against version, one line per run, one panel per example and condition
    (the engine precision in each line's label, with the seed and the run's wall time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["example"], r["condition"]) for r in rows if r.get("eval")})
    if not cells:
        raise SystemExit("--png: no run has an eval curve to plot")
    fig, axes = plt.subplots(1, len(cells), figsize=(5.5 * len(cells), 4), squeeze=False)
    for ax, (name, condition) in zip(axes[0], cells):
        for r in rows:
            if (r["example"], r["condition"]) != (name, condition) or not r.get("eval"):
                continue
            points = sorted((int(v), acc) for v, acc in r["eval"].items())
            wall = f", {r['wall_s'] / 60:.0f} min" if r.get("wall_s") else ""
            ax.plot([v for v, _ in points], [a for _, a in points], marker="o",
                    label=f"{r['dtype']} seed {r['seed']}{wall}")
        ax.set(title=f"{name} ({condition})", xlabel="policy version", ylabel="eval accuracy",
               ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def one_run(name: str, recipe: dict, prepared: Path | None, run_dir: Path, condition: str,
            quiet: bool) -> dict:
    """Start the launcher on ``recipe`` in ``run_dir`` under ``condition``; the run's row."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    if prepared is not None:  # hard links: a real model's weights are hundreds of MB
        shutil.copytree(prepared, run_dir, dirs_exist_ok=True, copy_function=_link_or_copy)
    recipe_path = run_dir / "bench_recipe.yaml"
    recipe_path.write_text(f"# {name}: written by tests/benchmarks/bench_examples_learn.py\n"
                           + yaml.safe_dump(recipe, sort_keys=False))
    argv = [sys.executable, "-m", "astralight.cli", "run", str(recipe_path), "--run-dir", str(run_dir)]
    load_before = _load()
    t0 = time.monotonic()
    tail: list[str] = []
    with Contention(condition == "contended"):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, cwd=ROOT)
        try:
            for line in proc.stdout:
                tail = (tail + [line.rstrip("\n")])[-30:]
                if not quiet and not line.startswith("{"):
                    log(f"  [{name}] {line.rstrip()}")
        except KeyboardInterrupt:
            proc.wait()  # Ctrl-C reached the launcher too: let it stop its components
            raise
        rc = proc.wait()
    row: dict[str, Any] = {"exit_code": rc, "bench_wall_s": round(time.monotonic() - t0, 1),
                           "load_before": load_before, "load_after": _load(),
                           "run_dir": str(run_dir)}
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        for key in ("eval_accuracy_start", "eval_accuracy_best", "eval_version_best",
                    "eval_accuracy_end", "eval_version_end", "tool_call_rate_start",
                    "tool_call_rate_end", "versions", "samples_trained", "wall_s", "stop_reason",
                    "warnings"):
            if key in summary:
                row[key] = summary[key]
        row["eval"] = {v: e.get("avg_at_k") for v, e in (summary.get("eval") or {}).items()}
    else:
        row["log_tail"] = tail
    return row


# ------------------------------------------------------------------------------ figures


def spread(values: list[float | None]) -> dict[str, Any] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": round(sum(vals) / len(vals), 4), "min": min(vals), "max": max(vals), "n": len(vals)}


def summarize(rows: list[dict]) -> list[dict]:
    """Per example, precision and condition: the seeds' spread and whether every seed met every
    goal."""
    out = []
    key = lambda r: (r["example"], r["dtype"], r["condition"])  # noqa: E731
    for (name, dtype, condition), group in itertools.groupby(sorted(rows, key=key), key=key):
        group = list(group)
        goals = [r.get("goals") or {} for r in group]
        names = sorted({g for gs in goals for g in gs})
        out.append({
            "example": name, "dtype": dtype, "condition": condition,
            "seeds": [r["seed"] for r in group],
            **{k: spread([r.get(k) for r in group])
               for k in ("eval_accuracy_start", "eval_accuracy_best", "eval_accuracy_end",
                         "tool_call_rate_start", "tool_call_rate_end", "wall_s")},
            "goals_met": {g: all(gs.get(g) is True for gs in goals) for g in names},
            "failed_runs": sum(r["exit_code"] != 0 for r in group),
            "warnings": sorted({w for r in group for w in r.get("warnings") or []}),
        })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", default=",".join(LEARNING_EXAMPLES),
                    help=f"comma-separated (default: {','.join(LEARNING_EXAMPLES)})")
    ap.add_argument("--seeds", type=int, default=3, help="RL seeds per cell (FIRST..FIRST+N-1)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32",
                    help="engine precisions, comma-separated (float32, bfloat16, auto)")
    ap.add_argument("--contend", action="store_true",
                    help="also run every cell with one busy process per core")
    ap.add_argument("--conditions", default=None,
                    help="quiet, contended or both, comma-separated (overrides --contend)")
    ap.add_argument("--versions", type=int, default=None, help="a shorter run (default: the recipe's)")
    ap.add_argument("--window", type=int, default=10, help="steps in the first/last train windows")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe key set in every run (repeatable)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench_examples_learn")
    ap.add_argument("--json", action="store_true", help="one JSON object per run on stdout, then the summary")
    ap.add_argument("--quiet", action="store_true", help="no launcher lines on stderr")
    ap.add_argument("--png", type=Path, default=None,
                    help="also plot each run's eval accuracy against version to this PNG")
    ap.add_argument("--plot-from", type=Path, default=None, metavar="JSONL",
                    help="run nothing: plot the run rows of an earlier --json output to --png")
    args = ap.parse_args(argv)
    if args.plot_from is not None:
        if args.png is None:
            raise SystemExit("--plot-from: needs --png PATH")
        rows = [json.loads(line) for line in args.plot_from.read_text().splitlines()
                if line.strip().startswith('{"example"')]
        plot(rows, args.png)
        return 0
    if args.seeds < 1:
        raise SystemExit(f"--seeds: must be >= 1, got {args.seeds}")
    names = [n.strip() for n in args.examples.split(",") if n.strip()]
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    conditions = CONDITIONS if args.contend else CONDITIONS[:1]
    if args.conditions is not None:
        conditions = tuple(c.strip() for c in args.conditions.split(",") if c.strip())
        if not conditions or set(conditions) - set(CONDITIONS):
            raise SystemExit(f"--conditions: a comma-separated choice of {', '.join(CONDITIONS)}, "
                             f"got {args.conditions!r}")
    bases = {name: example_recipe(name) for name in names}  # every name checked before any run
    rows: list[dict] = []
    for name in names:
        prepared = prepare_once(name, prepare_recipe(bases[name], args.overrides), args.out_dir)
        for dtype, condition, seed in itertools.product(
                dtypes, conditions, range(args.first_seed, args.first_seed + args.seeds)):
            recipe = run_recipe(bases[name], seed, dtype, args.versions, args.overrides)
            run_dir = args.out_dir / name / f"{dtype}-{condition}-seed{seed}"
            log(f"[{name}] {dtype} {condition} seed {seed}: start (load {_load()})")
            row = {"example": name, "dtype": dtype, "condition": condition, "seed": seed,
                   "overrides": args.overrides,
                   **one_run(name, recipe, prepared, run_dir, condition, args.quiet)}
            if row["exit_code"] == 0 or "eval_accuracy_end" in row:
                row["curves"] = window_means(run_dir, args.window)
                row["goals"] = goal_met(name, row)
            log(f"[{name}] {dtype} {condition} seed {seed}: exit {row['exit_code']}, eval "
                f"{row.get('eval_accuracy_start')} -> best {row.get('eval_accuracy_best')} -> end "
                f"{row.get('eval_accuracy_end')}, {row.get('bench_wall_s')} s")
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    summary = summarize(rows)
    if args.png is not None:
        plot(rows, args.png)
    if args.json:
        print(json.dumps({"summary": summary}), flush=True)
    else:
        for cell in summary:
            print(json.dumps(cell))
    return 1 if any(r["exit_code"] != 0 for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
