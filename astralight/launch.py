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
:mod:`astralight.recipe` (schema: :mod:`astralight.recipe_schema`). Before anything starts, the
launcher checks every component config and every local model and data path
(:mod:`astralight.check`; alone: ``astralight run --check RECIPE``).

Tokens: the components inherit the launcher's environment. With scoped tokens set
(``ASTRALIGHT_ROLLOUT_TOKEN``, ``ASTRALIGHT_TRAINER_TOKEN``, ``ASTRALIGHT_ADMIN_TOKEN``, or their
``_FILE`` forms) the dataflow gets them all, and every other component gets only the token of its
scope, as ``ASTRALIGHT_TOKEN``: each RaaS the rollout token, each trainer the trainer token bound
to its model_id, the autoscaler the admin token (plus the rollout token for the RaaS it starts);
the progress view reads the dataflow with the admin token (:mod:`astralight.dataflow.auth`).
Without scoped tokens ``ASTRALIGHT_TOKEN`` reaches every process as before.

Every ``balance.every`` versions (default 10) the dataflow's balance report (trainer wait
fraction, produced / accepted / consumed, the pool decision) is appended to the run folder, a
readable line to ``balance.txt`` and the report to ``balance.jsonl``, in windows that neither skip
nor repeat a version, the last (partial) one at the end of the run; with a fixed pool the decision
is marked advice only (:mod:`astralight.run_balance`). The last one is in the summary.

Stopping (:mod:`astralight.run_stop`): at ``stop.versions`` (derived from the trainer's
``max_steps`` when not set), ``stop.max_wall_s``, ``stop.target_accuracy`` or ``stop.timeout_s``,
every stop goes the same way: trainers still running get SIGTERM (they save their last checkpoint
and publish their last version), the last version of each policy is evaluated whatever
``eval.every`` says, and the summary is written with ``stop_reason``; a timeout then fails the run.

Output: progress lines with a rate and an ETA (:mod:`astralight.run_progress`), everything the
launcher prints also in ``RUN/launch.log`` (:mod:`astralight.launch_log`), the full record in
``RUN/summary.json`` and one short JSON line printed last (:mod:`astralight.run_summary`).

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

from astralight.launch_log import current_launch_log, kept_in_launch_log
from astralight.proc import spawn
from astralight.recipe import (
    RecipeError,
    autoscale_settings,
    load_recipe,
    substitute,
    supervise_settings_checked,
    use_pythonpath,
    with_pythonpath,
)
from astralight.run_balance import AUTOSCALE, FIXED, BalanceLog
from astralight.run_progress import ProgressRate, progress_line
from astralight.run_stop import (TIMEOUT, StopConditions, StopError, StopSequence,
                                 resolve_versions, stop_settings)
from astralight.run_summary import (TIME_TO_ACCURACY, build_summary, final_eval, policy_stats,
                                    read_pool_history, short_line, trainer_wait_fraction,
                                    wall_s_to_accuracy, write_summary)
from astralight.supervise import GiveUp, RestartEvent, Supervisor

def _default_recipe() -> Path:
    """The embedded toy recipe (examples/toy/recipe.yaml, installed as package astralight.toy)."""
    import astralight.toy

    return Path(astralight.toy.__file__).resolve().parent / "recipe.yaml"


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

    def send(self, sig: int) -> None:
        """Send ``sig`` to the running process and return at once (nothing when it is gone):
        the stop sequence's polite SIGTERM to a trainer, which then finishes on its own."""
        if self.alive():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

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


def _balance_report(url: str, model_id: str, window: int, last: int) -> dict | None:
    """The dataflow's balance report over the ``window`` versions up to ``last``
    (:class:`astralight.run_balance.BalanceLog` writes it); None when the route is unavailable
    (the run goes on)."""
    try:
        return _get_json(f"{url}/v1/balance/{model_id}?window={int(window)}&last={int(last)}")
    except Exception as exc:
        print(f"[launch] balance report not available ({exc})", flush=True)
        return None


def _eval_requester(url: str):
    """``request(model_id, version) -> bool``: ask the dataflow to evaluate that version now
    (``POST /v1/eval``, whatever ``eval.every`` says); True once accepted. A refusal is printed
    once per version (the stop sequence asks again at its next step)."""
    from astralight.dataflow.auth import admin_token
    from astralight.dataflow.client import DataflowClient

    told: set[tuple[str, int]] = set()

    def request(model_id: str, version: int) -> bool:
        try:
            with DataflowClient(url, token=admin_token(), retry_s=2.0, timeout=10.0) as client:
                client.request_eval(model_id, version)
            return True
        except Exception as exc:
            if (model_id, version) not in told:
                told.add((model_id, version))
                print(f"[launch] evaluation of {model_id} v{version} not scheduled yet ({exc})",
                      flush=True)
            return False

    return request


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
        comps.append(Component(name, py + argv, run_dir / "logs" / f"{name}.log",
                               env=with_pythonpath(recipe, kind_env), cpus=cpus.get(kind),
                               config=cfg))
    if autoscale is not None:
        # started right after the dataflow; pinned to the RaaS cores, which its children (the
        # instances) inherit, with the RaaS environment
        argv = autoscale_argv(autoscale_settings(autoscale), url, str(template),
                              recipe["stop"].get("model_id", "policy"), run_dir)
        comps.insert(1, Component("autoscale", py + argv, run_dir / "logs" / "autoscale.log",
                                  env=with_pythonpath(recipe, raas_env), cpus=cpus.get("raas")))
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


@kept_in_launch_log  # RUN/launch.log: this function's output, and its failure
def run(recipe_path: Path | None, run_dir: Path | None = None, quiet: bool = False,
        resume: bool = False, check: bool = True) -> dict:
    """Run a recipe to completion and return the full summary (``RUN/summary.json``; a short
    line of it is printed last).

    ``resume``: continue the run folder ``run_dir`` (the dataflow on its state folder, trainers
    from their last checkpoint, the prepared model reused) until ``stop.versions``; the recipe
    defaults to the one the first launch saved in ``run_dir/recipe.yaml``.

    Components are supervised (``recipe.supervise``, :mod:`astralight.supervise`): a crashed one
    is restarted -- the dataflow on its state folder, a RaaS fresh, a trainer from its last
    checkpoint -- and the run fails only when one crashes more than ``max_restarts`` times.

    ``check``: before anything starts (no run folder, no prepare step), every component config
    and local path is checked as ``astralight run --check`` does (:mod:`astralight.check`);
    without it only the recipe's own keys are. The recipe's ``pythonpath`` goes on this process's
    ``sys.path`` (for the prepare function) and on every component's ``PYTHONPATH``.
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
    use_pythonpath(recipe)
    if check:
        from astralight.check import check_recipe

        checked = check_recipe(recipe_path, recipe, run_dir)
        print(f"[launch] {checked.line()}", flush=True)
    try:  # before anything starts: stop.versions and max_steps in step, stop's defaults
        recipe = resolve_versions(recipe)
        stop = stop_settings(recipe["stop"])
    except StopError as exc:
        raise RecipeError(str(exc)) from None
    name = recipe.get("name", recipe_path.stem)
    run_dir = Path(run_dir or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    launch_log = current_launch_log().open(run_dir / "launch.log")
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
    recipe = substitute(recipe, {"run_dir": run_dir, "seed": seed, "dataflow_url": url})
    init_model = prepare_initial_model(recipe, run_dir)
    recipe = substitute(recipe, {"init_model": init_model})
    model_id = stop["model_id"]
    target = int(stop["versions"])

    comps = build_components(recipe, run_dir, url, port)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
        # the dataflow's balance report, in contiguous windows of `balance.every` versions
        pool_mode = AUTOSCALE if recipe.get("autoscale") is not None else FIXED
        balance_every = int((recipe.get("balance") or {}).get("every", 10))
        balance = BalanceLog(run_dir, lambda n, last: _balance_report(url, model_id, n, last),
                             balance_every, pool_mode)
        policies = list(recipe["dataflow"].get("model_ids", [model_id]))
        # every stop evaluates the last version of each policy (none without an eval source)
        eval_models = policies if (recipe["dataflow"].get("eval") or {}).get("source") else []
        conditions, rate = StopConditions(stop, t_start), ProgressRate()
        budget_end = t_start + stop["max_wall_s"] if stop["max_wall_s"] else None
        sequence: StopSequence | None = None
        stop_detail = ""
        stats: dict = {}
        evals: dict = {}
        while True:
            time.sleep(1.0)
            now = time.time()
            sup.poll(now)
            try:
                stats = _get_json(f"{url}/v1/stats")
                last_progress["stats_ok"] = True
            except Exception:
                stats = {}
                last_progress["stats_ok"] = False
            pol = policy_stats(stats, model_id)
            last_progress["at"] = time.time()
            if stats:
                last_progress["version"] = int(pol.get("current_version") or 0)
                last_progress["rollouts"] = int(pol.get("rollouts_generated") or 0)
            _mark_recoveries(sup, comps, marks, last_progress)
            evals = _eval_table(url, model_id) if stats else evals
            version = int(pol.get("current_version") or 0)
            if stats:
                balance.poll(version)
                rate.update(now, version)
            if now - last_print >= float(stop["progress_every_s"]):
                line = progress_line(now - t_start, target, stats, evals, model_id,
                                     rate.text(now, version, target, budget_end))
                down = sup.down()
                line += f" | restarting {sorted(down)}" if down else ""
                line += f" | stopping ({sequence.reason}): {sequence.phase}" if sequence else ""
                if quiet:
                    launch_log.note(line)  # kept in launch.log, not printed
                else:
                    print(line, flush=True)
                last_print = now
            if sequence is None:
                reason = conditions.reached(now, version, evals, sup.finished_trainers())
                if reason is not None:
                    stop_detail = conditions.describe(reason, version, evals)
                    print(f"[launch] stopping: {stop_detail}", flush=True)
                    sequence = StopSequence(
                        reason, now, [c for c in comps if c.kind == "trainer"], eval_models,
                        stop["final_eval_timeout_s"], request_eval=_eval_requester(url),
                        retire=lambda c: sup.retire(c.name),
                        force_stop=lambda c: c.stop(signal.SIGINT, timeout_s=30.0),
                        log=lambda text: print(text, flush=True))
            if sequence is not None and stats:
                versions_now = {m: int(policy_stats(stats, m).get("current_version") or 0)
                                for m in eval_models}
                tables = {m: evals if m == model_id else _eval_table(url, m) for m in eval_models}
                if sequence.step(now, versions_now, tables):
                    break
        # The last word of the dataflow, read while every component still runs.
        try:
            stats = _get_json(f"{url}/v1/stats")
        except Exception:
            pass  # keep the last poll's stats
        evals = _eval_table(url, model_id) or evals
        final_version = int(policy_stats(stats, model_id).get("current_version") or 0)
        balance.finish(final_version)
        per_version = _per_version_counters(url, model_id)
        summary = build_summary(stats, evals, per_version, model_id, final_version)
        summary["stop_reason"] = sequence.reason
        summary["stop"] = {"reason": sequence.reason, "detail": stop_detail,
                           "at_s": round(sequence.started_at - t_start, 1),
                           "final_versions": sequence.final_versions,
                           "final_eval_complete": sequence.eval_complete}
        summary["balance"] = balance.last
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
        if len(policies) > 1:  # multi-policy: every policy's final evaluation, side by side
            summary["policies"] = {m: final_eval(_eval_table(url, m))
                                   for m in [model_id] + [p for p in policies if p != model_id]}
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
    # the full record in summary.json; on the terminal (and in launch.log) one short line, last
    write_summary(run_dir, summary)
    print(short_line(summary), flush=True)
    if summary["stop_reason"] == TIMEOUT:
        raise RuntimeError(f"the run reached stop.timeout_s={stop['timeout_s']:g} at version "
                           f"{summary['versions']} of {target}; its summary is in "
                           f"{run_dir / 'summary.json'} (raise stop.timeout_s, or set "
                           "stop.max_wall_s for a time budget that ends the run successfully)")
    if (recipe["dataflow"].get("eval") or {}).get("source") and summary.get("eval_accuracy_end") is None:
        final_version = summary["stop"]["final_versions"].get(model_id, summary["versions"])
        raise RuntimeError(f"the final evaluation of version {final_version} did not complete "
                           f"within stop.final_eval_timeout_s={stop['final_eval_timeout_s']:g}; "
                           f"see {run_dir / 'logs'}")
    return summary


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


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


#: the dataflow's port in exported configs when the recipe sets none (a run picks a free one;
#: components started by hand need a fixed one)
EXPORT_PORT = 8400


def export_values(recipe: dict, recipe_path: Path, port: int | None = None,
                  run_dir: str | None = None, init_model: str | None = None) -> dict:
    """The placeholder values of an export, each the recipe's own unless given: the dataflow's
    ``port`` (the recipe's ``port``, else :data:`EXPORT_PORT`), ``run_dir`` (``runs/NAME``, NAME
    the recipe's ``name``), ``init_model`` (where the launcher's prepare step builds it,
    ``RUN_DIR/models/init``; empty without a prepare step), ``seed``, ``dataflow_url``."""
    port = int(port if port is not None else recipe.get("port") or EXPORT_PORT)
    run_dir = str(run_dir if run_dir is not None
                  else Path("runs") / str(recipe.get("name") or Path(recipe_path).stem))
    if init_model is None:
        init_model = str(Path(run_dir) / "models" / "init") if recipe.get("prepare") else ""
    return {"run_dir": run_dir, "init_model": str(init_model), "seed": recipe.get("seed", 0),
            "dataflow_url": f"http://127.0.0.1:{port}", "port": port}


def prepared_vocab_size(recipe: dict) -> int | None:
    """The vocabulary size of the model(s) the recipe's ``prepare`` step builds, before it is
    built: the prepare function's ``vocab_size`` attribute, called with the step's ``kwargs``
    (the shipped builders have one; see :mod:`astralight.tasks.warmstart`). None when the
    function has none or it cannot tell."""
    prep = recipe.get("prepare") or {}
    target = prep.get("function")
    if not isinstance(target, str) or "." not in target:
        return None
    module_name, func_name = target.rsplit(".", 1)
    try:
        hook = getattr(getattr(importlib.import_module(module_name), func_name), "vocab_size", None)
        size = hook(**(prep.get("kwargs") or {})) if callable(hook) else None
    except Exception:  # an export goes on without it (the dataflow then checks no token ids)
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def export_configs(recipe_path: Path, out_dir: Path, port: int | None = None,
                   run_dir: str | None = None, init_model: str | None = None) -> list[Path]:
    """Write each component's config of a recipe to ``out_dir``, for starting components by hand.

    Placeholders become the recipe's values (:func:`export_values`; ``port``, ``run_dir`` and
    ``init_model`` override them). The dataflow's ``vocab_sizes`` come from each trainer's model
    folder, or -- for a model the recipe's prepare step has not built yet -- from the prepare
    function (:func:`prepared_vocab_size`), so the exported dataflow refuses out-of-range token
    ids as the launcher's would.
    """
    recipe = load_recipe(recipe_path)
    values = export_values(recipe, recipe_path, port, run_dir, init_model)
    port = values.pop("port")
    recipe = substitute(recipe, values)
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = component_configs(recipe, Path(values["run_dir"]), port)
    dataflow_cfg = configs["dataflow"]
    init = values["init_model"]
    for name, cfg in configs.items():
        init_args = (((cfg.get("model") or {}).get("init_args") or {})
                     if name.startswith("trainer-") else {})
        model_id, model_path = init_args.get("model_id"), str(init_args.get("model_path") or "")
        if (model_id is None or model_id in (dataflow_cfg.get("vocab_sizes") or {})
                or model_id not in dataflow_cfg.get("model_ids", ["policy"])
                or not init or not (model_path == init or model_path.startswith(init + "/"))):
            continue
        size = prepared_vocab_size(recipe)
        if size is not None:
            dataflow_cfg.setdefault("vocab_sizes", {})[model_id] = size
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
    args = parser.parse_args(argv)
    try:
        if args.check:
            from astralight.check import check_recipe

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
                quiet=args.quiet, resume=True, check=not args.no_check)
        else:
            run(Path(args.recipe) if args.recipe else _default_recipe(),
                Path(args.run_dir) if args.run_dir else None, quiet=args.quiet,
                check=not args.no_check)
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
