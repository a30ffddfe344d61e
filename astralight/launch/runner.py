"""``run()``: one launch of a recipe, in named steps -- read and check the recipe, open the run
folder, prepare the initial model, start the components, watch the run until a stop condition
and its stop sequence have run their course, summarize, stop the components in order.

:class:`Launch` holds what one launch knows (its recipe, run folder, components and supervisor);
the reads of the dataflow are :mod:`astralight.launch.monitor`, the run-folder state
:mod:`astralight.launch.state`.
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from astralight.launch.components import (
    Component,
    _default_recipe,
    _free_port,
    build_components,
    prewarm_components,
    running_components,
    write_pids,
)
from astralight.launch.monitor import (
    _balance_report,
    _eval_requester,
    _eval_table,
    _mark_recoveries,
    _per_version_counters,
    _wait_ready,
    read_stats,
)
from astralight.launch.state import (
    _load_launch_state,
    _save_launch_state,
    _trainer_resume_args,
    write_atomic,
)
from astralight.launch.log import current_launch_log, kept_in_launch_log
from astralight.launch.recipe import (
    RecipeError,
    autoscale_settings,
    load_recipe,
    substitute,
    supervise_settings_checked,
    use_pythonpath,
)
from astralight.launch.balance import AUTOSCALE, FIXED, BalanceLog
from astralight.launch.guard import GuardError, RunGuard, TrainCurves, guard_settings
from astralight.launch.log_watch import ErrorWatch, StaleWatch
from astralight.launch.progress import ProgressRate, progress_line
from astralight.launch.stop import (GUARD, INTERRUPTED, TIMEOUT, StopConditions, StopError,
                                 StopSequence, resolve_versions, stop_settings,
                                 trainer_max_time_s)
from astralight.launch.summary import (TIME_TO_ACCURACY, build_summary, final_eval, policy_stats,
                                    read_pool_history, short_line, trainer_wait_fraction,
                                    wall_s_to_accuracy, write_summary)
from astralight.launch.prewarm import PrewarmPool
from astralight.launch.supervise import GiveUp, RestartEvent, Supervisor


def _say(text: str) -> None:
    print(text, flush=True)


@kept_in_launch_log  # RUN/launch.log: this function's output, and its failure
def run(recipe_path: Path | None, run_dir: Path | None = None, quiet: bool = False,
        resume: bool = False, check: bool = True, backend: str = "local") -> dict:
    """Run a recipe to completion and return the full summary (``RUN/summary.json``; a short
    line of it is printed last).

    ``resume``: continue the run folder ``run_dir`` (the dataflow on its state folder, trainers
    from their last checkpoint, the prepared model reused) until ``stop.versions``; the recipe
    defaults to the one the first launch saved in ``run_dir/recipe.yaml``.

    Components are supervised (``recipe.supervise``, :mod:`astralight.launch.supervise`): a crashed one
    is restarted -- the dataflow on its state folder, a RaaS fresh, a trainer from its last
    checkpoint -- and the run fails only when one crashes more than ``max_restarts`` times.

    ``check``: before anything starts (no run folder, no prepare step), every component config
    and local path is checked as ``astralight run --check`` does (:mod:`astralight.launch.check`);
    without it only the recipe's own keys are. The recipe's ``pythonpath`` goes on this process's
    ``sys.path`` (for the prepare function) and on every component's ``PYTHONPATH``.

    ``backend``: ``local`` (processes of this machine) or ``ray`` (Ray actors on the cluster of
    ``recipe.ray.address``, :mod:`astralight.launch.ray_launch`); the rest of the launch is the same.
    """
    t_start = time.time()
    if backend == "ray":  # before anything is checked or built: is Ray installed at all
        from astralight.launch.ray_process import RayUnavailable, require_ray

        try:
            require_ray()
        except RayUnavailable as exc:
            raise RecipeError(str(exc)) from None
    if resume:
        recipe_path, run_dir = _resume_target(recipe_path, run_dir)
    recipe_path = Path(recipe_path) if recipe_path is not None else _default_recipe()
    # what the components inherit: this environment now, not what the check's and prepare's
    # imports add to it (torch and vLLM set variables of their own)
    base_env = _component_env()
    pool = PrewarmPool()  # RaaS and trainers import while the recipe is checked and prepared
    try:
        recipe, settings, stop, run_dir = _read_recipe(recipe_path, run_dir, check, pool,
                                                       base_env, prewarm=backend == "local")
        launch = Launch(recipe_path, recipe, stop, settings, run_dir, resume=resume, quiet=quiet,
                        t_start=t_start, pool=pool, base_env=base_env, backend=backend)
    except BaseException:
        pool.close()
        raise
    previous_term = _stop_on_sigterm()
    summary, hard_stop = None, False
    try:
        launch.start_components()
        launch.watch()
        summary = launch.summary()
    except KeyboardInterrupt:  # a second Ctrl-C, or one before every component was started
        hard_stop = True
        print("\n[launch] interrupted again: stopping every component now (no final checkpoint "
              "or evaluation)", flush=True)
        summary = launch.summary_if_possible(INTERRUPTED)
    except GiveUp as exc:
        raise RuntimeError(str(exc)) from None
    finally:
        pool.close()
        launch.stop_components()
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
        print("[launch] all components stopped", flush=True)
    # the full record in summary.json; on the terminal (and in launch.log) one short line, last
    if summary is not None:
        write_summary(launch.run_dir, summary)
    if summary is None or summary["stop_reason"] == INTERRUPTED:
        print(f"[launch] interrupted; resume with: astralight run --resume {launch.run_dir}",
              flush=True)
    if summary is not None:
        print(short_line(summary), flush=True)
    if hard_stop or summary["stop_reason"] == INTERRUPTED:
        raise KeyboardInterrupt  # exit 130: the run did not end as its recipe says
    launch.check_outcome(summary)
    return summary


def _resume_target(recipe_path: Path | None, run_dir: Path | None) -> tuple[Path, Path]:
    """The recipe and run folder of ``--resume``: the folder must exist, hold its recipe (unless
    one is given) and have none of its components still running."""
    if run_dir is None:
        raise RecipeError("--resume: name the run folder to resume")
    run_dir = Path(run_dir).resolve()
    if not run_dir.is_dir():
        raise RecipeError(f"--resume: {run_dir} is not a folder")
    if recipe_path is None:
        recipe_path = run_dir / "recipe.yaml"
        if not recipe_path.is_file():
            raise RecipeError(f"--resume: {recipe_path} is missing (a run folder written by "
                              "an older launcher); pass the recipe as well")
    alive = running_components(run_dir)
    if alive:
        raise RecipeError(f"--resume: components of {run_dir} are still running "
                          f"{alive}; stop them first (kill PID) so that two copies do not "
                          "share the state folder")
    return recipe_path, run_dir


def _component_env() -> dict[str, str]:
    """The environment every component inherits: the launcher's, with defaults for vLLM's CPU
    KV cache size and in-process engine core and no tokenizer thread pools."""
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TOKENIZERS_PARALLELISM": "false", **os.environ}


def _run_folder(recipe_path: Path, recipe: dict, run_dir: Path | None) -> Path:
    """The run folder: ``run_dir``, or ``runs/NAME-YYYYmmdd-HHMMSS`` (NAME: the recipe's
    ``name``, else its file name), absolute."""
    name = recipe.get("name", recipe_path.stem)
    return Path(run_dir or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def _read_recipe(recipe_path: Path, run_dir: Path | None, check: bool, pool: PrewarmPool,
                 base_env: dict, prewarm: bool = True) -> tuple[dict, dict, dict, Path]:
    """The recipe, its supervise settings, its stop settings and the run folder, checked before
    anything starts (the recipe's ``pythonpath`` goes on ``sys.path`` first, for the checks and
    prepare). The RaaS and trainers are prewarmed in ``pool`` before the check
    (:mod:`astralight.launch.prewarm`): they only import until they are started (not with ``prewarm``
    off: Ray-placed components start on other nodes)."""
    recipe = load_recipe(recipe_path)
    settings = supervise_settings_checked(recipe.get("supervise"))
    use_pythonpath(recipe)
    try:  # stop.versions and max_steps in step, stop's defaults; the guard's settings
        resolved = resolve_versions(recipe)
        stop = stop_settings(resolved["stop"], trainer_max_time_s(resolved))
        guard_settings(recipe.get("guard"))
    except (StopError, GuardError) as exc:
        raise RecipeError(str(exc)) from None
    folder = _run_folder(recipe_path, recipe, run_dir)
    if prewarm:
        prewarm_components(recipe, folder, pool, base_env)
    if check:
        from astralight.launch.check import check_recipe

        checked = check_recipe(recipe_path, recipe, run_dir)
        print(f"[launch] {checked.line()}", flush=True)
    return resolved, settings, stop, folder


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop_on_sigterm():
    """SIGTERM (a scheduler, `kill`) stops the run like Ctrl-C: components in order, the run
    folder left resumable, instead of the launcher dying and orphaning them. The previous
    handler (None off the main thread, where no handler can be set)."""
    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, _interrupt)
    return None


def prepare_initial_model(recipe: dict, run_dir: Path) -> str:
    """Run the recipe's ``prepare`` step (e.g. build the warm-started toy policy) once per run dir."""
    prep = recipe.get("prepare")
    if not prep:
        return ""
    target = prep.get("function")
    if not isinstance(target, str) or "." not in target:
        raise RecipeError("recipe.prepare.function: must be an import path like pkg.module.func")
    module_name, func_name = target.rsplit(".", 1)
    func = getattr(importlib.import_module(module_name), func_name)
    out = run_dir / "models" / "init"
    if (out / "config.json").exists():
        print(f"[launch] reusing prepared model {out}", flush=True)
        return str(out)
    t0 = time.time()
    print(f"[launch] preparing the initial policy with {target} ...", flush=True)
    func(out_dir=str(out), **(prep.get("kwargs") or {}))
    print(f"[launch] initial policy ready in {time.time() - t0:.0f}s: {out}", flush=True)
    return str(out)


class Launch:
    """One launch of a recipe: its run folder, prepared model, components and supervisor, and
    what the watch of the run has seen (stats, evaluations, the stop sequence)."""

    def __init__(self, recipe_path: Path, recipe: dict, stop: dict, settings: dict,
                 run_dir: Path | None, *, resume: bool, quiet: bool, t_start: float,
                 pool: PrewarmPool | None = None, base_env: dict | None = None,
                 backend: str = "local"):
        self.resume, self.quiet, self.t_start, self.stop = resume, quiet, t_start, stop
        self.pool = pool  # prewarmed processes the components' first starts become
        self.name = recipe.get("name", recipe_path.stem)
        self.run_dir = self._open_run_folder(recipe_path, recipe, run_dir)
        self.prior = _load_launch_state(self.run_dir)
        if resume:
            self.prior["resumes"] += 1
        port = int(recipe.get("port") or _free_port())
        base_env = base_env if base_env is not None else _component_env()
        self.ray_run = None  # backend ray: the cluster connection (astralight.launch.ray_launch)
        if backend == "ray":
            from astralight.launch.ray_launch import connect_run

            self.ray_run = connect_run(recipe, self.run_dir, base_env)
            print(f"[launch] backend ray: cluster {self.ray_run.gcs_address}, dataflow on this "
                  f"node ({self.ray_run.node_ip})", flush=True)
        self.url = f"http://{self.ray_run.node_ip if self.ray_run else '127.0.0.1'}:{port}"
        self.recipe = self._prepared(recipe)
        self.model_id, self.target = stop["model_id"], stop["versions"]  # None: time-only
        self.trainer_started: float | None = None  # its first start this launch (max_time)
        self.guard = RunGuard(guard_settings(recipe.get("guard")), TrainCurves(self.run_dir).read)
        self.comps = build_components(self.recipe, self.run_dir, self.url, port, base_env)
        if self.ray_run is not None:  # the same commands, placed by Ray
            from astralight.launch.ray_launch import ray_components

            self.comps = ray_components(self.comps, self.ray_run)
        # errors in the components' logs from now on, and a mostly stale rollout stream
        self.errors = ErrorWatch({c.name: c.log_path for c in self.comps})
        self.stale = StaleWatch()
        # where the run stood just after each crash, (version, rollouts) from the first stats
        # read after it: progress beyond that tells when the restarted component recovered
        self.marks: dict[int, tuple[int, int]] = {}
        self.progress = {"version": 0, "rollouts": 0, "stats_ok": False, "at": 0.0}
        self.sup = Supervisor(self.comps, settings, self.restart, log=_say,
                              on_event=self.on_event)
        # what the watch sees; the stop sequence starts once a stop condition is reached
        self.stats: dict = {}
        self.evals: dict = {}
        self.sequence: StopSequence | None = None
        self.stop_detail = ""
        self.this_launch: dict | None = None  # this launch's record, once its summary is made

    # ------------------------------------------------------------------ setting up

    def _open_run_folder(self, recipe_path: Path, recipe: dict, run_dir: Path | None) -> Path:
        """Create the run folder, open its ``launch.log`` and save the resolved recipe there
        (what ``--resume`` reads)."""
        run_dir = _run_folder(recipe_path, recipe, run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.launch_log = current_launch_log().open(run_dir / "launch.log")
        print(f"[launch] run folder: {run_dir}{' (resuming)' if self.resume else ''}", flush=True)
        if not self.resume and (run_dir / "dataflow" / "dataflow.db").exists():
            print(f"[launch] warning: {run_dir} already holds dataflow state, which the dataflow "
                  f"continues; trainers start from scratch (use --resume {run_dir} to resume them "
                  "from their checkpoints)", flush=True)
        saved = run_dir / "recipe.yaml"
        if recipe_path.resolve() != saved.resolve():
            write_atomic(saved, yaml.safe_dump({"name": self.name, **recipe}, sort_keys=False))
        return run_dir

    def _prepared(self, recipe: dict) -> dict:
        """The recipe with its placeholders filled, the initial model built by its prepare step
        (which may itself use the other placeholders, e.g. a cache under ``{run_dir}``)."""
        recipe = substitute(recipe, {"run_dir": self.run_dir, "seed": recipe.get("seed", 0),
                                     "dataflow_url": self.url})
        init_model = prepare_initial_model(recipe, self.run_dir)
        return substitute(recipe, {"init_model": init_model})

    # ------------------------------------------------------------------ processes

    def start(self, comp: Component) -> str:
        """Start (or restart) ``comp``; a trainer that resumes or restarts continues from its
        last checkpoint. A note on where it starts from (empty for a service)."""
        note = ""
        if comp.kind == "trainer" and (self.resume or comp.lifetimes):
            comp.extra_argv, note = _trainer_resume_args(comp, self.run_dir)
        comp.start(None if comp.lifetimes else self.pool)  # a restart starts fresh
        if comp.kind == "trainer" and self.trainer_started is None:
            self.trainer_started = time.time()
        write_pids(self.run_dir, self.comps)
        return note

    def restart(self, comp: Component) -> None:
        """The supervisor's restart: the dead process's log handle closed, started again, the
        note kept on its restart event."""
        comp.stop()
        note = self.start(comp)
        event = next((e for e in reversed(self.sup.events) if e.component == comp.name), None)
        if event is not None and note:
            event.detail = note

    def on_event(self, event: RestartEvent) -> None:
        """A crash seen or a restart done: ``pids.json`` and ``launch_state.json`` follow."""
        if event.restarted_at is None:  # a crash just seen
            write_pids(self.run_dir, self.comps)
        _save_launch_state(self.run_dir, self.prior, self.sup, self.comps, self.this_launch)

    def start_components(self) -> None:
        """The dataflow first, once it answers the others, in order."""
        self.start(self.comps[0])
        _wait_ready(self.url, self.comps[0], timeout_s=60)
        print(f"[launch] dataflow ready at {self.url}", flush=True)
        for comp in self.comps[1:]:
            note = self.start(comp)
            print(f"[launch] started {comp.name} ({'prewarmed; ' if comp.prewarmed else ''}"
                  f"log: {comp.log_path})"
                  f"{' ' + note if note and comp.kind == 'trainer' else ''}", flush=True)
        if self.pool is not None:
            self.pool.close()  # prewarmed processes no component became

    def stop_components(self) -> None:
        """Stop every component in reverse start order, each with its own signal (trainers
        SIGINT, Lightning's graceful stop; services SIGTERM), and record the final state."""
        for comp in reversed(self.comps):
            timeout_s = 30.0
            if comp.name == "autoscale":  # it drains its instances before it exits
                settings = autoscale_settings(self.recipe["autoscale"])
                timeout_s += settings["drain_timeout_s"] + settings["kill_after_s"]
            comp.stop(comp.stop_signal, timeout_s=timeout_s)
        if self.ray_run is not None:
            self.ray_run.close()  # the run's placement group removed; the cluster stays
        write_pids(self.run_dir, self.comps)
        _save_launch_state(self.run_dir, self.prior, self.sup, self.comps, self.this_launch)

    # ------------------------------------------------------------------ watching

    def watch(self) -> None:
        """:meth:`_watch`, where the first Ctrl-C (or SIGTERM) is the normal stop: the trainers
        finish their step, checkpoint and publish, the last version is evaluated, the summary
        says ``interrupted``. A second one (or one while another stop is under way, or before
        the dataflow answered) raises KeyboardInterrupt: every component is stopped at once."""
        self._init_watch()
        try:
            self._watch()
        except KeyboardInterrupt:
            if self.sequence is not None or not self.stats:
                raise
            self._begin_stop(INTERRUPTED, time.time(), "interrupted (Ctrl-C or SIGTERM): "
                             "stopping as at the end of a run; Ctrl-C again stops at once")
            self._watch()

    def _init_watch(self) -> None:
        """What the watch keeps, set once (a watch resumed after a Ctrl-C keeps it)."""
        recipe, stop = self.recipe, self.stop
        # the dataflow's balance report, in contiguous windows of `balance.every` versions
        pool_mode = AUTOSCALE if recipe.get("autoscale") is not None else FIXED
        self.balance = BalanceLog(
            self.run_dir, lambda n, last: _balance_report(self.url, self.model_id, n, last),
            int((recipe.get("balance") or {}).get("every", 10)), pool_mode)
        self.policies = list(recipe["dataflow"].get("model_ids", [self.model_id]))
        # every stop evaluates the last version of each policy (none without an eval source)
        self.eval_models = (self.policies if (recipe["dataflow"].get("eval") or {}).get("source")
                            else [])
        self.conditions, self.rate = StopConditions(stop, self.t_start), ProgressRate()

    def _watch(self) -> None:
        """Poll the run every second -- supervise, read the dataflow, print progress -- until a
        stop condition is reached and its stop sequence has finished."""
        last_print = 0.0
        while True:
            time.sleep(1.0)
            now = time.time()
            self.sup.poll(now)
            version = self._poll(now)
            if now - last_print >= float(self.stop["progress_every_s"]):
                self._look_for_collapse(now, version)
                self._print_progress(now, version)
                last_print = now
            if self.sequence is None:
                self._begin_stop_if_reached(now, version)
            if self.sequence is not None and self.stats and self._stop_step(now):
                return


    def _poll(self, now: float) -> int:
        """One read of the dataflow: stats (empty when it does not answer), recoveries, the
        evaluation table, balance windows and the rate. The policy's current version."""
        progress = self.progress
        try:
            self.stats = read_stats(self.url)
            progress["stats_ok"] = True
        except Exception:
            self.stats = {}
            progress["stats_ok"] = False
        pol = policy_stats(self.stats, self.model_id)
        progress["at"] = time.time()
        if self.stats:
            progress["version"] = int(pol.get("current_version") or 0)
            progress["rollouts"] = int(pol.get("rollouts_generated") or 0)
        _mark_recoveries(self.sup, self.comps, self.marks, progress)
        self.evals = _eval_table(self.url, self.model_id) if self.stats else self.evals
        version = int(pol.get("current_version") or 0)
        if self.stats:
            self.balance.poll(version)
            self.rate.update(now, version)
        return version

    def _look_for_collapse(self, now: float, version: int) -> None:
        """One look of the run guard (:mod:`astralight.launch.guard`) at every policy's
        evaluations and the trainers' curves; each new event is printed as a warning."""
        if self.sequence is not None or not self.stats:
            return
        tables = {m: self.evals if m == self.model_id else _eval_table(self.url, m)
                  for m in self.eval_models}
        for event in self.guard.look(round(now - self.t_start, 1), version, tables):
            print(f"[guard] WARNING {event.source}: {event.message}"
                  + (" -- stopping (guard.stop)" if self.guard.settings["stop"] else
                     " (guard.stop: true would stop the run here)"), flush=True)

    def _print_progress(self, now: float, version: int) -> None:
        """The progress line (kept in launch.log only when quiet)."""
        line = progress_line(now - self.t_start, self.target, self.stats, self.evals,
                             self.model_id, self.rate.text(now, version, self.target,
                                                           self._budgets()))
        line += self.guard.progress_text()
        pol = policy_stats(self.stats, self.model_id)
        if self.stats:
            self.stale.update(int(pol.get("rollouts_generated") or 0),
                              int(pol.get("stale_dropped") or 0))
        line += self.stale.text()
        self.errors.poll()
        line += self.errors.text()
        down = self.sup.down()
        line += f" | restarting {sorted(down)}" if down else ""
        sequence = self.sequence
        line += f" | stopping ({sequence.reason}): {sequence.phase}" if sequence else ""
        if self.quiet:
            self.launch_log.note(line)
        else:
            print(line, flush=True)
        warning = self.stale.warning(now) if self.sequence is None else None
        if warning:
            print(warning, flush=True)

    def _budgets(self) -> dict[str, float | None]:
        """When each time budget ends (absolute times): ``stop.max_wall_s`` from the launch's
        start, the trainer's ``max_time`` from its first start in this launch (a resumed fit
        also counts its earlier sessions' time, so its end may come sooner)."""
        stop, started = self.stop, self.trainer_started
        return {"max_wall_s": self.t_start + stop["max_wall_s"] if stop["max_wall_s"] else None,
                "max_time": (started + stop["trainer_max_time_s"]
                             if stop.get("trainer_max_time_s") and started else None)}

    def _begin_stop_if_reached(self, now: float, version: int) -> None:
        """Start the stop sequence once a stop condition is reached."""
        reason = self.conditions.reached(now, version, self.evals, self.sup.finished_trainers())
        if reason is None and self.guard.stop_requested:
            self._begin_stop(GUARD, now, f"guard.stop: {self.guard.events[0].message}")
        elif reason is not None:
            self._begin_stop(reason, now, self.conditions.describe(reason, version, self.evals))

    def _begin_stop(self, reason: str, now: float, detail: str) -> None:
        """Say why, and start the stop sequence (:class:`StopSequence`) for ``reason``."""
        self.stop_detail = detail
        print(f"{chr(10) if reason == INTERRUPTED else ''}[launch] stopping: {detail}", flush=True)
        self.sequence = StopSequence(
            reason, now, [c for c in self.comps if c.kind == "trainer"], self.eval_models,
            self.stop["final_eval_timeout_s"], request_eval=_eval_requester(self.url),
            retire=lambda c: self.sup.retire(c.name),
            force_stop=lambda c: c.stop(signal.SIGINT, timeout_s=30.0), log=_say)

    def _stop_step(self, now: float) -> bool:
        """One step of the stop sequence on this poll's versions and evaluations; True when it
        has finished."""
        versions_now = {m: int(policy_stats(self.stats, m).get("current_version") or 0)
                        for m in self.eval_models}
        tables = {m: self.evals if m == self.model_id else _eval_table(self.url, m)
                  for m in self.eval_models}
        return self.sequence.step(now, versions_now, tables)

    # ------------------------------------------------------------------ the outcome

    def summary(self) -> dict[str, Any]:
        """The run's summary, from the last word of the dataflow, read while every component
        still runs, and this launch's state added to the earlier launches'."""
        url, model_id, sequence = self.url, self.model_id, self.sequence
        try:
            self.stats = read_stats(url)
        except Exception:
            pass  # keep the last poll's stats
        evals = _eval_table(url, model_id) or self.evals
        final_version = int(policy_stats(self.stats, model_id).get("current_version") or 0)
        self.balance.finish(final_version)
        per_version = _per_version_counters(url, model_id)
        summary = build_summary(self.stats, evals, per_version, model_id, final_version)
        reason = sequence.reason if sequence is not None else INTERRUPTED
        summary["stop_reason"] = reason
        summary["stop"] = {"reason": reason, "detail": self.stop_detail or "interrupted",
                           "at_s": round((sequence.started_at if sequence else time.time())
                                         - self.t_start, 1),
                           "final_versions": sequence.final_versions if sequence else {},
                           "final_eval_complete": bool(sequence and sequence.eval_complete)}
        summary["balance"] = self.balance.last
        summary["guard_events"] = [event.as_dict() for event in self.guard.events]
        summary["warnings"] = [f"{event.kind} ({event.source})" for event in self.guard.events]
        summary["trainer_wait_fraction"] = trainer_wait_fraction(summary["counters"])
        summary["wall_s_to_085"] = wall_s_to_accuracy(
            Path(self.recipe["dataflow"].get("state_dir") or self.run_dir / "dataflow"), model_id,
            evals, TIME_TO_ACCURACY)
        wall_s = round(time.time() - self.t_start, 1)
        self.this_launch = {"launch": len(self.prior["launches"]) + 1, "resumed": self.resume,
                            "wall_s": wall_s, "stop_reason": reason,
                            "version_end": final_version}
        state = _save_launch_state(self.run_dir, self.prior, self.sup, self.comps,
                                   self.this_launch)
        summary["trainer_seconds"] = state["trainer_seconds"]
        summary.update(restarts=state["restarts"], restart_events=state["restart_events"],
                       resumes=state["resumes"], launches=state["launches"],
                       wall_s_total=round(sum(r["wall_s"] for r in state["launches"]), 1))
        if self.recipe.get("autoscale") is not None:
            summary["pool"] = read_pool_history(self.run_dir / "autoscale.jsonl")
        if len(self.policies) > 1:  # multi-policy: every policy's final evaluation, side by side
            summary["policies"] = {m: final_eval(_eval_table(url, m)) for m in
                                   [model_id] + [p for p in self.policies if p != model_id]}
        summary.update(recipe=self.name, wall_s=wall_s, run_dir=str(self.run_dir))
        return summary

    def summary_if_possible(self, reason: str) -> dict[str, Any] | None:
        """The summary of a run stopped at once (a second Ctrl-C), if the dataflow answered at
        least once: what it says now, ``stop_reason`` ``reason``, no final evaluation."""
        if not self.stats:
            return None
        if self.sequence is None:
            self.stop_detail = f"{reason}: stopped at once"
        try:
            if not hasattr(self, "balance"):
                self._init_watch()
            summary = self.summary()
        except Exception as exc:  # noqa: BLE001 - the stop goes on without one
            print(f"[launch] no summary: {type(exc).__name__}: {exc}", flush=True)
            return None
        if summary["stop_reason"] != reason:  # another stop was under way: this one ended it
            summary["stop"]["detail"] += f"; then {reason}: stopped at once"
            summary["stop_reason"] = summary["stop"]["reason"] = reason
            if self.this_launch is not None:  # (the same record summary["launches"] ends with)
                self.this_launch["stop_reason"] = reason
        return summary

    def check_outcome(self, summary: dict) -> None:
        """Fail a run that timed out, or whose final evaluation did not complete."""
        stop, run_dir = self.stop, self.run_dir
        if summary["stop_reason"] == TIMEOUT:
            of = f" of {self.target}" if self.target is not None else ""
            raise RuntimeError(f"the run reached stop.timeout_s={stop['timeout_s']:g} at version "
                               f"{summary['versions']}{of}; its summary is in "
                               f"{run_dir / 'summary.json'} (raise stop.timeout_s, or set "
                               "stop.max_wall_s for a time budget that ends the run successfully)")
        if ((self.recipe["dataflow"].get("eval") or {}).get("source")
                and summary.get("eval_accuracy_end") is None):
            final_version = summary["stop"]["final_versions"].get(self.model_id,
                                                                  summary["versions"])
            raise RuntimeError(f"the final evaluation of version {final_version} did not "
                               "complete within "
                               f"stop.final_eval_timeout_s={stop['final_eval_timeout_s']:g}; "
                               f"see {run_dir / 'logs'}")
