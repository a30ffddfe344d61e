"""``astralight run``: start a whole run on this machine, watch it, stop it cleanly.

The launcher owns nothing a component does. It reads a recipe (one YAML holding the dataflow,
RaaS and trainer configs), writes each component's config into the run folder, starts each
component as its own process with the same command a cluster would use, shows one progress
line, and on completion (or Ctrl-C, or a component failing) stops them in order: trainers,
rollout services, dataflow. The run folder keeps configs, logs, TensorBoard events,
checkpoints and the dataflow's SQLite state.

Recipe placeholders, substituted in every string value: ``{run_dir}``, ``{dataflow_url}``,
``{init_model}`` (what the ``prepare`` step built), ``{seed}``.

Recipe inheritance: ``extends: PATH`` (relative to the recipe's own folder) names a parent recipe;
the child is deep-merged onto it (mappings merge key by key, anything else, lists included,
replaces), so a variant states only what it changes (``configs/toy/algorithms/*.yaml``).

Tokens: the components inherit the launcher's environment. With scoped tokens set
(``ASTRALIGHT_ROLLOUT_TOKEN``, ``ASTRALIGHT_TRAINER_TOKEN``, ``ASTRALIGHT_ADMIN_TOKEN``, or their
``_FILE`` forms) the dataflow gets them all, and every other component gets only the token of its
scope, as ``ASTRALIGHT_TOKEN``: each RaaS the rollout token, each trainer the trainer token bound
to its model_id, the autoscaler the admin token (plus the rollout token for the RaaS it starts);
the progress view reads the dataflow with the admin token (:mod:`astralight.dataflow.auth`).
Without scoped tokens ``ASTRALIGHT_TOKEN`` reaches every process as before.

Every ``balance.every`` versions (default 10) the dataflow's balance report (trainer wait
fraction, produced / accepted / consumed, the pool decision) is appended to ``balance.txt`` in the
run folder; the last one is in the summary.

Elastic pool: with ``autoscale: {min_instances, max_instances, initial, cooldown_s, every, ...}``
the launcher starts ``astralight autoscale`` (local processes, the recipe's ``raas[0]`` as every
instance's config, their logs and the decisions log ``autoscale.jsonl`` in the run folder)
instead of the fixed ``raas`` list; RaaS then come and go inside the autoscaler, and only the
autoscaler itself must stay alive. The summary gains ``pool`` (the autoscaler's decisions),
``rollout_capacity_seconds`` (sum over the dataflow's instance table of alive_s x
capacity_units) and ``trainer_seconds`` (the trainers' process lifetimes), in every run.

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
up over launches, ``resumes`` counts the resumptions). SIGTERM stops the launcher like Ctrl-C
(components in order), leaving the folder resumable. SIGKILL of the launcher (which no handler
sees) stops every component too, on Linux: each gets SIGTERM from the kernel (parent-death signal,
:mod:`astralight.proc`) and stops as on a polite stop, the folder left resumable.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from astralight.proc import spawn
from astralight.supervise import (
    GiveUp,
    RestartEvent,
    SuperviseError,
    Supervisor,
    supervise_settings,
)

def _default_recipe() -> Path:
    """The embedded toy recipe (examples/toy/recipe.yaml, installed as package astralight.toy)."""
    import astralight.toy

    return Path(astralight.toy.__file__).resolve().parent / "recipe.yaml"


class RecipeError(ValueError):
    """The recipe is not usable; the message names the key and the fix."""


@dataclass
class Component:
    """One child process of the run and where its output goes.

    ``extra_argv`` is appended at each start (a trainer's ``--ckpt_path`` when it resumes);
    ``config`` is the component's own config (the launcher reads a trainer's checkpoint folder
    from it). Each (re)start appends to the same log, and its start/end times to ``lifetimes``.
    """

    name: str
    argv: list[str]
    log_path: Path
    env: dict = field(default_factory=dict)
    cpus: list[int] | None = None
    config: dict | None = None
    extra_argv: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    log_file: Any = None
    lifetimes: list[list[float | None]] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """``dataflow``, ``raas``, ``trainer`` or ``autoscale``."""
        return self.name.split("-")[0]

    @property
    def stop_signal(self) -> int:
        """How it is stopped politely: SIGINT for a trainer (Lightning's graceful stop), SIGTERM
        for a service (they drain or commit on it)."""
        return signal.SIGINT if self.kind == "trainer" else signal.SIGTERM

    def start(self) -> None:
        if self.log_file is not None:  # a restart: the previous process's log handle
            self.log_file.close()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.log_path, "ab", buffering=0)
        # A session of its own: a terminal's Ctrl-C reaches the launcher only, which then stops
        # the components in order instead of all at once. The child gets SIGTERM if the launcher
        # dies, even by SIGKILL (astralight.proc): a killed launcher leaves no stray component.
        # Components are started and restarted on the thread that runs the launcher's loop,
        # which outlives them (the parent-death signal follows the forking thread). The signal is
        # the one the launcher's own stop sends: SIGINT for a trainer (Lightning's graceful stop,
        # which also breaks out of a wait on a dataflow that died too), SIGTERM for a service.
        self.proc = spawn(self.argv + list(self.extra_argv), cpus=self.cpus, stdout=self.log_file,
                          stderr=subprocess.STDOUT, env=self.child_env(),
                          death_signal=self.stop_signal)
        self.lifetimes.append([time.time(), None])

    def child_env(self) -> dict:
        """The environment it starts with: the launcher's, its own ``env``, and -- when scoped
        tokens are set -- the token of its scope as ``ASTRALIGHT_TOKEN`` (a trainer's bound to
        its model_id), the other scopes' tokens removed
        (:func:`astralight.dataflow.auth.handoff_env`)."""
        from astralight.dataflow.auth import KIND_SCOPES, handoff_env

        env = {**os.environ, **{k: str(v) for k, v in self.env.items()}}
        trainer = self.kind == "trainer" and "-" in self.name
        model_id = self.name.split("-", 1)[1] if trainer else None
        return handoff_env(env, KIND_SCOPES.get(self.kind), model_id)

    def alive(self) -> bool:
        alive = self.proc is not None and self.proc.poll() is None
        if not alive and self.lifetimes and self.lifetimes[-1][1] is None:
            self.lifetimes[-1][1] = time.time()  # first seen gone
        return alive

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def seconds_alive(self, now: float | None = None) -> float:
        """Summed lifetime of every process this component ran."""
        now = time.time() if now is None else now
        return sum((end if end is not None else now) - start for start, end in self.lifetimes)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.alive():
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.alive()  # records the end of its lifetime
        if self.log_file:
            self.log_file.close()
            self.log_file = None
        return self.proc.returncode

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _substitute(obj: Any, values: dict[str, str]) -> Any:
    if isinstance(obj, str):
        for key, value in values.items():
            obj = obj.replace("{" + key + "}", str(value))
        return obj
    if isinstance(obj, dict):
        return {k: _substitute(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_substitute(v, values) for v in obj]
    return obj


def deep_merge(parent: Any, child: Any) -> Any:
    """``child`` laid over ``parent``: mappings merge key by key, anything else replaces.

    Lists replace rather than concatenate, so a variant can shorten a list as well as extend it.
    Neither input is modified.
    """
    if isinstance(parent, dict) and isinstance(child, dict):
        out = copy.deepcopy(parent)
        for key, value in child.items():
            out[key] = deep_merge(parent[key], value) if key in parent else copy.deepcopy(value)
        return out
    return copy.deepcopy(child)


def _read_recipe_file(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise RecipeError(f"recipe: cannot read {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe: {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: {path} must hold a mapping")
    return data


def resolve_recipe(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """Read a recipe and the chain of recipes it ``extends``, merged, without ``extends``.

    ``extends`` is relative to the folder of the file that says it. A missing parent or a cycle
    raises RecipeError naming ``recipe.extends`` and the file.
    """
    path = Path(path)
    resolved = path.resolve()
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, resolved))
        raise RecipeError(f"recipe.extends: cycle of recipes {cycle}; remove one of the extends")
    recipe = _read_recipe_file(path)
    parent_ref = recipe.pop("extends", None)
    if parent_ref is None:
        return recipe
    if not isinstance(parent_ref, str) or not parent_ref:
        raise RecipeError(f"recipe.extends: in {path} must be a path (relative to {path.parent}), "
                          f"got {parent_ref!r}")
    parent_path = Path(parent_ref)
    if not parent_path.is_absolute():
        parent_path = resolved.parent / parent_path
    if not parent_path.is_file():
        raise RecipeError(f"recipe.extends: {parent_ref!r} in {path} names {parent_path}, "
                          f"which does not exist (the path is relative to the recipe's folder)")
    return deep_merge(resolve_recipe(parent_path, (*_chain, resolved)), recipe)


def load_recipe(path: Path) -> dict:
    """Read and check a recipe (its ``extends`` chain merged); every problem names its key."""
    recipe = resolve_recipe(Path(path))
    for key in ("dataflow", "raas", "trainers", "stop"):
        if key not in recipe:
            raise RecipeError(f"recipe.{key}: missing in {path}")
    if not isinstance(recipe["raas"], list) or not recipe["raas"]:
        raise RecipeError("recipe.raas: must be a non-empty list of RaaS configs")
    if not isinstance(recipe["trainers"], list) or not recipe["trainers"]:
        raise RecipeError("recipe.trainers: must be a non-empty list of trainer configs")
    stop = recipe["stop"]
    if not isinstance(stop, dict):
        raise RecipeError("recipe.stop: must be a mapping with at least `versions`")
    if not isinstance(recipe["dataflow"], dict):
        raise RecipeError("recipe.dataflow: must be a mapping (the dataflow service's config)")
    if not isinstance(stop.get("versions"), int) or stop["versions"] < 1:
        raise RecipeError("recipe.stop.versions: must be a positive int (trainer versions to run)")
    if recipe.get("autoscale") is not None:
        autoscale_settings(recipe["autoscale"])
    every = (recipe["dataflow"].get("eval") or {}).get("every")
    if every and stop["versions"] % every:
        raise RecipeError(
            f"recipe.stop.versions: {stop['versions']} is not a multiple of dataflow.eval.every "
            f"({every}), so the final version would never be evaluated; make it one"
        )
    return recipe


#: recipe.autoscale keys and their defaults (the autoscaler's flags, see astralight.autoscale)
AUTOSCALE_DEFAULTS = {"min_instances": 1, "max_instances": 4, "initial": None, "cooldown_s": 120.0,
                      "every": 10, "poll_s": 2.0, "drain_timeout_s": 60.0, "kill_after_s": 30.0,
                      "replace_backoff_s": 10.0}


def autoscale_settings(spec: Any) -> dict:
    """``recipe.autoscale`` with defaults filled in, checked; problems name the key."""
    if not isinstance(spec, dict):
        raise RecipeError("recipe.autoscale: must be a mapping, e.g. {min_instances: 1, "
                          "max_instances: 3, every: 5}")
    unknown = sorted(set(spec) - set(AUTOSCALE_DEFAULTS))
    if unknown:
        raise RecipeError(f"recipe.autoscale.{unknown[0]}: unknown key; known: "
                          f"{', '.join(AUTOSCALE_DEFAULTS)}")
    out = {**AUTOSCALE_DEFAULTS, **spec}
    for key in ("min_instances", "max_instances", "every"):
        if isinstance(out[key], bool) or not isinstance(out[key], int):
            raise RecipeError(f"recipe.autoscale.{key}: must be an int, got {out[key]!r}")
    for key in ("cooldown_s", "poll_s", "drain_timeout_s", "kill_after_s", "replace_backoff_s"):
        if isinstance(out[key], bool) or not isinstance(out[key], (int, float)) or out[key] < 0:
            raise RecipeError(f"recipe.autoscale.{key}: must be a number of seconds >= 0, "
                              f"got {out[key]!r}")
    if out["poll_s"] == 0:
        raise RecipeError("recipe.autoscale.poll_s: must be > 0 seconds")
    if out["every"] < 1:
        raise RecipeError(f"recipe.autoscale.every: must be >= 1 versions, got {out['every']}")
    if out["min_instances"] < 0:
        raise RecipeError(f"recipe.autoscale.min_instances: must be >= 0, got {out['min_instances']}")
    if out["max_instances"] < max(out["min_instances"], 1):
        raise RecipeError(f"recipe.autoscale.max_instances: must be >= min_instances "
                          f"({out['min_instances']}) and >= 1, got {out['max_instances']}")
    initial = out["initial"]
    if initial is not None and (isinstance(initial, bool) or not isinstance(initial, int)
                                or not out["min_instances"] <= initial <= out["max_instances"]):
        raise RecipeError(f"recipe.autoscale.initial: must be an int within min_instances.."
                          f"max_instances ({out['min_instances']}..{out['max_instances']}), "
                          f"got {initial!r}")
    return out


def autoscale_argv(settings: dict, url: str, raas_config: str, model_id: str,
                   run_dir: Path) -> list[str]:
    """``astralight autoscale`` arguments for a recipe's (checked) autoscale settings."""
    argv = ["autoscale", "--dataflow", url, "--raas-config", raas_config, "--model-id", model_id,
            "--min", str(settings["min_instances"]), "--max", str(settings["max_instances"]),
            "--every", str(settings["every"]), "--cooldown-s", str(settings["cooldown_s"]),
            "--poll-s", str(settings["poll_s"]), "--drain-timeout-s", str(settings["drain_timeout_s"]),
            "--kill-after-s", str(settings["kill_after_s"]),
            "--replace-backoff-s", str(settings["replace_backoff_s"]),
            "--log-dir", str(run_dir / "logs"), "--decisions-log", str(run_dir / "autoscale.jsonl")]
    if settings["initial"] is not None:
        argv += ["--initial", str(settings["initial"])]
    return argv


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


def _write_yaml(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _get_json(url: str, timeout: float = 5.0) -> Any:
    import httpx

    from astralight.dataflow.auth import admin_token

    token = admin_token()  # the progress view reads stats: the admin scope when tokens are scoped
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(url, timeout=timeout, headers=headers)
    response.raise_for_status()
    return response.json()


def _wait_ready(url: str, component: Component, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not component.alive():
            raise RuntimeError(f"{component.name} exited during start-up:\n{component.tail()}")
        try:
            _get_json(f"{url}/v1/info", timeout=2.0)
            return
        except Exception:
            time.sleep(0.3)
    raise RuntimeError(f"{component.name} not ready after {timeout_s:.0f}s:\n{component.tail()}")


def _eval_table(url: str, model_id: str) -> dict[int, dict]:
    try:
        table = _get_json(f"{url}/v1/eval/{model_id}")
    except Exception:
        return {}
    return {int(k): v for k, v in table.items()}


def _per_version_counters(url: str, model_id: str) -> dict | None:
    """The dataflow's counters per version of ``model_id`` (``{"<v>": {name: int}}``), or None.

    None when the route is missing or fails: the summary says "not known" rather than failing a
    run that has otherwise finished.
    """
    try:
        table = _get_json(f"{url}/v1/counters/{model_id}")
    except Exception as exc:
        print(f"[launch] per-version counters not available ({exc})", flush=True)
        return None
    versions = table.get("versions") if isinstance(table, dict) else None
    return versions if isinstance(versions, dict) else None


def _balance_report(url: str, model_id: str, window: int, path: Path) -> dict | None:
    """Fetch the dataflow's balance report and append it to ``path`` (one readable line and the
    JSON); None when the route is unavailable (the run goes on)."""
    try:
        report = _get_json(f"{url}/v1/balance/{model_id}?window={window}")
    except Exception as exc:
        print(f"[launch] balance report not available ({exc})", flush=True)
        return None
    d = report.get("decision") or {}
    line = (f"versions {report['versions'][0]}..{report['versions'][1]}: wait fraction "
            f"{report['wait_fraction']:.1%}, produced {report['produced']}, accepted "
            f"{report['accepted']}, consumed {report['consumed']}, stale {report['stale']}, "
            f"weight pause {report.get('weight_pause_s', 0):.2f}s (RaaS total), "
            f"pool {d.get('pool')} -> {d.get('action')} {d.get('target')} ({d.get('reason')})")
    with open(path, "a") as f:
        f.write(line + "\n" + json.dumps(report) + "\n")
    return report


def _policy_stats(stats: dict, model_id: str) -> dict:
    return (stats.get("models") or {}).get(model_id, {})


def _progress_line(elapsed: float, target: int, stats: dict, evals: dict[int, dict],
                   model_id: str) -> str:
    pol = _policy_stats(stats, model_id)
    version = pol.get("current_version", 0)
    done = [v for v, r in sorted(evals.items()) if r.get("complete")]
    eval_text = ""
    if done:
        first, last = evals[done[0]], evals[done[-1]]
        eval_text = (f" | eval v{done[0]} {100 * first['avg_at_k']:.1f}%"
                     f" -> v{done[-1]} {100 * last['avg_at_k']:.1f}%")
    trained = pol.get("samples_trained", pol.get("samples_acked", 0))
    rollouts = pol.get("rollouts_generated")
    rollout_text = f" | rollouts {rollouts}" if rollouts is not None else ""
    instances = stats.get("instances") or []
    if instances and all("live" in r for r in instances):  # the pool size, as it changes
        rollout_text += f" | raas {sum(1 for r in instances if r['live'])}"
    return (f"[{elapsed:6.0f}s] version {version}/{target}"
            f" | trained {trained}{rollout_text}"
            f" | accepted {pol.get('samples_accepted', 0)}"
            f" | queued {pol.get('queue_depth', 0)}"
            f" | stale {pol.get('stale_dropped', 0)}{eval_text}")


def _final_eval(evals: dict[int, dict]) -> dict:
    """A policy's first and last complete evaluation (accuracy, and team accuracy if any)."""
    complete = sorted(v for v, r in evals.items() if r.get("complete"))
    if not complete:
        return {"eval_versions": []}
    first, last = evals[complete[0]], evals[complete[-1]]
    out = {"eval_versions": complete, "eval_accuracy_start": first["avg_at_k"],
           "eval_accuracy_end": last["avg_at_k"], "version_end": complete[-1]}
    if "team_accuracy" in last:
        out.update(team_accuracy_start=first.get("team_accuracy"),
                   team_accuracy_end=last["team_accuracy"])
    if "tool_call_rate" in last:
        out.update(tool_call_rate_start=first.get("tool_call_rate"),
                   tool_call_rate_end=last["tool_call_rate"])
    return out


def rollout_capacity_seconds(instances: list[dict] | None) -> float | None:
    """Sum over the dataflow's instance table of ``alive_s x capacity_units``: what the rollout
    pool cost, in capacity-unit seconds (None when the table does not say how long each lived)."""
    if not instances:
        return None
    total = 0.0
    for row in instances:
        if row.get("alive_s") is None:
            return None
        total += float(row["alive_s"]) * float(row.get("capacity_units") or 1.0)
    return round(total, 1)


def read_pool_history(path: Path) -> list[dict] | None:
    """The autoscaler's decisions (its JSON-lines log), None when there is none."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        out.append({k: entry.get(k) for k in ("time", "version", "action", "pool", "target",
                                              "launched", "retire", "reason", "errors")})
    return out


def build_summary(stats: dict, evals: dict[int, dict], per_version: dict | None, model_id: str,
                  target: int) -> dict:
    """The run's summary (without ``wall_s`` / ``run_dir``) from the dataflow's last word.

    ``samples_trained`` counts fresh and replayed samples in acknowledged batches (what the
    trainer stepped on); ``rollouts_generated`` counts train samples the rollout services
    produced, before any filter (the rollout cost); ``counters`` is the policy's whole stats entry;
    ``per_version`` its counters per version (``{"<v>": {name: int}}``, None when unknown).
    """
    complete = sorted(v for v, r in evals.items() if r.get("complete"))
    pol = _policy_stats(stats, model_id)
    final = evals[target] if target in complete else None
    start = evals[complete[0]] if complete else None
    tools = {}
    if start is not None and "tool_call_rate" in start:  # a tool-calling workflow
        tools = {"tool_call_rate_start": start["tool_call_rate"],
                 "tool_call_rate_end": final.get("tool_call_rate") if final else None}
    return {
        "eval_accuracy_start": start["avg_at_k"] if start else None,
        "eval_accuracy_end": final["avg_at_k"] if final else None,
        "eval_pass_at_k_end": final.get("pass_at_k") if final else None,
        **tools,
        "eval_versions": complete,
        "eval": {v: {key: evals[v][key] for key in
                     ("avg_at_k", "pass_at_k", "team_accuracy", "tool_call_rate", "k", "n",
                      "pass_at",
                      "n_prompts", "min_version", "max_version", "benchmark_average",
                      "benchmark_average_pass_at_k", "benchmark_average_pass_at", "benchmarks")
                     if key in evals[v]}
                 for v in complete},
        "versions": pol.get("current_version"),
        "samples_trained": pol.get("samples_trained"),
        "rollouts_generated": pol.get("rollouts_generated"),
        "counters": pol,
        "plugins": stats.get("plugins"),
        "per_version": per_version,
        "rollout_capacity_seconds": rollout_capacity_seconds(stats.get("instances")),
    }


TIME_TO_ACCURACY = 0.85
"""The accuracy ``wall_s_to_085`` in the summary is measured to."""


def trainer_wait_fraction(counters: dict) -> float | None:
    """The share of the trainer's step time it spent waiting for a batch, over the whole run
    (the dataflow's ``trainer_wait_ms`` / ``trainer_step_ms``; None before any timed step)."""
    step = float(counters.get("trainer_step_ms") or 0)
    return round(float(counters.get("trainer_wait_ms") or 0) / step, 4) if step > 0 else None


def wall_s_to_accuracy(state_dir: Path, model_id: str, evals: dict, threshold: float) -> float | None:
    """Seconds from the dataflow's start to the publication of the first version whose complete
    evaluation reached ``threshold`` (avg@k); None when none did or the state does not say.

    Publication time, not the eval's end: it measures how fast training got there, not how long
    the asynchronous evaluation took to report. Read from the dataflow's SQLite state (read only).
    """
    import sqlite3

    from astralight.report.rundata import ReadOnlyStore

    reached = sorted(int(v) for v, r in evals.items()
                     if r.get("complete") and float(r.get("avg_at_k") or 0) >= threshold)
    db = Path(state_dir) / "dataflow.db"
    if not reached or not db.exists():
        return None
    if reached[0] == 0:
        return 0.0
    try:
        store = ReadOnlyStore(db)
        try:
            start = store.get_meta("started_at")
            published = store.version_times(model_id).get(reached[0])
        finally:
            store.close()
    except sqlite3.Error:
        return None
    if start is None or published is None:
        return None
    return round(float(published) - float(start), 1)


def _affinity(spec: dict) -> dict[str, list[int]]:
    """CPU pinning per component kind, kept only where this machine has those CPUs.

    On a small CPU machine vLLM's OpenMP threads spin on every core they are bound to, and a
    trainer on the same cores slows both many times over; giving each its own cores avoids that.
    """
    available = os.sched_getaffinity(0)
    out = {}
    for kind, cpus in spec.items():
        if kind not in ("dataflow", "raas", "trainer"):
            raise RecipeError(f"recipe.cpu_affinity.{kind}: must be dataflow, raas or trainer")
        wanted = set(int(c) for c in cpus)
        if wanted and wanted <= available and len(available) > 1:
            out[kind] = sorted(wanted)
    return out


def component_configs(recipe: dict, run_dir: Path, port: int) -> dict[str, dict]:
    """Each component's own config (``dataflow``, ``raas-I``, ``trainer-MODEL_ID``), in start order.

    The dataflow's ``vocab_sizes`` and ``temperatures`` are filled from each trainer's model
    (``model_path/config.json`` and ``model.init_args.temperature``) unless the recipe sets them.

    These are the files a component is started with, on this machine or any other; the toy
    recipe's are committed under ``configs/toy/`` (a test keeps them in step with the recipe).
    """
    dataflow_cfg = copy.deepcopy(recipe["dataflow"])
    dataflow_cfg.update({"host": "127.0.0.1", "port": port})
    dataflow_cfg.setdefault("state_dir", str(run_dir / "dataflow"))
    configs = {"dataflow": dataflow_cfg}
    for i, raas_cfg in enumerate(recipe["raas"]):
        configs[f"raas-{i}"] = copy.deepcopy(raas_cfg)
    for i, trainer_cfg in enumerate(recipe["trainers"]):
        init_args = (trainer_cfg.get("model") or {}).get("init_args") or {}
        model_id = init_args.get("model_id", str(i))
        configs[f"trainer-{model_id}"] = copy.deepcopy(trainer_cfg)
        if model_id not in dataflow_cfg.get("model_ids", ["policy"]):
            continue
        vocab = _vocab_size(init_args.get("model_path"))
        if vocab is not None:
            dataflow_cfg.setdefault("vocab_sizes", {}).setdefault(model_id, vocab)
        temperature = init_args.get("temperature")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
            # the trainer refuses samples of another temperature; the dataflow refuses them on
            # ingest instead, so one bad sample cannot stop the trainer (``temperatures``)
            dataflow_cfg.setdefault("temperatures", {}).setdefault(model_id, float(temperature))
    return configs


def _vocab_size(model_path: Any) -> int | None:
    """The vocabulary size in ``model_path/config.json`` (None if there is no such file yet):
    the dataflow refuses pushed token ids outside it (``vocab_sizes``)."""
    try:
        cfg = json.loads((Path(str(model_path)) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) and size > 0 else None


def build_components(recipe: dict, run_dir: Path, url: str, port: int) -> list[Component]:
    """The run's processes, in start order: dataflow, rollout services (or the autoscaler),
    trainers."""
    py = [sys.executable, "-m", "astralight.cli"]
    env, cpus = recipe.get("env") or {}, _affinity(recipe.get("cpu_affinity") or {})
    raas_env = dict(env.get("raas", {}))
    if "raas" in cpus:  # vLLM binds its OpenMP threads itself; tell it which cores are its own
        raas_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus["raas"])))
    comps = []
    configs = component_configs(recipe, run_dir, port)
    autoscale = recipe.get("autoscale")
    if autoscale is not None:  # RaaS come from the autoscaler: raas[0] is every instance's config
        template = _write_yaml(run_dir / "configs" / "raas-template.yaml", configs["raas-0"])
        configs = {k: v for k, v in configs.items() if not k.startswith("raas-")}
    for name, cfg in configs.items():
        path = str(_write_yaml(run_dir / "configs" / f"{name}.yaml", cfg))
        kind = name.split("-")[0]
        if kind == "dataflow":
            argv, kind_env = ["dataflow", "serve", "--config", path], env.get("dataflow", {})
        elif kind == "raas":
            argv, kind_env = ["raas", "serve", "--dataflow", url, "--config", path], raas_env
        else:
            argv, kind_env = ["fit", "--config", path], env.get("trainer", {})
        comps.append(Component(name, py + argv, run_dir / "logs" / f"{name}.log", env=kind_env,
                               cpus=cpus.get(kind), config=cfg))
    if autoscale is not None:
        # started right after the dataflow; pinned to the RaaS cores, which its children (the
        # instances) inherit, with the RaaS environment
        argv = autoscale_argv(autoscale_settings(autoscale), url, str(template),
                              recipe["stop"].get("model_id", "policy"), run_dir)
        comps.insert(1, Component("autoscale", py + argv, run_dir / "logs" / "autoscale.log",
                                  env=raas_env, cpus=cpus.get("raas")))
    for comp in comps:  # each one's token hand-off, checked before anything starts
        try:
            comp.child_env()
        except ValueError as exc:
            raise RecipeError(f"tokens for {comp.name}: {exc}") from None
    return comps


def write_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` so that a reader (or a crash) sees the old file or the new one,
    never half of one: a temp file in the same folder, fsynced, renamed over, the folder fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def write_pids(run_dir: Path, comps: list[Component]) -> Path:
    """``RUN_DIR/pids.json``: ``{component: pid}`` of every component running now (rewritten on
    each start, restart, exit and stop), so a fault injector or an operator finds what to kill.
    Components of the autoscaler's pool are its children and are not listed."""
    pids = {c.name: c.pid for c in comps if c.proc is not None and c.proc.poll() is None}
    return write_atomic(run_dir / "pids.json", json.dumps(pids, indent=2) + "\n")


def checkpoint_dirs(trainer_cfg: dict, run_dir: Path) -> list[Path]:
    """Where a trainer config's ``ModelCheckpoint`` callbacks write (their ``dirpath``); without
    one, the Lightning default under ``trainer.default_root_dir`` (searched recursively)."""
    trainer = (trainer_cfg or {}).get("trainer") or {}
    dirs = []
    for cb in trainer.get("callbacks") or []:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("ModelCheckpoint"):
            dirpath = (cb.get("init_args") or {}).get("dirpath")
            if dirpath:
                dirs.append(Path(dirpath))
    if not dirs:
        dirs.append(Path(trainer.get("default_root_dir") or run_dir))
    return dirs


def last_checkpoint(trainer_cfg: dict, run_dir: Path) -> Path | None:
    """The newest ``last*.ckpt`` a trainer config's checkpoint callbacks wrote, or None."""
    found: list[Path] = []
    for d in checkpoint_dirs(trainer_cfg, run_dir):
        if not d.is_dir():
            continue
        explicit = any(str(cb.get("class_path", "")).endswith("ModelCheckpoint")
                       for cb in ((trainer_cfg or {}).get("trainer") or {}).get("callbacks") or []
                       if isinstance(cb, dict))
        found += list(d.glob("last*.ckpt") if explicit else d.rglob("last*.ckpt"))
    found = [p for p in found if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def running_components(run_dir: Path) -> dict[str, int]:
    """Components listed in ``RUN_DIR/pids.json`` still alive and still this run's (their command
    line names the run folder): an interrupted launcher (kill -9) leaves them running."""
    try:
        pids = json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for name, pid in (pids.items() if isinstance(pids, dict) else []):
        try:
            cmdline = Path(f"/proc/{int(pid)}/cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError, TypeError):
            continue
        if str(run_dir).encode() in cmdline:
            out[name] = int(pid)
    return out


#: the launcher's own state in the run folder, kept across --resume
LAUNCH_STATE = "launch_state.json"


def _load_launch_state(run_dir: Path) -> dict:
    try:
        state = json.loads((run_dir / LAUNCH_STATE).read_text())
    except (OSError, ValueError):
        state = {}
    state.setdefault("restarts", {})
    state.setdefault("restart_events", [])
    state.setdefault("trainer_seconds", 0.0)
    state.setdefault("resumes", 0)
    return state


def _save_launch_state(run_dir: Path, prior: dict, sup: Supervisor, comps: list[Component]) -> dict:
    """The run's restarts and trainer time so far, this launch's added to the earlier ones'."""
    restarts = dict(prior["restarts"])
    for name, n in sup.restarts.items():
        restarts[name] = restarts.get(name, 0) + n
    state = {"restarts": restarts,
             "restart_events": prior["restart_events"] + [e.as_dict() for e in sup.events],
             "trainer_seconds": round(prior["trainer_seconds"] + sum(
                 c.seconds_alive() for c in comps if c.kind == "trainer"), 1),
             "resumes": prior["resumes"]}
    write_atomic(run_dir / LAUNCH_STATE, json.dumps(state, indent=2))
    return state


def _trainer_resume_args(comp: Component, run_dir: Path) -> tuple[list[str], str]:
    """``--ckpt_path PATH`` of the trainer's newest last checkpoint (or nothing), and a note."""
    ckpt = last_checkpoint(comp.config or {}, run_dir)
    if ckpt is None:
        return [], "from scratch (no last checkpoint yet)"
    return ["--ckpt_path", str(ckpt)], f"from {ckpt}"


def run(recipe_path: Path | None, run_dir: Path | None = None, quiet: bool = False,
        resume: bool = False) -> dict:
    """Run a recipe to completion and return the final summary (also printed as JSON).

    ``resume``: continue the run folder ``run_dir`` (the dataflow on its state folder, trainers
    from their last checkpoint, the prepared model reused) until ``stop.versions``; the recipe
    defaults to the one the first launch saved in ``run_dir/recipe.yaml``.

    Components are supervised (``recipe.supervise``, :mod:`astralight.supervise`): a crashed one
    is restarted -- the dataflow on its state folder, a RaaS fresh, a trainer from its last
    checkpoint -- and the run fails only when one crashes more than ``max_restarts`` times.
    """
    t_start = time.time()
    if resume:
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
    recipe_path = Path(recipe_path) if recipe_path is not None else _default_recipe()
    recipe = load_recipe(recipe_path)
    settings = supervise_settings_checked(recipe.get("supervise"))
    name = recipe.get("name", recipe_path.stem)
    run_dir = Path(run_dir or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[launch] run folder: {run_dir}{' (resuming)' if resume else ''}", flush=True)
    if not resume and (run_dir / "dataflow" / "dataflow.db").exists():
        print(f"[launch] warning: {run_dir} already holds dataflow state, which the dataflow "
              f"continues; trainers start from scratch (use --resume {run_dir} to resume them "
              "from their checkpoints)", flush=True)
    saved = run_dir / "recipe.yaml"
    if recipe_path.resolve() != saved.resolve():  # the resolved recipe, for --resume
        write_atomic(saved, yaml.safe_dump({"name": name, **recipe}, sort_keys=False))
    prior = _load_launch_state(run_dir)
    if resume:
        prior["resumes"] += 1
    seed = recipe.get("seed", 0)
    port = int(recipe.get("port") or _free_port())
    url = f"http://127.0.0.1:{port}"

    # The recipe's prepare step may itself use the placeholders (e.g. a cache under run_dir).
    recipe = _substitute(recipe, {"run_dir": run_dir, "seed": seed, "dataflow_url": url})
    init_model = prepare_initial_model(recipe, run_dir)
    recipe = _substitute(recipe, {"init_model": init_model})
    stop = recipe["stop"]
    model_id = stop.get("model_id", "policy")
    target = int(stop["versions"])

    comps = build_components(recipe, run_dir, url, port)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    deadline = t_start + float(stop.get("timeout_s", 3600))
    summary: dict[str, Any] = {}
    interrupted = False
    # where the run stood just after each crash, (version, rollouts) from the first stats read
    # after it: progress beyond that tells when the restarted component recovered
    marks: dict[int, tuple[int, int]] = {}
    last_progress = {"version": 0, "rollouts": 0, "stats_ok": False, "at": 0.0}

    def start(comp: Component) -> str:
        note = ""
        if comp.kind == "trainer" and (resume or comp.lifetimes):
            comp.extra_argv, note = _trainer_resume_args(comp, run_dir)
        comp.start()
        write_pids(run_dir, comps)
        return note

    def restart(comp: Component) -> None:
        comp.stop()  # closes the dead process's log handle
        note = start(comp)
        event = next((e for e in reversed(sup.events) if e.component == comp.name), None)
        if event is not None and note:
            event.detail = note

    def on_event(event: RestartEvent) -> None:
        if event.restarted_at is None:  # a crash just seen
            write_pids(run_dir, comps)
        _save_launch_state(run_dir, prior, sup, comps)

    sup = Supervisor(comps, settings, restart, log=lambda line: print(line, flush=True),
                     on_event=on_event)
    # SIGTERM (a scheduler, `kill`) stops the run like Ctrl-C: components in order, the run
    # folder left resumable, instead of the launcher dying and orphaning them
    previous_term = None
    if threading.current_thread() is threading.main_thread():
        previous_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        start(comps[0])
        _wait_ready(url, comps[0], timeout_s=60)
        print(f"[launch] dataflow ready at {url}", flush=True)
        for comp in comps[1:]:
            note = start(comp)
            print(f"[launch] started {comp.name} (log: {comp.log_path})"
                  f"{' ' + note if note and comp.kind == 'trainer' else ''}", flush=True)
        last_print = 0.0
        # the dataflow's balance report every `balance.every` versions, into balance.txt
        balance_every = int((recipe.get("balance") or {}).get("every", 10))
        balance_at, last_balance = 0, None
        final_eval_deadline = None
        stats: dict = {}
        evals: dict = {}
        while True:
            time.sleep(1.0)
            now = time.time()
            if now > deadline:
                raise RuntimeError(f"run exceeded stop.timeout_s={stop.get('timeout_s')}")
            sup.poll(now)
            try:
                stats = _get_json(f"{url}/v1/stats")
                last_progress["stats_ok"] = True
            except Exception:
                stats = {}
                last_progress["stats_ok"] = False
            pol = _policy_stats(stats, model_id)
            last_progress["at"] = time.time()
            if stats:
                last_progress["version"] = int(pol.get("current_version") or 0)
                last_progress["rollouts"] = int(pol.get("rollouts_generated") or 0)
            _mark_recoveries(sup, comps, marks, last_progress)
            evals = _eval_table(url, model_id) if stats else evals
            version = int(pol.get("current_version") or 0)
            if balance_every and version - balance_at >= balance_every:
                balance_at = version
                report = _balance_report(url, model_id, balance_every, run_dir / "balance.txt")
                last_balance = report or last_balance
            if not quiet and now - last_print >= float(stop.get("progress_every_s", 5)):
                line = _progress_line(now - t_start, target, stats, evals, model_id)
                down = sup.down()
                print(line + (f" | restarting {sorted(down)}" if down else ""), flush=True)
                last_print = now
            if sup.finished_trainers():
                if final_eval_deadline is None:
                    print("[launch] trainers finished; waiting for the final evaluation", flush=True)
                    final_eval_deadline = now + float(stop.get("final_eval_timeout_s", 300))
                if evals.get(target, {}).get("complete") or now > final_eval_deadline:
                    break
        # The last word of the dataflow, read while every component still runs.
        try:
            stats = _get_json(f"{url}/v1/stats")
        except Exception:
            pass  # keep the last poll's stats
        per_version = _per_version_counters(url, model_id)
        summary = build_summary(stats, evals, per_version, model_id, target)
        summary["balance"] = last_balance
        summary["trainer_wait_fraction"] = trainer_wait_fraction(summary["counters"])
        summary["wall_s_to_085"] = wall_s_to_accuracy(
            Path(recipe["dataflow"].get("state_dir") or run_dir / "dataflow"), model_id, evals,
            TIME_TO_ACCURACY)
        state = _save_launch_state(run_dir, prior, sup, comps)
        summary["trainer_seconds"] = state["trainer_seconds"]
        summary.update(restarts=state["restarts"], restart_events=state["restart_events"],
                       resumes=state["resumes"])
        if recipe.get("autoscale") is not None:
            summary["pool"] = read_pool_history(run_dir / "autoscale.jsonl")
        others = [m for m in recipe["dataflow"].get("model_ids", [model_id]) if m != model_id]
        if others:  # multi-policy: every policy's final evaluation, side by side
            summary["policies"] = {m: _final_eval(_eval_table(url, m)) for m in [model_id] + others}
        summary.update(recipe=name, wall_s=round(time.time() - t_start, 1), run_dir=str(run_dir))
    except KeyboardInterrupt:
        interrupted = True
        print("\n[launch] interrupted: stopping components", flush=True)
    except GiveUp as exc:
        raise RuntimeError(str(exc)) from None
    finally:
        for comp in reversed(comps):
            # trainers get SIGINT (Lightning's graceful stop), services SIGTERM
            sig = comp.stop_signal
            timeout_s = 30.0
            if comp.name == "autoscale":  # it drains its instances before it exits
                settings_a = autoscale_settings(recipe["autoscale"])
                timeout_s += settings_a["drain_timeout_s"] + settings_a["kill_after_s"]
            comp.stop(sig, timeout_s=timeout_s)
        write_pids(run_dir, comps)
        _save_launch_state(run_dir, prior, sup, comps)
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
        print("[launch] all components stopped", flush=True)
    if interrupted:
        raise KeyboardInterrupt
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)
    if (recipe["dataflow"].get("eval") or {}).get("source") and summary.get("eval_accuracy_end") is None:
        raise RuntimeError(f"the final evaluation of version {target} did not complete within "
                           f"stop.final_eval_timeout_s={stop.get('final_eval_timeout_s', 300)}; "
                           f"see {run_dir / 'logs'}")
    return summary


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def supervise_settings_checked(spec: Any) -> dict | None:
    """:func:`astralight.supervise.supervise_settings`, its errors as :class:`RecipeError`."""
    try:
        return supervise_settings(spec)
    except SuperviseError as exc:
        raise RecipeError(str(exc)) from None


def _mark_recoveries(sup: Supervisor, comps: list[Component], marks: dict,
                     progress: dict) -> None:
    """Stamp ``recovered_at`` on restarted components that made progress again, judged on a
    stats read (``progress``) taken after their restart: the dataflow answers; a trainer's policy
    has a newer version, a RaaS (or the autoscaler's pool) more rollouts than at the first stats
    read after the crash (``marks``, filled here)."""
    by_name = {c.name: c for c in comps}
    at = progress["at"]
    for event in sup.events:
        if event.recovered_at is not None:
            continue
        if id(event) not in marks and progress["stats_ok"]:
            marks[id(event)] = (progress["version"], progress["rollouts"])
        if event.restarted_at is None or at <= event.restarted_at or not progress["stats_ok"]:
            continue
        kind = by_name[event.component].kind
        version, rollouts = marks.get(id(event), (progress["version"], progress["rollouts"]))
        if (kind == "dataflow"
                or kind == "trainer" and progress["version"] > version
                or kind in ("raas", "autoscale") and progress["rollouts"] > rollouts):
            event.recovered_at = at
            print(f"[launch] {event.component} recovered {event.recovery_s:.1f}s after its exit",
                  flush=True)


def export_configs(recipe_path: Path, out_dir: Path, port: int = 8400,
                   run_dir: str = "runs/toy", init_model: str = "models/toy-init") -> list[Path]:
    """Write each component's config of a recipe to ``out_dir``, for starting components by hand.

    Placeholders become fixed values: the dataflow at ``127.0.0.1:port``, the run folder
    ``run_dir`` and the initial model ``init_model`` (build it with ``astralight prepare-toy``).
    """
    recipe = load_recipe(recipe_path)
    values = {"run_dir": run_dir, "init_model": init_model, "seed": recipe.get("seed", 0),
              "dataflow_url": f"http://127.0.0.1:{port}"}
    recipe = _substitute(recipe, values)
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = component_configs(recipe, Path(run_dir), port)
    return [_write_yaml(out_dir / f"{file_stem}.yaml", configs[name])
            for name, file_stem in export_file_stems(list(configs)).items()]


def export_file_stems(names: list[str]) -> dict[str, str]:
    """The file name (without ``.yaml``) each component's config is exported under: its kind
    (``dataflow``, ``raas``, ``trainer``) when it is the only one of its kind, else its whole
    name (``trainer-solver``, ``trainer-verifier``, ``raas-0``, ``raas-1``), so no two
    components of a recipe share a file."""
    kinds = [name.split("-")[0] for name in names]
    return {name: kind if kinds.count(kind) == 1 else name for name, kind in zip(names, kinds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="astralight run", description=__doc__.split("\n")[0])
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
                             "several) and exit, to start the components by hand")
    args = parser.parse_args(argv)
    try:
        if args.export_configs:
            recipe_path = Path(args.recipe) if args.recipe else _default_recipe()
            for path in export_configs(recipe_path, Path(args.export_configs)):
                print(path)
            return 0
        if args.resume:
            if args.run_dir and Path(args.run_dir).resolve() != Path(args.resume).resolve():
                raise RecipeError("--run-dir: with --resume the run folder is RUN_DIR; "
                                  "give one of them")
            run(Path(args.recipe) if args.recipe else None, Path(args.resume),
                quiet=args.quiet, resume=True)
        else:
            run(Path(args.recipe) if args.recipe else _default_recipe(),
                Path(args.run_dir) if args.run_dir else None, quiet=args.quiet)
    except RecipeError as exc:
        print(f"astralight run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        print(f"astralight run: failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
