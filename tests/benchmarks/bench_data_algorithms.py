"""Data algorithms on the toy recipe: accuracy against rollouts generated (AstraFlow Figure 18).

Runs ``astralight run`` (the real launcher: dataflow service, vLLM RaaS, Lightning trainer, as
subprocesses) once per variant, each for the same number of trainer versions, from the same
warm-started policy (built once, copied into every run folder), with the same seed and the same
prompt stream:

    vanilla                 every prompt rolled out, every group trained on
    ds                      dynamic sampling alone (zero_advantage filter; replay ratio 0)
    ds_replay_0.3/0.5/0.7   dynamic sampling + that share of each batch from the replay pool
    ds_replay_greso_0.3/0.5 the same + the GRESO prompt curator (paper settings)

Each variant is a recipe that extends the matching ``configs/toy/algorithms/*.yaml`` (written
into its run folder as ``variant.yaml``). What it measures, per variant: ``rollouts_generated``
(train samples the RaaS produced, before any filter: the rollout cost), ``samples_trained``
(fresh + replayed samples the trainer stepped on: the same for every variant), the held-out
avg@k after the last version, the run's wall time, and the curve of avg@k against the
cumulative rollouts generated when each evaluated version was published (from the summary's
``per_version`` counters, counted under the version that was current when they arrived).
``rollouts_to_vanilla`` is the first point of a variant's curve at or above vanilla's final
accuracy (minus ``--match-tol``), when vanilla ran first.

Expected shape, as the paper found: dynamic sampling costs more rollouts than vanilla for the
same number of versions (zero-variance groups are generated and thrown away, more so as the
policy solves more prompts); replay and GRESO win some of it back and reach the vanilla accuracy
with fewer rollouts. Whatever it measures is what it reports.

Run (measured on two CPU cores: 1.5-3 min per variant, ~18 min for all seven plus a ~4 min warm start)::

    python tests/benchmarks/bench_data_algorithms.py --json --plot out.png
    python tests/benchmarks/bench_data_algorithms.py --variants vanilla ds_replay_greso_0.5 --versions 50

Progress (start and end of each variant, the launcher's own lines prefixed with the variant)
goes to stderr; results go to stdout: one JSON object per line with ``--json``, else a table.
A failed variant is reported with the tail of its log; the others still run, and the script
exits 1 at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from astralight.launch.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
ALGORITHMS_DIR = REPO / "configs" / "toy" / "algorithms"


@dataclass(frozen=True)
class Variant:
    name: str
    base: str            # file under configs/toy/algorithms
    replay_ratio: float  # share of each batch from the replay pool (0: none)


VARIANTS = (
    Variant("vanilla", "vanilla.yaml", 0.0),
    Variant("ds", "dynamic_sampling.yaml", 0.0),
    Variant("ds_replay_0.3", "ds_replay.yaml", 0.3),
    Variant("ds_replay_0.5", "ds_replay.yaml", 0.5),
    Variant("ds_replay_0.7", "ds_replay.yaml", 0.7),
    Variant("ds_replay_greso_0.3", "ds_replay_greso.yaml", 0.3),
    Variant("ds_replay_greso_0.5", "ds_replay_greso.yaml", 0.5),
)
#: the columns of :func:`format_table`: (header, width, row key, format spec)
TABLE_COLUMNS = [("variant", 22, "variant", ""), ("replay", 7, "replay_ratio", ".1f"),
                 ("rollouts", 10, "rollouts_generated", ""), ("trained", 9, "samples_trained", ""),
                 ("final acc", 10, "final_eval_accuracy", ".3f"),
                 ("to vanilla", 11, "rollouts_to_vanilla", ""),
                 ("filtered", 9, "groups_filtered", ""), ("skipped", 8, "prompts_skipped", ""),
                 ("wall s", 8, "wall_s", ".0f")]


def select_variants(names: list[str] | None) -> list[Variant]:
    """The variants named (in the canonical order), all when ``names`` is empty."""
    if not names:
        return list(VARIANTS)
    known = {v.name: v for v in VARIANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(known)}")
    return [v for v in VARIANTS if v.name in names]


def eval_every_for(versions: int, every: int) -> int:
    """The largest evaluation period <= ``every`` that divides ``versions`` (the final version
    must be evaluated, which the launcher checks)."""
    return next(d for d in range(min(every, versions), 0, -1) if versions % d == 0)


def _publisher_every(trainer_cfg: dict) -> int:
    for cb in (trainer_cfg.get("trainer") or {}).get("callbacks") or []:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("WeightPublisher"):
            return int((cb.get("init_args") or {}).get("every_n_steps", 1))
    return 1


def variant_recipe(variant: Variant, versions: int | None,
                   algorithms_dir: Path = ALGORITHMS_DIR) -> dict:
    """The recipe of one variant: ``extends`` its algorithms file, states only what differs.

    With ``versions`` set, ``stop.versions``, each trainer's ``max_steps`` (versions x the
    WeightPublisher's every_n_steps) and, when needed, ``dataflow.eval.every`` follow it;
    ``stop.timeout_s`` grows in proportion for longer runs. Trainers are a list, and lists
    replace when merged, so the whole (resolved) trainer list is restated then.
    """
    base_path = (Path(algorithms_dir) / variant.base).resolve()
    base = load_recipe(base_path)
    recipe: dict[str, Any] = {"extends": str(base_path), "name": f"bench-{variant.name}"}
    if variant.replay_ratio > 0 or "replay" in base["dataflow"]:
        recipe["dataflow"] = {"replay": {"ratio": variant.replay_ratio}}
    base_versions = int(base["stop"]["versions"])
    if versions is not None and versions != base_versions:
        if versions < 1:
            raise SystemExit(f"--versions: must be >= 1, got {versions}")
        stop = {"versions": versions}
        if "timeout_s" in base["stop"] and versions > base_versions:
            stop["timeout_s"] = math.ceil(base["stop"]["timeout_s"] * versions / base_versions)
        recipe["stop"] = stop
        trainers = copy.deepcopy(base["trainers"])
        for trainer_cfg in trainers:
            trainer_cfg.setdefault("trainer", {})["max_steps"] = versions * _publisher_every(trainer_cfg)
        recipe["trainers"] = trainers
        every = (base["dataflow"].get("eval") or {}).get("every")
        if every and versions % every:
            recipe.setdefault("dataflow", {})["eval"] = {"every": eval_every_for(versions, every)}
    return recipe


def eval_curve(summary: dict) -> list[list] | None:
    """``[[cumulative rollouts generated when version v was published, avg@k of v], ...]``.

    Rollouts counted under version u arrived while u was the current version, i.e. before
    u + 1 was published; so version v was trained from the rollouts of versions < v.
    None when the summary has no per-version counters.
    """
    per_version = summary.get("per_version")
    if not isinstance(per_version, dict):
        return None
    generated = {int(v): int((c or {}).get("rollouts_generated", 0)) for v, c in per_version.items()}
    curve = []
    for v, result in sorted(((int(v), r) for v, r in (summary.get("eval") or {}).items())):
        if result.get("avg_at_k") is None:
            continue
        cumulative = sum(n for u, n in generated.items() if u < v)
        curve.append([cumulative, round(float(result["avg_at_k"]), 4)])
    return curve


def rollouts_to_reach(curve: list[list] | None, accuracy: float | None) -> int | None:
    """The first cumulative rollout count at which the curve reaches ``accuracy``."""
    if not curve or accuracy is None:
        return None
    return next((int(x) for x, y in curve if y >= accuracy), None)


def result_row(variant: Variant, summary: dict, wall_s: float) -> dict:
    """One variant's result: the fields the issue asks for, a few counters, the curve."""
    counters = summary.get("counters") or {}
    return {
        "variant": variant.name,
        "replay_ratio": variant.replay_ratio,
        "rollouts_generated": summary.get("rollouts_generated"),
        "samples_trained": summary.get("samples_trained"),
        "final_eval_accuracy": summary.get("eval_accuracy_end"),
        "wall_s": round(wall_s, 1),
        "versions": summary.get("versions"),
        "groups_filtered": counters.get("groups_filtered"),
        "prompts_skipped": counters.get("prompts_skipped"),
        "replay_served": counters.get("replay_served"),
        "curve": eval_curve(summary),
    }


def json_line(row: dict) -> str:
    return json.dumps(row, separators=(", ", ": "))


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def text_table(rows: list[dict], columns: list[tuple[str, int, str, str]]) -> str:
    """``rows`` as a text table under a header line: ``columns`` are ``(header, width, key,
    format spec)``, the first left-aligned, the others right-aligned; a missing value is "-"."""
    def line(cells: list[str]) -> str:
        return "".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
                       for i, (c, (_, w, _, _)) in enumerate(zip(cells, columns)))

    head = line([header for header, _, _, _ in columns])
    body = [line([_fmt(r.get(key), spec) for _, _, key, spec in columns]) for r in rows]
    return "\n".join([head, "-" * len(head), *body])


def format_table(rows: list[dict]) -> str:
    return text_table(rows, TABLE_COLUMNS)


def finish(rows: list[dict], failures: list[str], json_lines: bool,
           table: Callable[[list[dict]], str]) -> int:
    """The end of a benchmark run: ``table(rows)`` on stdout (unless every row went out as a JSON
    line already), and the exit status: 1 after logging the variants that failed, else 0."""
    if not json_lines and rows:
        print(table(rows), flush=True)
    if failures:
        log(f"[bench] failed variants: {failures}")
        return 1
    return 0


def plot(rows: list[dict], out: Path) -> Path:
    """Accuracy against rollouts generated, one line per variant (Figure 18's axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r.get("curve"):
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, marker="o", markersize=3, label=r["variant"])
    vanilla = next((r for r in rows if r["variant"] == "vanilla"), None)
    if vanilla and vanilla.get("final_eval_accuracy") is not None:
        ax.axhline(vanilla["final_eval_accuracy"], color="grey", linestyle="--", linewidth=0.8,
                   label="vanilla final")
    ax.set_xlabel("rollouts generated")
    ax.set_ylabel("held-out accuracy (avg@k)")
    ax.set_title("toy recipe: data algorithms")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------- running


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prepare_shared_model(recipe_path: Path, run_root: Path) -> Path | None:
    """Build the recipe's initial policy once (every variant shares the parent's prepare step)."""
    from astralight.launch import prepare_initial_model
    from astralight.launch.recipe import substitute

    recipe = load_recipe(recipe_path)
    if not recipe.get("prepare"):
        return None
    shared = run_root / "_prepared"
    recipe = substitute(recipe, {"run_dir": shared, "seed": recipe.get("seed", 0)})
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the results
        return Path(prepare_initial_model(recipe, shared))


def run_variant(variant: Variant, recipe: dict, run_dir: Path, init_model: Path | None,
                quiet: bool) -> tuple[int, dict | None, str]:
    """Run one variant with the launcher; returns (exit code, summary or None, log tail)."""
    run_dir.mkdir(parents=True)
    recipe_path = run_dir / "variant.yaml"
    recipe_path.write_text(f"# {variant.name}: written by tests/benchmarks/bench_data_algorithms.py\n"
                           + yaml.safe_dump(recipe, sort_keys=False))
    if init_model is not None:
        shutil.copytree(init_model, run_dir / "models" / "init")
    argv = [sys.executable, "-m", "astralight.cli", "run", str(recipe_path), "--run-dir", str(run_dir)]
    # (the launcher keeps its own output in run_dir/launch.log)
    tail: list[str] = []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, cwd=REPO)
    try:
        for line in proc.stdout:
            tail = (tail + [line.rstrip("\n")])[-40:]
            if not quiet and not line.startswith("{"):  # the final JSON goes to the results
                log(f"  [{variant.name}] {line.rstrip()}")
    except KeyboardInterrupt:
        # Ctrl-C reached the launcher too (same process group): let it stop its components
        proc.wait()
        raise
    rc = proc.wait()
    summary = None
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    return rc, summary, "\n".join(tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                        help=f"subset to run (default all): {', '.join(v.name for v in VARIANTS)}")
    parser.add_argument("--versions", type=int, default=None,
                        help="trainer versions per variant (default: the recipe's stop.versions)")
    parser.add_argument("--run-root", default=None,
                        help="folder of the runs (default runs/bench_data_algorithms-TIMESTAMP)")
    parser.add_argument("--json", action="store_true", help="one JSON object per variant on stdout")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="accuracy against rollouts generated, one line per variant")
    parser.add_argument("--match-tol", type=float, default=0.0,
                        help="rollouts_to_vanilla: reach vanilla's final accuracy minus this")
    parser.add_argument("--quiet", action="store_true", help="only the start and end of each variant")
    parser.add_argument("--algorithms-dir", default=str(ALGORITHMS_DIR),
                        help="where the variants' base recipes live")
    args = parser.parse_args(argv)

    variants = select_variants(args.variants)
    algorithms_dir = Path(args.algorithms_dir)
    recipes = {v.name: variant_recipe(v, args.versions, algorithms_dir) for v in variants}
    run_root = Path(args.run_root or REPO / "runs" / f"bench_data_algorithms-{time.strftime('%Y%m%d-%H%M%S')}")
    run_root = run_root.resolve()
    existing = [v.name for v in variants if (run_root / v.name).exists()]
    if existing:
        # a run folder holds the dataflow's durable state: reusing one would resume that run
        raise SystemExit(f"--run-root: {run_root} already holds runs of {existing}; choose another")
    run_root.mkdir(parents=True, exist_ok=True)
    log(f"[bench] {len(variants)} variant(s), run folders under {run_root}")

    t0 = time.time()
    init_model = prepare_shared_model(algorithms_dir / "vanilla.yaml", run_root)
    if init_model is not None:
        log(f"[bench] shared initial policy {init_model} ({time.time() - t0:.0f}s)")

    rows, failures = [], []
    vanilla_final = None
    for i, variant in enumerate(variants, 1):
        recipe = recipes[variant.name]
        log(f"[bench] ({i}/{len(variants)}) {variant.name}: start "
            f"(extends {Path(recipe['extends']).name}, replay ratio {variant.replay_ratio})")
        t_start = time.time()
        rc, summary, tail = run_variant(variant, recipe, run_root / variant.name, init_model, args.quiet)
        wall = time.time() - t_start
        if rc != 0 or summary is None:
            failures.append(variant.name)
            log(f"[bench] ({i}/{len(variants)}) {variant.name}: FAILED (exit {rc}) after {wall:.0f}s; "
                f"log {run_root / variant.name / 'launch.log'}; tail:\n{tail}")
            continue
        row = result_row(variant, summary, wall)
        if variant.name == "vanilla":
            vanilla_final = row["final_eval_accuracy"]
        if vanilla_final is not None:
            row["rollouts_to_vanilla"] = rollouts_to_reach(row["curve"], vanilla_final - args.match_tol)
        rows.append(row)
        log(f"[bench] ({i}/{len(variants)}) {variant.name}: done in {wall:.0f}s: "
            f"rollouts {row['rollouts_generated']}, trained {row['samples_trained']}, "
            f"final accuracy {_fmt(row['final_eval_accuracy'], '.3f')}")
        if args.json:
            print(json_line(row), flush=True)

    if args.plot and rows:
        log(f"[bench] plot: {plot(rows, Path(args.plot))}")
    return finish(rows, failures, args.json, format_table)


if __name__ == "__main__":
    sys.exit(main())
