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
only imports until the launcher hands it its command line (:mod:`astralight.launch.prewarm`;
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
(:mod:`astralight.launch.supervise` holds the policy).

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
:mod:`astralight.launch.proc`) and stops as on a polite stop, the folder left resumable.

The package: :mod:`~astralight.launch.components` (the processes, their configs and
``pids.json``), :mod:`~astralight.launch.monitor` (the dataflow reads, on
:class:`~astralight.dataflow.client.DataflowClient`), :mod:`~astralight.launch.state` (the run
folder's ``launch_state.json`` and checkpoints), :mod:`~astralight.launch.export`
(``--export-configs``) and :mod:`~astralight.launch.runner` (``run()``, step by step);
:mod:`~astralight.launch.cli` holds the command line (:func:`main`). The launcher's process
helpers live here too: :mod:`~astralight.launch.proc` (spawning with a parent-death signal),
:mod:`~astralight.launch.supervise` (restarts), :mod:`~astralight.launch.prewarm` and
:mod:`~astralight.launch.ray_process` (``--backend ray``).

This package imports nothing until a name is asked for (:func:`__getattr__`): the RaaS, the
dataflow and Ray's workers import :mod:`~astralight.launch.supervise` or
:mod:`~astralight.launch.proc` alone, without the launcher's other modules.
"""

from __future__ import annotations

import importlib

#: the names this package re-exports, and the module each lives in
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["Component", "_default_recipe", "_free_port", "autoscale_argv",
                     "build_components", "component_configs", "running_components",
                     "write_pids"], "components"),
    **dict.fromkeys(["EXPORT_PORT", "export_configs", "export_file_stems", "export_values",
                     "prepared_vocab_size"], "export"),
    "_per_version_counters": "monitor",
    **dict.fromkeys(["prepare_initial_model", "run"], "runner"),
    **dict.fromkeys(["LAUNCH_STATE", "checkpoint_dirs", "last_checkpoint", "write_atomic"],
                    "state"),
    **dict.fromkeys(["RecipeError", "load_recipe"], "recipe"),
    **dict.fromkeys(["main", "merged_recipe"], "cli"),
}

__all__ = sorted(n for n in _EXPORTS if not n.startswith("_"))


def __getattr__(name: str):
    """Import a re-exported name's module on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'astralight.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"astralight.launch.{module}"), name)
    globals()[name] = value
    return value
