"""Component processes placed by Ray: a Ray actor that runs one astralight command.

Ray is only the *placer* here. A :class:`ProcessActor`, scheduled by Ray on some node of an
existing cluster (with the CPUs and GPUs its placement-group bundle holds), starts the same
command line a local launch would (``python -m astralight.cli raas serve ...``) as its child,
writes the child's output to a log file on the run folder's (shared) file system, and answers
``poll`` / ``signal`` / ``kill``. The components still meet only through the dataflow's HTTP
interface; nothing of theirs crosses Ray's object store. :class:`RayProcess` is the launcher's
handle on one such actor, shaped like :class:`subprocess.Popen` (``poll``, ``wait``,
``send_signal``, ``pid``, ``returncode``), so the launcher's supervision and stop sequence and the
autoscaler's retirement treat a Ray-placed process as a local one.

The child runs with the actor's environment (what the Ray worker has on its node, including the
``CUDA_VISIBLE_DEVICES`` Ray set for the GPUs the actor holds) plus the component's own variables
(:func:`env_overlay`); the interpreter is the node's (the worker's ``sys.executable``), not the
launcher's. When the actor dies (``ray.kill``, its node lost) Ray kills the child with it, and the
handle reports exit status :data:`ACTOR_DIED` (a SIGKILL: the child had no polite stop).

Ray is optional (the ``ray`` extra): importing this module does not import Ray;
:func:`require_ray` does, with an error naming the extra.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

#: what to install for the Ray backend
RAY_EXTRA = "pip install 'astralight[ray]'  (ray==2.60.0)"
#: the exit status a handle reports once its actor is dead (Ray SIGKILLs the actor's children)
ACTOR_DIED = -int(signal.SIGKILL)
#: resource keys of one actor (Ray's ``.options()`` names), per component kind in a recipe
RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "resources")
#: environment variables the launcher sets for every component (``_component_env``): sent to
#: the actor even when equal to the launcher's own, since the node's environment may differ
ALWAYS_SENT = ("ASTRALIGHT_", "VLLM_", "TOKENIZERS_PARALLELISM", "PYTHONPATH", "OMP_NUM_THREADS")


class RayUnavailable(RuntimeError):
    """Ray is not installed (the message names the extra to install), or no cluster answers at
    the address given."""


def require_ray(what: str = "--backend ray"):
    """The ``ray`` module, or :class:`RayUnavailable` naming the extra."""
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(f"{what} needs Ray, which is not installed: {RAY_EXTRA}") from exc
    return ray


def connect(address: str | None, namespace: str) -> Any:
    """Connect this process to the Ray cluster at ``address`` (None: ``RAY_ADDRESS`` or the
    cluster ``ray start`` last started on this machine) once; the ``ray`` module. Never starts a
    cluster of its own: the backend places components on an existing one."""
    ray = require_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address or "auto", namespace=namespace, log_to_driver=False,
                     configure_logging=False)
        except ConnectionError as exc:
            raise RayUnavailable(f"ray.address: no Ray cluster at {address or 'auto'} ({exc}); start "
                             "one (`ray start --head`) or give its address (ray.address in the "
                             "recipe, or RAY_ADDRESS)") from None
    return ray


def check_resources(spec: Any, where: str) -> dict:
    """One actor's resources (``{num_cpus, num_gpus, memory, resources: {NAME: amount}}``),
    checked; ``where`` names the recipe key in errors."""
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: must be a mapping such as {{num_gpus: 1, num_cpus: 4}}, "
                         f"got {spec!r}")
    out = {}
    for key, value in spec.items():
        if key not in RESOURCE_KEYS:
            raise ValueError(f"{where}.{key}: unknown resource; known: {', '.join(RESOURCE_KEYS)}")
        if key == "resources":
            if not isinstance(value, Mapping) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                    for v in value.values()):
                raise ValueError(f"{where}.resources: must map custom resource names to amounts "
                                 f">= 0, such as {{accelerator_type:A100: 0.001}}; got {value!r}")
            out[key] = {str(k): float(v) for k, v in value.items()}
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{where}.{key}: must be a number >= 0, got {value!r}")
        else:
            out[key] = value
    return out


def bundle(resources: Mapping) -> dict[str, float]:
    """The placement-group bundle of one actor's resources (Ray's ``CPU`` / ``GPU`` / ``memory``
    and custom names). An empty bundle is not allowed by Ray: a CPU-less actor reserves a token
    0.01 CPU so that its bundle still pins it to a node."""
    out = {"CPU": float(resources.get("num_cpus", 0)), "GPU": float(resources.get("num_gpus", 0))}
    if resources.get("memory"):
        out["memory"] = float(resources["memory"])
    out.update(resources.get("resources") or {})
    out = {k: v for k, v in out.items() if v > 0}
    return out or {"CPU": 0.01}


def env_overlay(child_env: Mapping[str, str], base_env: Mapping[str, str]
                ) -> tuple[dict[str, str], list[str]]:
    """``(overlay, removed)``: what a component's environment (``child_env``, built over the
    launcher's ``base_env``) sets beyond the launcher's own, and the variables it removes (the
    other scopes' tokens). The actor applies them over its node's environment: the launcher's
    ``PATH``, ``HOME`` or virtual environment say nothing about another node."""
    overlay = {k: v for k, v in child_env.items()
               if base_env.get(k) != v or k.startswith(ALWAYS_SENT)}
    removed = sorted(k for k in base_env if k not in child_env)
    return overlay, removed


class ProcessActor:
    """The actor (decorated with ``ray.remote`` by :func:`actor_class`): one child process.

    Its methods run on the worker's main thread (a single-threaded actor), which lives as long
    as the actor: the child's parent-death signal (:mod:`astralight.launch.proc`) is tied to it.
    """

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def start(self, argv: list[str], overlay: dict, removed: list[str], log_path: str,
              cpus: list[int] | None = None, death_signal: int = signal.SIGTERM,
              python: bool = True) -> dict:
        """Start ``argv`` (``python``: its first item replaced by this node's interpreter) with
        this worker's environment, ``overlay`` over it and ``removed`` taken out, its output
        appended to ``log_path``. Where it runs: pid, node, GPUs."""
        import ray

        from astralight.launch.proc import spawn

        env = {**os.environ, **overlay}
        for key in removed:
            env.pop(key, None)
        argv = [sys.executable, *argv[1:]] if python else list(argv)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        mine = os.sched_getaffinity(0)
        cpus = [c for c in cpus or [] if c in mine] or None  # the recipe's numbers, if this node has them
        with open(log_path, "ab", buffering=0) as log:
            self.proc = spawn(argv, cpus=cpus, stdout=log, stderr=subprocess.STDOUT, env=env,
                              death_signal=death_signal, from_thread_ok=True)
        ctx = ray.get_runtime_context()
        return {"pid": self.proc.pid, "node_ip": ray.util.get_node_ip_address(),
                "node_id": ctx.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
                "started_at": time.time()}

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def kill(self) -> int | None:
        """SIGKILL the child's process group (its own children too) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        return self.poll()

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()


_ACTOR_CLASS = None


def actor_class():
    """:class:`ProcessActor` as a Ray actor class (made once; Ray imported here)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = require_ray().remote(ProcessActor)
    return _ACTOR_CLASS


class RayProcess:
    """A :class:`subprocess.Popen`-shaped handle on a :class:`ProcessActor`'s child.

    ``poll`` asks the actor (``poll_timeout_s``; an actor too busy to answer counts as running);
    once the actor is dead it reports :data:`ACTOR_DIED` and ``died`` says why.
    """

    def __init__(self, actor: Any, info: dict, poll_timeout_s: float = 10.0):
        self.actor, self.info = actor, info
        self.pid = info.get("pid")
        self.poll_timeout_s = poll_timeout_s
        self.returncode: int | None = None
        self.died: str | None = None

    def _call(self, method: str, *args, timeout: float | None = None):
        ray = require_ray()
        try:
            return ray.get(getattr(self.actor, method).remote(*args),
                           timeout=timeout or self.poll_timeout_s)
        except ray.exceptions.GetTimeoutError:
            return None
        except ray.exceptions.RayActorError as exc:
            if self.returncode is None:
                self.returncode = ACTOR_DIED
                self.died = " ".join(str(exc).split())[:300]
            return None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._call("poll")
            if code is not None:
                self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("ray actor", timeout)
            time.sleep(0.2)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self._call("signal", int(sig))

    def kill(self) -> None:
        """SIGKILL the child, then end the actor (its bundle's resources go back to Ray)."""
        if self.poll() is None:
            code = self._call("kill", timeout=30.0)
            if code is not None:
                self.returncode = code
        self.release()

    def release(self) -> None:
        """End the actor (after its child exited, or to abandon it)."""
        try:
            require_ray().kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if self.returncode is None:
            self.returncode = ACTOR_DIED


def start_actor(options: dict, argv: list[str], overlay: dict, removed: list[str],
                log_path: Path, cpus: list[int] | None, death_signal: int,
                ready_timeout_s: float) -> RayProcess:
    """Create a :class:`ProcessActor` with Ray ``options`` (resources, scheduling strategy, name)
    and start ``argv`` in it; the handle. A start that does not answer within ``ready_timeout_s``
    (no node has the resources) ends the actor and raises RuntimeError saying what it asked for."""
    ray = require_ray()
    actor = actor_class().options(max_restarts=0, max_concurrency=1, **options).remote()
    ref = actor.start.remote(list(argv), dict(overlay), list(removed), str(log_path), cpus,
                             int(death_signal), True)
    try:
        info = ray.get(ref, timeout=ready_timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor, no_restart=True)
        asked = {k: v for k, v in options.items() if k in RESOURCE_KEYS}
        raise RuntimeError(f"Ray did not start {options.get('name', 'the actor')} within "
                           f"{ready_timeout_s:g}s (asked for {asked or 'no resources'}); the "
                           f"cluster has {ray.available_resources()} free") from None
    return RayProcess(actor, info)


__all__ = ["ACTOR_DIED", "ProcessActor", "RAY_EXTRA", "RayUnavailable", "RayProcess", "actor_class",
           "bundle", "check_resources", "connect", "env_overlay", "require_ray", "start_actor"]
