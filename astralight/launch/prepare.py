"""``astralight prepare RECIPE``: run a recipe's ``prepare`` step alone, into the run folder the
launch would use, and exit. Why: a warm start or a model conversion can take minutes (SmolLM2's
GGUF conversion, the toy's supervised warm start); preparing once, before a sweep or on a login
node, lets every later ``astralight run --run-dir`` (or ``--resume``) reuse it, as the launcher
reuses ``RUN/models/init`` whenever it holds a ``config.json``."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from astralight.launch import _default_recipe, merged_recipe
    from astralight.launch.recipe import RecipeError, load_recipe, substitute, use_pythonpath
    from astralight.launch.runner import _run_folder, prepare_initial_model

    parser = argparse.ArgumentParser(
        prog="astralight prepare", allow_abbrev=False,
        description="Run a recipe's prepare step (build or convert the initial model) into "
                    "RUN/models/init and exit; astralight run --run-dir RUN reuses it.")
    parser.add_argument("recipe", nargs="?", default=None,
                        help="recipe YAML (default: the embedded toy recipe)")
    parser.add_argument("--run-dir", default=None,
                        help="run folder (default runs/NAME-TIMESTAMP, as astralight run)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="set a recipe key first (as astralight run)")
    args = parser.parse_args(argv)
    given = Path(args.recipe) if args.recipe else _default_recipe()
    merged_dir = None
    try:
        path = given
        if args.overrides:
            merged_dir, merged = merged_recipe(given, args.overrides)
            path = Path(merged)
        recipe = load_recipe(path)
        if not recipe.get("prepare"):
            print(f"astralight prepare: {given} has no prepare step; its model paths are used "
                  "as they are", file=sys.stderr)
            return 0
        use_pythonpath(recipe)
        run_dir = _run_folder(given, recipe, Path(args.run_dir) if args.run_dir else None)
        run_dir.mkdir(parents=True, exist_ok=True)
        recipe = substitute(recipe, {"run_dir": run_dir, "seed": recipe.get("seed", 0),
                                     "dataflow_url": "http://127.0.0.1:0"})
        out = prepare_initial_model(recipe, run_dir)
        print(f"astralight prepare: {out}; start with: astralight run {given} --run-dir {run_dir}",
              flush=True)
        return 0
    except RecipeError as exc:
        print(f"astralight prepare: {exc}", file=sys.stderr)
        return 2
    finally:
        if merged_dir is not None:
            shutil.rmtree(merged_dir, ignore_errors=True)
