"""The toy run of today's code against the code before the continuous-batching engine (issue 15).

    python tests/benchmarks/bench_toy_vs_before.py --json [--pairs 3] [--before d5045c4]

Both arms run the whole toy (``astralight run``, 150 versions, the real launcher, dataflow, vLLM
RaaS and trainer) on this machine, one pair after the other, from one warm start built once and
copied into each run folder (so neither arm pays the prepare step):

- ``new``: this checkout, with the toy recipe it ships;
- ``before``: the commit ``--before`` (default ``d5045c4``, the last one with the serialized
  engine and lock-step episodes), with the toy recipe *it* shipped, checked out as a git
  worktree under ``--out-dir``. That tree's ``raas/``, ``callbacks/``, ``datamodules/`` and
  ``examples/toy`` are linked into its ``astralight/`` and it runs with ``PYTHONPATH`` set to it,
  because the editable install maps ``astralight.raas`` and the others to this checkout. A
  ``sitecustomize.py`` there asks for the AMX tile state, which the code before did not (on a CPU
  with AMX its RaaS dies with SIGILL).

Per run, from the run's own records and with today's definitions
(:func:`astralight.launch.summary.trainer_wait_fraction` and
:func:`~astralight.launch.summary.wall_s_to_accuracy`, which the code before did not print):
``trainer_wait_fraction``, ``wall_s_to_085`` (the dataflow's start to the publication of the
first version evaluated at 0.85 or better), ``version_085`` and the evaluations. Prints one JSON
object: every run, each arm's medians, ``ratio_wall_s_to_085`` (new / before, of the medians) and
the machine's load before and after. Needs the repository's git history (a full clone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from astralight.launch.summary import TIME_TO_ACCURACY, trainer_wait_fraction, wall_s_to_accuracy

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make the tests package importable
    sys.path.insert(0, str(ROOT))

from tests.benchmarks.bench_startup import _load, build_init, fresh_run_dir  # noqa: E402

BEFORE = "d5045c4"
LINKS = {"raas": "../raas", "callbacks": "../callbacks", "datamodules": "../datamodules",
         "toy": "../examples/toy"}  # setup.cfg's package_dir, as links inside the old tree


def before_tree(out: Path, rev: str) -> Path:
    """A worktree of ``rev`` whose packages import from itself alone."""
    tree = out / f"before-{rev}"
    if not (tree / "astralight").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force",
                        str(tree), rev], check=True, stdout=subprocess.DEVNULL)
    for name, target in LINKS.items():
        link = tree / "astralight" / name
        if not link.exists():
            link.symlink_to(target)
    (tree / "sitecustomize.py").write_text(AMX_SITECUSTOMIZE.format(path=ROOT / "raas"
                                                                    / "cpu_features.py"))
    return tree


#: the ``before`` arm's sitecustomize (its tree is on PYTHONPATH, so every process of the arm
#: runs it): the code before asked for no AMX permission, and on a CPU with AMX its first vLLM
#: forward pass dies with SIGILL (exit -4); this asks, with today's raas/cpu_features.py
AMX_SITECUSTOMIZE = '''"""Written by bench_toy_vs_before.py: request the AMX tile state."""
import importlib.util

_spec = importlib.util.spec_from_file_location("_bench_cpu_features", "{path}")
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
_mod.request_amx()
'''


def one_run(out: Path, init: Path, arm: str, index: int, tree: Path | None) -> dict:
    run_dir = fresh_run_dir(out / f"{arm}-{index}", init)
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    load = _load()
    with open(out / f"{arm}-{index}.log", "w") as log:
        code = subprocess.call([sys.executable, "-m", "astralight.cli", "run", "--run-dir",
                                str(run_dir)], env=env, stdout=log, stderr=subprocess.STDOUT,
                               cwd=str(tree or ROOT))
    if code != 0:
        raise RuntimeError(f"{arm} run {index} exited {code}; see {out}/{arm}-{index}.log")
    return {"arm": arm, "index": index, **run_figures(run_dir), "load_before": load}


def run_figures(run_dir: Path) -> dict:
    """A finished toy run's figures by today's definitions, from its ``summary.json`` (whose
    ``eval`` holds complete evaluations only, in both arms) and its dataflow's SQLite state."""
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = {int(v): {**r, "complete": True} for v, r in summary["eval"].items()}
    reached = [v for v in sorted(evals) if evals[v]["avg_at_k"] >= TIME_TO_ACCURACY]
    return {"trainer_wait_fraction": trainer_wait_fraction(summary["counters"]),
            "wall_s_to_085": wall_s_to_accuracy(run_dir / "dataflow", "policy", evals,
                                                TIME_TO_ACCURACY),
            "version_085": reached[0] if reached else None, "wall_s": summary.get("wall_s"),
            "eval": {v: round(evals[v]["avg_at_k"], 3) for v in sorted(evals)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--before", default=BEFORE, help="the commit of the 'before' arm")
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/bench_toy_vs_before"))
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error("--pairs: at least 1")
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    tree = before_tree(out, args.before)
    init = build_init(out / "init")
    load_before = _load()
    runs = []
    for i in range(args.pairs):
        for arm in ("new", "before") if i % 2 == 0 else ("before", "new"):
            runs.append(one_run(out, init, arm, i, tree if arm == "before" else None))
            if not args.json:
                print(json.dumps(runs[-1]), flush=True)
    medians = {arm: {k: round(statistics.median(values), 3)
                     for k in ("trainer_wait_fraction", "wall_s_to_085", "version_085", "wall_s")
                     if (values := [r[k] for r in runs if r["arm"] == arm and r[k] is not None])}
               for arm in ("new", "before")}
    ratio = (round(medians["new"]["wall_s_to_085"] / medians["before"]["wall_s_to_085"], 3)
             if "wall_s_to_085" in medians["new"] and "wall_s_to_085" in medians["before"]
             else None)
    print(json.dumps({"bench": "toy_vs_before", "before": args.before, "pairs": args.pairs,
                      "runs": runs, "median": medians, "ratio_wall_s_to_085": ratio,
                      "load_before": load_before, "load_after": _load()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
