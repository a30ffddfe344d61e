"""An autoscaled rollout pool against a small and a large fixed pool, on the toy recipe.

Runs ``astralight run`` (the real launcher: dataflow service, vLLM RaaS, Lightning trainer, as
subprocesses) three ways, from the same warm-started policy (built once), with the same seed and
the same number of trainer versions:

    fixed_small   a fixed pool of ``--small`` RaaS instances
    fixed_large   a fixed pool of ``--large`` instances
    autoscale     ``astralight autoscale`` between the two (starts at ``--small``), acting on the
                  dataflow's balance report every ``--every`` versions, ``--cooldown-s`` apart

Every instance is latency-bound rather than CPU-bound: ``--max-concurrency`` tasks per lease
cycle and ``--cycle-delay-s`` of delay per cycle (as a remote tool or a slow accelerator would
add), so on a two-core machine the pool's size, not the cores, sets rollout throughput; the RaaS
share one core and the trainer has the other (the toy recipe's cpu_affinity). The variants'
recipes extend ``configs/toy/autoscale.yaml`` (written into each run folder as ``variant.yaml``).

Per variant, one JSON line (``--json``) with: ``wall_s`` (the whole run, start-up included),
``rollout_capacity_seconds`` (sum over the dataflow's instance table of alive_s x
capacity_units), ``trainer_seconds`` (the trainer process's lifetime), ``total_capacity_seconds``
(their sum: what the run occupied), ``wait_fraction`` (trainer wait / step time over the whole
run), ``final_eval_accuracy`` (held-out avg@k of the last version), ``seconds_per_version``
(first to last publication, per version), the
largest pool and, for autoscale, its decisions. The expected shape: the small pool is cheap and
slow (the trainer waits), the large one fast and costly (rollout overproduces and goes stale),
the autoscaled one in between on both. Whatever it measures is what it reports.

    python tests/benchmarks/bench_autoscale.py --json          # ~12 min on two CPU cores
    python tests/benchmarks/bench_autoscale.py --variants autoscale --versions 20

Measured here (the defaults: 40 versions, batch 1024, pools 1 / 3, 16 tasks x 0.5 s delay per
cycle; two CPU cores shared with other work, so wall times are rough):

    variant      wall_s  rollout_cap_s  trainer_s  total_cap_s  wait   s/version  final acc
    fixed_small   240.9          217.9      230.5        448.4  0.876      5.12      0.781
    fixed_large   164.8          293.2      149.1        442.3  0.776      2.21      0.812
    autoscale     163.9          269.7      150.6        420.3  0.771      3.19      0.793

The autoscaler went 1 -> 3 at version 5 (report target ceil(1/(1-w)) clamped to 3) and held
there: in this setting the trainer (~0.6 s per 1024-sample step) outruns even three instances
sharing one core, so no window asked to scale down. It matched the large pool's wall time for
5% less capacity: its one first instance was serving after 12 s, where three starting together on
one core took 46 s. A setting where the large pool
overproduces (more instances, or a shorter --cycle-delay-s) would show the scale-down side;
tests/integration/test_autoscale.py shows it on a real pool.

Progress lines go to stderr; results to stdout (one JSON object per variant with ``--json``,
else a table). A failed variant is reported with its log's tail; the others still run, and the
script exits 1 at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: make the tests package importable
    sys.path.insert(0, str(REPO))

from astralight.launch.recipe import load_recipe  # noqa: E402
from tests.benchmarks.bench_async_vs_sync import publish_times, seconds_per_version  # noqa: E402
from tests.benchmarks.bench_data_algorithms import (_fmt, eval_every_for, finish,  # noqa: E402
                                                    log, prepare_shared_model, run_variant,
                                                    text_table)

RECIPE = REPO / "configs" / "toy" / "autoscale.yaml"
VARIANTS = ("fixed_small", "fixed_large", "autoscale")
#: the columns of :func:`format_table`: (header, width, row key, format spec)
TABLE_COLUMNS = [("variant", 13, "variant", ""), ("wall s", 8, "wall_s", ".0f"),
                 ("rollout cap s", 15, "rollout_capacity_seconds", ""),
                 ("trainer s", 11, "trainer_seconds", ""),
                 ("total cap s", 13, "total_capacity_seconds", ""),
                 ("wait", 7, "wait_fraction", ".2f"), ("final acc", 10, "final_eval_accuracy", ".3f"),
                 ("pool", 6, "largest_pool", "")]


@dataclass(frozen=True)
class Variant:
    name: str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="which runs (default all three, in this order)")
    p.add_argument("--versions", type=int, default=40, help="trainer versions per run")
    p.add_argument("--small", type=int, default=1, help="instances of the small fixed pool")
    p.add_argument("--large", type=int, default=3, help="instances of the large fixed pool")
    p.add_argument("--cycle-delay-s", type=float, default=0.5,
                   help="every instance's delay per lease cycle (latency-bound instances)")
    p.add_argument("--max-concurrency", type=int, default=16, help="tasks per lease cycle")
    p.add_argument("--batch-size", type=int, default=1024,
                   help="samples per trainer version (large: a step of seconds, so that an "
                        "instance's ~20 s start-up is short against the run)")
    p.add_argument("--every", type=int, default=5, help="autoscale: versions between reports")
    p.add_argument("--cooldown-s", type=float, default=30.0, help="autoscale: seconds between actions")
    p.add_argument("--eval-k", type=int, default=16, help="samples per held-out prompt")
    p.add_argument("--recipe", type=Path, default=RECIPE, help="the recipe the variants extend")
    p.add_argument("--run-root", type=Path, default=None,
                   help="folder of the runs (default runs/bench_autoscale-TIMESTAMP)")
    p.add_argument("--json", action="store_true", help="one JSON object per variant on stdout")
    p.add_argument("--print-recipes", action="store_true",
                   help="print each variant's recipe (JSON) and exit without running")
    p.add_argument("--quiet", action="store_true", help="only the start and end of each variant")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuse unusable settings, naming the flag."""
    if args.versions < 1:
        raise SystemExit(f"--versions: must be >= 1, got {args.versions}")
    if not 1 <= args.small < args.large:
        raise SystemExit(f"--small / --large: need 1 <= small < large, got {args.small} / {args.large}")
    if args.cycle_delay_s < 0:
        raise SystemExit(f"--cycle-delay-s: must be >= 0, got {args.cycle_delay_s}")
    for flag in ("max_concurrency", "batch_size", "every", "eval_k"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")


def variant_recipe(name: str, args: argparse.Namespace) -> dict:
    """The recipe of one variant: extends ``args.recipe``, restates what differs.

    Lists replace when merged, so the RaaS list and the trainer list are restated in full (from
    the resolved parent). A fixed pool is ``n`` copies of raas[0] with seeds 0..n-1 and no
    autoscaler (``autoscale: null``); the autoscaled one keeps raas[0] as its template.
    """
    base_path = Path(args.recipe).resolve()
    base = load_recipe(base_path)
    raas0 = copy.deepcopy(base["raas"][0])
    raas0.update(cycle_delay_s=args.cycle_delay_s, max_concurrency=args.max_concurrency)
    trainers = copy.deepcopy(base["trainers"])
    for t in trainers:
        t.setdefault("trainer", {})["max_steps"] = args.versions
        t["data"]["init_args"]["batch_size"] = args.batch_size
    # evaluated at 0 and at the end only: evaluation runs on the same pool and would blur it
    stop: dict[str, Any] = {"versions": args.versions}
    base_versions = int(base["stop"]["versions"])
    if args.versions > base_versions and "timeout_s" in base["stop"]:
        stop["timeout_s"] = math.ceil(base["stop"]["timeout_s"] * args.versions / base_versions)
    recipe: dict[str, Any] = {
        "extends": str(base_path), "name": f"bench-autoscale-{name}", "stop": stop,
        "dataflow": {"eval": {"every": eval_every_for(args.versions, args.versions), "k": args.eval_k},
                     "max_inflight_tasks": args.large * args.max_concurrency,
                     "max_buffered_samples": max(2 * args.batch_size, 512)},
        "trainers": trainers,
    }
    if name == "autoscale":
        recipe["raas"] = [raas0]
        recipe["autoscale"] = {"min_instances": args.small, "max_instances": args.large,
                               "initial": args.small, "every": args.every,
                               "cooldown_s": args.cooldown_s}
    else:
        n = args.small if name == "fixed_small" else args.large
        recipe["raas"] = [dict(copy.deepcopy(raas0), seed=int(raas0.get("seed", 0)) + i)
                          for i in range(n)]
        recipe["autoscale"] = None
    return recipe


def wait_fraction(per_version: dict | None) -> float | None:
    """Trainer wait / step time over every version of the run (the summary's per-version counters)."""
    if not isinstance(per_version, dict):
        return None
    wait = sum(int((c or {}).get("trainer_wait_ms", 0)) for c in per_version.values())
    step = sum(int((c or {}).get("trainer_step_ms", 0)) for c in per_version.values())
    return round(wait / step, 4) if step else None


def largest_pool(name: str, args: argparse.Namespace, summary: dict) -> int | None:
    if name == "fixed_small":
        return args.small
    if name == "fixed_large":
        return args.large
    targets = [h.get("target") for h in summary.get("pool") or [] if h.get("action") != "shutdown"]
    return max((t for t in targets if t is not None), default=None)


def result_row(name: str, args: argparse.Namespace, summary: dict, wall_s: float,
               s_per_version: float | None = None) -> dict:
    rollout = summary.get("rollout_capacity_seconds")
    trainer = summary.get("trainer_seconds")
    versions = summary.get("versions")
    row = {
        "variant": name,
        "versions": versions,
        "wall_s": round(wall_s, 1),
        "rollout_capacity_seconds": rollout,
        "trainer_seconds": trainer,
        "total_capacity_seconds": round(rollout + trainer, 1) if rollout is not None
        and trainer is not None else None,
        "wait_fraction": wait_fraction(summary.get("per_version")),
        "final_eval_accuracy": summary.get("eval_accuracy_end"),
        "seconds_per_version": round(s_per_version, 3) if s_per_version is not None else None,
        "largest_pool": largest_pool(name, args, summary),
        "rollouts_generated": summary.get("rollouts_generated"),
        "stale_dropped": (summary.get("counters") or {}).get("stale_dropped"),
    }
    if name == "autoscale":
        row["decisions"] = [{k: h.get(k) for k in ("version", "action", "pool", "target")}
                            for h in summary.get("pool") or []]
    return row


def format_table(rows: list[dict]) -> str:
    return text_table(rows, TABLE_COLUMNS)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    names = [v for v in VARIANTS if v in args.variants]
    recipes = {name: variant_recipe(name, args) for name in names}
    if args.print_recipes:
        for name in names:
            print(json.dumps({"variant": name, "recipe": recipes[name]}), flush=True)
        return 0
    root = (args.run_root or REPO / "runs" / f"bench_autoscale-{time.strftime('%Y%m%d-%H%M%S')}")
    root = root.resolve()
    existing = [n for n in names if (root / n).exists()]
    if existing:
        raise SystemExit(f"--run-root: {root} already holds runs of {existing}; choose another")
    root.mkdir(parents=True, exist_ok=True)
    log(f"[bench] {names}, {args.versions} versions, batch {args.batch_size}, pools "
        f"{args.small} / {args.large}, cycle delay {args.cycle_delay_s}s x {args.max_concurrency} "
        f"tasks; runs under {root}")
    t0 = time.time()
    init_model = prepare_shared_model(Path(args.recipe), root)
    if init_model is not None:
        log(f"[bench] shared initial policy {init_model} ({time.time() - t0:.0f}s)")
    rows, failures = [], []
    for i, name in enumerate(names, 1):
        log(f"[bench] ({i}/{len(names)}) {name}: start")
        t_start = time.time()
        rc, summary, tail = run_variant(Variant(name), recipes[name], root / name, init_model,
                                        args.quiet)
        wall = time.time() - t_start
        if rc != 0 or summary is None:
            failures.append(name)
            log(f"[bench] ({i}/{len(names)}) {name}: FAILED (exit {rc}) after {wall:.0f}s; log "
                f"{root / name / 'launch.log'}; tail:\n{tail}")
            continue
        try:  # first to last publication, from the run's dataflow database
            spv = seconds_per_version(publish_times(root / name))
        except Exception as exc:  # noqa: BLE001 -- a figure missing, not a failed run
            log(f"[bench] {name}: publication times not read ({exc})")
            spv = None
        row = result_row(name, args, summary, wall, spv)
        rows.append(row)
        log(f"[bench] ({i}/{len(names)}) {name}: done in {wall:.0f}s: capacity "
            f"{row['total_capacity_seconds']} s, wait {row['wait_fraction']}, final accuracy "
            f"{_fmt(row['final_eval_accuracy'], '.3f')}")
        if args.json:
            print(json.dumps(row), flush=True)
    return finish(rows, failures, args.json, format_table)


if __name__ == "__main__":
    sys.exit(main())
