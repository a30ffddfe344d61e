"""``astralight run``: start a whole run on this machine, watch it, stop it cleanly.

The launcher owns nothing a component does. It reads a recipe (one YAML holding the dataflow,
RaaS and trainer configs), writes each component's config into the run folder, starts each
component as its own process with the same command a cluster would use, shows one progress
line, and on completion (or Ctrl-C, or a component failing) stops them in order: trainers,
rollout services, dataflow. The run folder keeps configs, logs, TensorBoard events,
checkpoints and the dataflow's SQLite state.

Reading the recipe -- its placeholders (``{run_dir}``, ``{dataflow_url}``, ``{init_model}``,
``{seed}``), ``extends`` inheritance (lists replace; a mapping over a list merges the entries it
picks by index or model_id), ``pythonpath`` and the typed schema of its keys -- is
:mod:`astralight.launch.recipe` (schema: :mod:`astralight.launch.recipe_schema`). Before anything starts, the
launcher checks every component config and every local model and data path
(:mod:`astralight.launch.check`; alone: ``astralight run --check RECIPE``).

Start-up: each RaaS and trainer is prewarmed -- its process is started before the check and
only imports until the launcher hands it its command line (:mod:`astralight.prewarm`;
``ASTRALIGHT_PREWARM=0`` turns it off); a restart starts fresh.

Tokens: the components inherit the launcher's environment as it was when the launch began (what
the check's own imports add to ``os.environ`` does not reach them). With scoped tokens set
(``ASTRALIGHT_ROLLOUT_TOKEN``, ``ASTRALIGHT_TRAINER_TOKEN``, ``ASTRALIGHT_ADMIN_TOKEN``, or their
``_FILE`` forms) the dataflow gets them all, and every other component gets only the token of its
scope, as ``ASTRALIGHT_TOKEN``: each RaaS the rollout token, each trainer the trainer token bound
to its model_id, the autoscaler the admin token (plus the rollout token for the RaaS it starts);
the progress view reads the dataflow with the admin token (:mod:`astralight.dataflow.auth`).
Without scoped tokens ``ASTRALIGHT_TOKEN`` alone reaches every process (the single-token mode).

Every ``balance.every`` versions (default 10) the dataflow's balance report (trainer wait
fraction, produced / accepted / consumed, the pool decision) is appended to the run folder, a
readable line to ``balance.txt`` and the report to ``balance.jsonl``, in windows that neither skip
nor repeat a version, the last (partial) one at the end of the run; with a fixed pool the decision
is marked advice only (:mod:`astralight.launch.balance`). The last one is in the summary.

Stopping (:mod:`astralight.launch.stop`): at ``stop.versions`` (derived from the trainer's
``max_steps`` when not set; neither set with a time budget: a time-only run), ``stop.max_wall_s``,
``stop.target_accuracy``, ``stop.timeout_s`` or the first Ctrl-C / SIGTERM, every stop goes the
same way: trainers still running get SIGTERM (they save their last checkpoint and publish their
last version), the last version of each policy is evaluated whatever ``eval.every`` says, and the
summary is written with ``stop_reason``; a timeout then fails the run, and an interrupted run
prints its ``--resume`` command and exits 130. A second Ctrl-C stops every component at once.

Output: progress lines with a rate and an ETA (:mod:`astralight.launch.progress`), everything the
launcher prints also in ``RUN/launch.log`` (:mod:`astralight.launch.log`), the full record in
``RUN/summary.json`` and one short JSON line printed last (:mod:`astralight.launch.summary`).

Elastic pool: with ``autoscale: {min_instances, max_instances, initial, cooldown_s, every, ...}``
the launcher starts ``astralight autoscale`` (local processes, the recipe's ``raas[0]`` as every
instance's config, their logs and the decisions log ``autoscale.jsonl`` in the run folder)
instead of the fixed ``raas`` list; RaaS then come and go inside the autoscaler, and only the
autoscaler itself must stay alive. The summary gains ``pool`` (the autoscaler's decisions),
``rollout_capacity_seconds`` (sum over the dataflow's instance table of alive_s x
capacity_units) and ``trainer_seconds`` (the trainers' process lifetimes), in every run.

Backends (``--backend``): ``local`` runs every component as a process of this machine; ``ray``
runs the same commands as Ray actors on an existing Ray cluster (``recipe.ray``: its address, the
resources of each component kind, GPUs through a placement group; the ``ray`` extra), with the
same supervision, stop sequence, logs and summary (:mod:`astralight.launch.ray_launch`).

Supervision (``supervise: {max_restarts: 3, backoff_s: 2, backoff_factor: 2, max_backoff_s: 30}``,
on by default with these values; ``supervise: false`` turns it off): a component that exits
while the run goes on -- a trainer with a non-zero status, a service with any -- is restarted
after a growing backoff: the dataflow on its state folder (same port), a RaaS (or the
autoscaler) fresh, a trainer from its newest ``last*.ckpt`` (``--ckpt_path``; from scratch if
it has none yet). A trainer that exits 0 has finished. Each component may be restarted
``max_restarts`` times; its next crash fails the run. Restarts are logged, counted in the
summary (``restarts`` per component, ``restart_events`` with ``downtime_s`` and
``recovery_s``: exit seen -> progress again) and kept in ``launch_state.json``
(:mod:`astralight.supervise` holds the policy).

Run folder files for operators: ``pids.json`` (``{component: pid}`` of what runs now, rewritten
on every start, restart, exit and stop: what a fault injector kills), ``recipe.yaml`` (the
resolved recipe), ``launch_state.json``. ``astralight run --resume RUN_DIR`` continues an
interrupted run: it reads ``RUN_DIR/recipe.yaml`` (or the recipe given), refuses while
components listed in ``pids.json`` still run, reuses the prepared model, restarts the dataflow
on its state and the trainers from their last checkpoints, and runs to ``stop.versions``; its
summary is the whole run's (the dataflow's counters are durable; restarts and trainer time add
up over launches, ``resumes`` counts the resumptions, ``launches`` labels each launch). SIGTERM
stops the launcher like Ctrl-C (the normal stop), leaving the folder resumable. SIGKILL of the launcher (which no handler
sees) stops every component too, on Linux: each gets SIGTERM from the kernel (parent-death signal,
:mod:`astralight.proc`) and stops as on a polite stop, the folder left resumable.

The package: :mod:`~astralight.launch.components` (the processes, their configs and
``pids.json``), :mod:`~astralight.launch.monitor` (the dataflow reads, on
:class:`~astralight.dataflow.client.DataflowClient`), :mod:`~astralight.launch.state` (the run
folder's ``launch_state.json`` and checkpoints), :mod:`~astralight.launch.export`
(``--export-configs``) and :mod:`~astralight.launch.runner` (``run()``, step by step); this
module holds the command line (:func:`main`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from astralight.launch.components import (
    Component,
    _default_recipe,
    _free_port,
    autoscale_argv,
    build_components,
    component_configs,
    running_components,
    write_pids,
)
from astralight.launch.export import (
    EXPORT_PORT,
    export_configs,
    export_file_stems,
    export_values,
    prepared_vocab_size,
)
from astralight.launch.monitor import _per_version_counters
from astralight.launch.runner import prepare_initial_model, run
from astralight.launch.state import LAUNCH_STATE, checkpoint_dirs, last_checkpoint, write_atomic
from astralight.launch.recipe import RecipeError, load_recipe

__all__ = ["Component", "EXPORT_PORT", "LAUNCH_STATE", "RecipeError", "autoscale_argv",
           "build_components", "checkpoint_dirs", "component_configs", "export_configs",
           "export_file_stems", "export_values", "last_checkpoint", "main",
           "prepare_initial_model", "prepared_vocab_size", "run", "running_components",
           "write_atomic", "write_pids"]


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
