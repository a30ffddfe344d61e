"""How long a run takes to start: launcher start to the first rollout and the first trained version.

    python tests/benchmarks/bench_startup.py --json [--repeats 3] [--versions 10]

Both arms run ``astralight run`` on the toy recipe (the real launcher, dataflow, vLLM RaaS and
trainer), from one warm start built once and copied into each run folder (so no arm pays the
prepare step), for ``--versions`` versions, alternating arm order per repeat:

- ``new``: the launcher as shipped: the RaaS and trainer prewarmed (:mod:`astralight.launch.prewarm`),
  the recipe's ``kv_cache_memory_bytes`` (256 MiB) as the engine's KV cache;
- ``no_prewarm``: ``ASTRALIGHT_PREWARM=0``: every component imports after the check;
- ``baseline``: ``ASTRALIGHT_PREWARM=0`` and ``kv_cache_memory_bytes: 1073741824``, what the
  launcher did before (its ``VLLM_CPU_KVCACHE_SPACE=1`` default replaced the recipe's size with
  1 GiB, which the RaaS allocated and zeroed at every start).

Per run, from the run's own records (the dataflow's SQLite state): ``launch_to_raas_s`` (the
launcher's start to the RaaS's registration), ``dataflow_to_raas_s`` (the dataflow's start to
it), ``launch_to_v1_s`` and ``dataflow_to_v1_s`` (to the publication of version 1), and the
RaaS's ``engines_up_s`` (its own log), and ``steady_s_per_version`` (version 10 to the last: the
pace once started, which the start-up must not change). Prints one JSON object: every run, each
arm's medians, ``ratio_launch_to_v1`` and ``ratio_dataflow_to_v1`` (new / baseline, or the last
arm run when ``--arms`` leaves baseline out) and the machine's load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
TOY_RECIPE = ROOT / "examples" / "toy" / "recipe.yaml"
ARMS = {"new": ({}, None), "no_prewarm": ({"ASTRALIGHT_PREWARM": "0"}, None),
        "baseline": ({"ASTRALIGHT_PREWARM": "0"}, 1 << 30)}
FIGURES = ("launch_to_raas_s", "dataflow_to_raas_s", "launch_to_v1_s", "dataflow_to_v1_s",
           "engines_up_s", "wall_s", "steady_s_per_version")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def build_init(out: Path) -> Path:
    """The toy's warm start, built once (the toy recipe's prepare step and arguments)."""
    if not (out / "config.json").exists():
        recipe = yaml.safe_load(TOY_RECIPE.read_text())
        from astralight.tasks.warmstart import build_toy_policy

        build_toy_policy(out, **recipe["prepare"]["kwargs"])
    return out


def fresh_run_dir(run_dir: Path, init: Path) -> Path:
    """An empty run folder holding a copy of the prepared warm start (the launcher reuses it)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "models").mkdir(parents=True)
    shutil.copytree(init, run_dir / "models" / "init")
    return run_dir


def recipe_for(versions: int, kv_bytes: int | None) -> dict:
    recipe = yaml.safe_load(TOY_RECIPE.read_text())
    recipe["stop"].update(versions=versions, final_eval_timeout_s=0)
    recipe["trainers"][0]["trainer"]["max_steps"] = versions
    if kv_bytes is not None:
        recipe["raas"][0]["engines"]["policy"]["kv_cache_memory_bytes"] = kv_bytes
    return recipe


def one_run(out: Path, init: Path, arm: str, index: int, versions: int) -> dict:
    env_changes, kv_bytes = ARMS[arm]
    run_dir = fresh_run_dir(out / f"{arm}-{index}", init)
    recipe_path = out / f"{arm}-{index}.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe_for(versions, kv_bytes), sort_keys=False))
    env = {**os.environ, **env_changes}
    launched = time.time()
    with open(out / f"{arm}-{index}.log", "w") as log:
        code = subprocess.call([sys.executable, "-m", "astralight.cli", "run", str(recipe_path),
                                "--run-dir", str(run_dir), "--quiet"], env=env, stdout=log,
                               stderr=subprocess.STDOUT, cwd=str(out))
    if code != 0:
        raise RuntimeError(f"{arm} run {index} exited {code}; see {out}/{arm}-{index}.log")
    db = sqlite3.connect(f"file:{run_dir / 'dataflow' / 'dataflow.db'}?mode=ro", uri=True)
    try:
        started = float(dict(db.execute("SELECT key, value FROM meta"))["started_at"])
        raas = min(r for (r,) in db.execute("SELECT registered_at FROM instances"))
        v1 = db.execute("SELECT published_at FROM version_times WHERE version = 1").fetchone()[0]
        times = dict(db.execute("SELECT version, published_at FROM version_times"))
    finally:
        db.close()
    up = re.search(r"engines_up_s=([0-9.]+)", (run_dir / "logs" / "raas-0.log").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"arm": arm, "index": index, "launch_to_raas_s": round(raas - launched, 2),
            "dataflow_to_raas_s": round(raas - started, 2),
            "launch_to_v1_s": round(v1 - launched, 2), "dataflow_to_v1_s": round(v1 - started, 2),
            "engines_up_s": float(up.group(1)) if up else None, "wall_s": summary.get("wall_s"),
            "steady_s_per_version": _steady(times)}


def _steady(times: dict[int, float]) -> float | None:
    """Seconds per version from version 10 to the last (past the start-up), None if too few."""
    last = max(times)
    if last < 20 or 10 not in times:
        return None
    return round((times[last] - times[10]) / (last - 10), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/bench_startup"))
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS))
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    args = ap.parse_args(argv)
    wanted = args.arms.split(",")
    unknown = sorted(set(wanted) - set(ARMS))
    if unknown or "new" not in wanted or len(set(wanted)) < 2:
        ap.error(f"--arms: name 'new' and at least one of {list(ARMS)[1:]}"
                 + (f"; unknown {unknown}" if unknown else ""))
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    init = build_init(out / "init")
    load_before = _load()
    runs = []
    for i in range(args.repeats):
        names = [a for a in ARMS if a in wanted]
        for arm in names[i % len(names):] + names[:i % len(names)]:  # each arm first in turn
            runs.append(one_run(out, init, arm, i, args.versions))
            if not args.json:
                print(json.dumps(runs[-1]), flush=True)
    medians = {arm: {k: round(statistics.median(values), 3) for k in FIGURES
                     if (values := [r[k] for r in runs if r["arm"] == arm and r[k] is not None])}
               for arm in ARMS if any(r["arm"] == arm for r in runs)}
    base = "baseline" if "baseline" in medians else list(medians)[-1]
    result = {"bench": "startup", "repeats": args.repeats, "versions": args.versions,
              "runs": runs, "median": medians,
              "baseline_arm": base,
              "ratio_launch_to_v1": round(medians["new"]["launch_to_v1_s"]
                                          / medians[base]["launch_to_v1_s"], 3),
              "ratio_dataflow_to_v1": round(medians["new"]["dataflow_to_v1_s"]
                                            / medians[base]["dataflow_to_v1_s"], 3),
              "load_before": load_before, "load_after": _load()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
