"""``astralight run``'s command line: :func:`main` parses it and hands the recipe to
:func:`astralight.launch.runner.run` (or ``--check``, ``--export-configs``, ``--print-recipe``);
the package docstring (:mod:`astralight.launch`) says what a run does."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from astralight.launch.components import _default_recipe
from astralight.launch.export import EXPORT_PORT, export_configs, export_values
from astralight.launch.recipe import RecipeError, load_recipe
from astralight.launch.runner import run

__all__ = ["main", "merged_recipe"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="astralight run", description="Start a whole run on this machine (dataflow, rollout "
        "services, trainers), watch it, and stop it cleanly.", allow_abbrev=False)
    parser.add_argument("recipe", nargs="?", default=None,
                        help="recipe YAML (default: the embedded toy recipe; with --resume: the "
                             "recipe saved in the run folder)")
    parser.add_argument("--run-dir", default=None, help="run folder (default runs/NAME-TIMESTAMP)")
    parser.add_argument("--resume", metavar="RUN_DIR", default=None,
                        help="continue an interrupted run folder: the dataflow on its state, "
                             "trainers from their last checkpoints, until stop.versions")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--export-configs", metavar="DIR", default=None,
                        help="write each component's config to DIR (dataflow.yaml, raas.yaml, "
                             "trainer.yaml; trainer-MODEL_ID.yaml, raas-I.yaml when a recipe has "
                             "several) and exit, to start the components by hand; {run_dir} is "
                             "--run-dir (default runs/NAME), the port the recipe's (default "
                             f"{EXPORT_PORT}) or --port, {{init_model}} RUN_DIR/models/init or "
                             "--init-model")
    parser.add_argument("--port", type=int, default=None,
                        help="with --export-configs: the dataflow's port")
    parser.add_argument("--init-model", metavar="PATH", default=None,
                        help="with --export-configs: the initial model folder ({init_model})")
    parser.add_argument("--check", action="store_true",
                        help="check the recipe, every component config (with the component's "
                             "own parser) and every local model and data path, then exit: 0 "
                             "with one OK line, 2 with the key at fault; starts nothing")
    parser.add_argument("--no-check", action="store_true",
                        help="start without checking the component configs first (the recipe's "
                             "own keys are always checked)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="set a recipe key before anything else reads it (dotted path, list "
                             "items by index, the value read as YAML; repeatable), e.g. --set "
                             "stop.versions=10 --set trainers.0.model.init_args.lr=1e-4")
    parser.add_argument("--backend", choices=("local", "ray"), default="local",
                        help="where the components run: local processes of this machine "
                             "(default), or ray: Ray actors on an existing Ray cluster "
                             "(recipe.ray: address, resources per component; the ray extra)")
    parser.add_argument("--print-recipe", action="store_true",
                        help="print the recipe as it would run (extends merged, --set applied; "
                             "{run_dir}-style placeholders are filled at launch) and exit")
    args = parser.parse_args(argv)
    merged_dir = None
    try:
        if args.overrides or args.print_recipe:
            given = (Path(args.recipe) if args.recipe else
                     Path(args.resume) / "recipe.yaml" if args.resume else _default_recipe())
            merged_dir, args.recipe = merged_recipe(given, args.overrides)
            if args.print_recipe:
                print(Path(args.recipe).read_text(), end="")
                return 0
        if args.check:
            from astralight.launch.check import check_recipe

            folder = args.resume or args.run_dir
            recipe_path = (Path(args.recipe) if args.recipe else
                           Path(args.resume) / "recipe.yaml" if args.resume else _default_recipe())
            result = check_recipe(recipe_path, run_dir=Path(folder) if folder else None)
            for note in result.notes:
                print(f"note: {note}", file=sys.stderr)
            print(f"astralight run --check: {result.line()}", flush=True)
            return 0
        if args.export_configs:
            recipe_path = Path(args.recipe) if args.recipe else _default_recipe()
            for path in export_configs(recipe_path, Path(args.export_configs), port=args.port,
                                       run_dir=args.run_dir, init_model=args.init_model):
                print(path)
            recipe = load_recipe(recipe_path)
            values = export_values(recipe, recipe_path, args.port, args.run_dir, args.init_model)
            init = values["init_model"]
            if init and not Path(init).exists():
                print(f"note: {{init_model}} is {init}, not built yet: build it with the recipe's "
                      f"prepare step ({recipe['prepare']['function']}(out_dir={init!r}, "
                      "**prepare.kwargs); for the toy recipe `astralight prepare-toy "
                      f"{init}`), or give --init-model PATH", file=sys.stderr)
            return 0
        if args.resume:
            if args.run_dir and Path(args.run_dir).resolve() != Path(args.resume).resolve():
                raise RecipeError("--run-dir: with --resume the run folder is RUN_DIR; "
                                  "give one of them")
            run(Path(args.recipe) if args.recipe else None, Path(args.resume),
                quiet=args.quiet, resume=True, check=not args.no_check, backend=args.backend)
        else:
            run(Path(args.recipe) if args.recipe else _default_recipe(),
                Path(args.run_dir) if args.run_dir else None, quiet=args.quiet,
                check=not args.no_check, backend=args.backend)
    except RecipeError as exc:
        print(f"astralight run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        print(f"astralight run: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if merged_dir is not None:
            shutil.rmtree(merged_dir, ignore_errors=True)
    return 0


def merged_recipe(path: Path, overrides: list[str]) -> tuple[str, str]:
    """``path``'s recipe with its ``extends`` merged and ``overrides`` (``--set``) applied,
    checked (:func:`load_recipe`, every problem naming its key) and written to a temporary
    folder; returns ``(folder, recipe file)``. The run folder keeps it as ``recipe.yaml``."""
    import tempfile

    import yaml

    from astralight.launch.recipe import apply_overrides, resolve_recipe

    recipe = apply_overrides(resolve_recipe(Path(path)), overrides)
    folder = tempfile.mkdtemp(prefix="astralight-recipe-")
    out = Path(folder) / Path(path).name
    out.write_text(yaml.safe_dump(recipe, sort_keys=False))
    try:
        load_recipe(out)
    except RecipeError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise RecipeError(str(exc).replace(str(out), f"{path} with --set applied")) from None
    return folder, str(out)
