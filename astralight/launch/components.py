"""The run's processes: each component's config and command, starting and stopping it, and the
run folder's ``pids.json`` of what runs now.

A :class:`Component` is one child process; :func:`build_components` turns a (substituted) recipe
into the run's components in start order, each config written under ``RUN_DIR/configs``.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from astralight.launch.state import write_atomic
from astralight.launch.proc import spawn
from astralight.launch.recipe import RecipeError, autoscale_settings, with_pythonpath


def _default_recipe() -> Path:
    """The embedded toy recipe (examples/toy/recipe.yaml, installed as package astralight.toy)."""
    import astralight.toy

    return Path(astralight.toy.__file__).resolve().parent / "recipe.yaml"


def inherited_env(base: Any, env: dict) -> dict[str, str]:
    """``base`` (the launcher's environment) with a component's own ``env`` over it, as strings:
    what a component, or its prewarmed process, starts with (before its token hand-off)."""
    return {**base, **{k: str(v) for k, v in env.items()}}


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
    #: the launcher's environment it inherits (None: ``os.environ`` as it is at each start)
    base_env: dict | None = None
    #: whether the running process is a prewarmed one it became (:mod:`astralight.launch.prewarm`)
    prewarmed: bool = False
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

    def start(self, pool: Any = None) -> None:
        """Start the process; ``pool`` (a :class:`~astralight.launch.prewarm.PrewarmPool`): become one
        of its prewarmed processes that fits, if one does, instead of starting a fresh one."""
        if self.log_file is not None:  # a restart: the previous process's log handle
            self.log_file.close()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.log_path, "ab", buffering=0)
        argv, env = self.argv + list(self.extra_argv), self.child_env()
        warm = pool.take(self.kind, env, self.cpus, self.stop_signal) if pool else None
        self.proc = warm.hand_off(argv, env, self.log_path) if warm is not None else None
        self.prewarmed = self.proc is not None
        if self.prewarmed:
            self.lifetimes.append([time.time(), None])
            return
        if pool is not None and pool.misfits:  # a prewarmed one was there: say why not it
            print(f"[launch] {self.name}: started fresh, not prewarmed: "
                  f"{'; '.join(pool.misfits)}", flush=True)
        # A session of its own: a terminal's Ctrl-C reaches the launcher only, which then stops
        # the components in order instead of all at once. The child gets SIGTERM if the launcher
        # dies, even by SIGKILL (astralight.launch.proc): a killed launcher leaves no stray component.
        # Components are started and restarted on the thread that runs the launcher's loop,
        # which outlives them (the parent-death signal follows the forking thread). The signal is
        # the one the launcher's own stop sends: SIGINT for a trainer (Lightning's graceful stop,
        # which also breaks out of a wait on a dataflow that died too), SIGTERM for a service.
        self.proc = spawn(argv, cpus=self.cpus, stdout=self.log_file, stderr=subprocess.STDOUT,
                          env=env, death_signal=self.stop_signal)
        self.lifetimes.append([time.time(), None])

    def child_env(self) -> dict:
        """The environment it starts with: the launcher's, its own ``env``, and -- when scoped
        tokens are set -- the token of its scope as ``ASTRALIGHT_TOKEN`` (a trainer's bound to
        its model_id), the other scopes' tokens removed
        (:func:`astralight.dataflow.auth.handoff_env`)."""
        from astralight.dataflow.auth import KIND_SCOPES, handoff_env

        env = inherited_env(os.environ if self.base_env is None else self.base_env, self.env)
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


def _write_yaml(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


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


def kind_envs(recipe: dict) -> dict[str, dict]:
    """The ``env`` of each component kind (``dataflow``, ``raas``, ``trainer``): the recipe's
    ``env.<kind>``, its ``pythonpath`` in front, and for a pinned RaaS the cores vLLM binds its
    OpenMP threads to. The autoscaler gets the RaaS one."""
    env, cpus = recipe.get("env") or {}, _affinity(recipe.get("cpu_affinity") or {})
    raas_env = dict(env.get("raas", {}))
    if "raas" in cpus:  # vLLM binds its OpenMP threads itself; tell it which cores are its own
        raas_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus["raas"])))
    return {"dataflow": with_pythonpath(recipe, env.get("dataflow", {})),
            "raas": with_pythonpath(recipe, raas_env),
            "trainer": with_pythonpath(recipe, env.get("trainer", {}))}


def build_components(recipe: dict, run_dir: Path, url: str, port: int,
                     base_env: dict | None = None) -> list[Component]:
    """The run's processes, in start order: dataflow, rollout services (or the autoscaler),
    trainers; each inherits ``base_env`` (None: the launcher's ``os.environ`` at its start)."""
    py = [sys.executable, "-m", "astralight.cli"]
    envs, cpus = kind_envs(recipe), _affinity(recipe.get("cpu_affinity") or {})
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
            argv = ["dataflow", "serve", "--config", path]
        elif kind == "raas":
            argv = ["raas", "serve", "--dataflow", url, "--config", path]
        else:
            argv = ["fit", "--config", path]
        comps.append(Component(name, py + argv, run_dir / "logs" / f"{name}.log",
                               env=envs[kind], cpus=cpus.get(kind), base_env=base_env,
                               config=cfg))
    if autoscale is not None:
        # started right after the dataflow; pinned to the RaaS cores, which its children (the
        # instances) inherit, with the RaaS environment
        argv = autoscale_argv(autoscale_settings(autoscale), url, str(template),
                              recipe["stop"].get("model_id", "policy"), run_dir)
        comps.insert(1, Component("autoscale", py + argv, run_dir / "logs" / "autoscale.log",
                                  env=envs["raas"], cpus=cpus.get("raas"),
                                  base_env=base_env))
    for comp in comps:  # each one's token hand-off, checked before anything starts
        try:
            comp.child_env()
        except ValueError as exc:
            raise RecipeError(f"tokens for {comp.name}: {exc}") from None
    return comps


#: what a prewarmed process of each kind imports before any config is read
#: (:mod:`astralight.launch.prewarm`): the component's entry point and the heavy libraries it loads
PREWARM_IMPORTS = {"raas": ("astralight.raas.service",),
                   "trainer": ("astralight.trainer.trainer_cli", "transformers.models.auto.modeling_auto")}
#: what a vLLM engine adds to a RaaS's prewarm imports (what ``from vllm import LLM`` loads)
VLLM_IMPORTS = ("vllm.entrypoints.llm",)


def prewarm_plan(recipe: dict) -> list[tuple[str, list[str], int]]:
    """``(kind, imports, stop signal)`` of the prewarmed process of each RaaS and trainer of
    ``recipe``, in start order: the kind's :data:`PREWARM_IMPORTS`, each engine's and policy's
    module (and vLLM for the default engine). An autoscaled pool gets none (its RaaS are the
    autoscaler's children)."""
    from astralight.raas.config import DEFAULT_ENGINE

    plan: list[tuple[str, list[str], int]] = []
    if recipe.get("autoscale") is None:
        for entry in recipe.get("raas") or []:
            imports = list(PREWARM_IMPORTS["raas"])
            engines = (entry.get("engines") if isinstance(entry, dict) else None) or {}
            for spec in engines.values():
                path = spec.get("class_path", DEFAULT_ENGINE) if isinstance(spec, dict) else None
                if isinstance(path, str) and "." in path and "{" not in path:
                    imports.append(path.rpartition(".")[0])
                    if path == DEFAULT_ENGINE:
                        imports += VLLM_IMPORTS
            plan.append(("raas", list(dict.fromkeys(imports)), signal.SIGTERM))
    for entry in recipe.get("trainers") or []:
        imports = list(PREWARM_IMPORTS["trainer"])
        model = (entry.get("model") if isinstance(entry, dict) else None) or {}
        path = model.get("class_path") if isinstance(model, dict) else None
        if isinstance(path, str) and "." in path and "{" not in path:
            imports.append(path.rpartition(".")[0])
        plan.append(("trainer", list(dict.fromkeys(imports)), signal.SIGINT))
    return plan


def prewarm_components(recipe: dict, run_dir: Path, pool: Any, base_env: dict) -> int:
    """Start, in ``pool`` (a :class:`~astralight.launch.prewarm.PrewarmPool`), the prewarmed processes
    of :func:`prewarm_plan`, each with the environment (``base_env`` and its kind's ``env``)
    and pinning :func:`build_components` will give its component; the number started (0 with
    ``ASTRALIGHT_PREWARM=0``)."""
    from astralight.launch.prewarm import enabled

    if not enabled(base_env):
        return 0
    envs, cpus = kind_envs(recipe), _affinity(recipe.get("cpu_affinity") or {})
    plan = prewarm_plan(recipe)
    for kind, imports, sig in plan:
        pool.start(kind, imports, inherited_env(base_env, envs[kind]), cpus.get(kind), sig,
                   run_dir)
    return len(plan)


def write_pids(run_dir: Path, comps: list[Component]) -> Path:
    """``RUN_DIR/pids.json``: ``{component: pid}`` of every component running now (rewritten on
    each start, restart, exit and stop), so a fault injector or an operator finds what to kill.
    Components of the autoscaler's pool are its children and are not listed."""
    pids = {c.name: c.pid for c in comps if c.proc is not None and c.proc.poll() is None}
    return write_atomic(run_dir / "pids.json", json.dumps(pids, indent=2) + "\n")


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
