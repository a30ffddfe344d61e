"""The autoscaler's Ray backend: each rollout service a Ray actor in a placement group of its own.

``astralight autoscale --backend ray --ray-address HOST:PORT --raas-config RAAS.yaml`` (what
``astralight run --backend ray`` starts for a recipe with ``autoscale:``). Beside
:class:`~astralight.autoscale.backends.LocalProcessBackend` and
:class:`~astralight.autoscale.backends.CommandBackend`, with the same protocol:

- :meth:`RayBackend.launch` reserves a one-bundle placement group with ``resources`` (default one
  GPU and one CPU: ``--ray-resources '{"num_gpus": 1, "num_cpus": 1}'``), waits until Ray has
  placed it (``BackendError`` naming the resources after ``ready_timeout_s``: the cluster is full,
  and the autoscaler's next decision tries again), then starts ``raas serve ... --instance_id ID``
  in a :class:`~astralight.launch.ray_process.ProcessActor` there, its output in ``LOG_DIR/ID.log``.
- :meth:`RayBackend.retire` drains through the dataflow (``POST /v1/instances/{id}/drain``), waits
  for the process, SIGTERM after ``drain_timeout_s``, SIGKILL ``kill_after_s`` later (in a thread,
  like the local backend), then ends the actor and removes its placement group: the GPU goes back
  to the cluster.
- :meth:`RayBackend.alive` asks the actor; a killed actor (``ray.kill``, a lost node) reads as
  exited, and the autoscaler replaces it like any instance that died.

The actors belong to the autoscaler's Ray driver: if the autoscaler dies, Ray ends them (and
their RaaS) with it, as the parent-death signal does for local instances; a restarted autoscaler
starts a new pool. Each RaaS gets the rollout token only (:func:`~astralight.dataflow.auth.handoff_env`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from astralight.autoscale.backends import BackendError, drain_then_stop
from astralight.dataflow.auth import ROLLOUT, handoff_env
from astralight.launch.ray_process import (RayProcess, RayUnavailable, bundle, check_resources, connect,
                                    env_overlay, start_actor)

log = logging.getLogger("astralight.autoscale")

#: resources of one instance when none are given
DEFAULT_RESOURCES = {"num_gpus": 1, "num_cpus": 1}


def instance_options(resources: dict, group: Any, name: str) -> dict:
    """The Ray options of one instance's actor: its resources inside bundle 0 of ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": resources.get("num_cpus", 0), "num_gpus": resources.get("num_gpus", 0),
            **({"memory": resources["memory"]} if resources.get("memory") else {}),
            **({"resources": resources["resources"]} if resources.get("resources") else {}),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, 0), "name": name}


class RayBackend:
    """RaaS instances as Ray actors (see the module docstring).

    ``address``: the Ray cluster (None: ``RAY_ADDRESS`` or this machine's ``ray start``);
    ``namespace``: of the actors, named ``autoscale:ID``; ``resources``: each instance's
    (``num_gpus``, ``num_cpus``, ``memory``, custom ``resources``); ``env``: extra environment;
    ``cpus``: CPU numbers to pin each instance to, where its node has them.
    """

    def __init__(self, raas_config: str | os.PathLike, dataflow_url: str,
                 log_dir: str | os.PathLike, address: str | None = None,
                 namespace: str = "astralight", resources: dict | None = None,
                 env: dict | None = None, cpus: list[int] | None = None,
                 drain_timeout_s: float = 120.0, kill_after_s: float = 30.0,
                 ready_timeout_s: float = 300.0, name_prefix: str = "autoscale:",
                 client_factory: Callable[[], Any] | None = None,
                 say: Callable[[str], None] | None = None):
        self.raas_config = Path(raas_config)
        if not self.raas_config.is_file():
            raise BackendError(f"raas_config: {self.raas_config} is not a file (the RaaS config "
                               "every instance starts with)")
        if drain_timeout_s < 0 or kill_after_s < 0 or ready_timeout_s <= 0:
            raise BackendError("drain_timeout_s / kill_after_s: must be >= 0 seconds; "
                               "ready_timeout_s: > 0")
        try:
            self.resources = check_resources(DEFAULT_RESOURCES if resources is None else resources,
                                             "--ray-resources")
        except ValueError as exc:
            raise BackendError(str(exc)) from None
        self.dataflow_url, self.log_dir = dataflow_url, Path(log_dir)
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self.cpus = list(cpus) if cpus else None
        self.drain_timeout_s, self.kill_after_s = float(drain_timeout_s), float(kill_after_s)
        self.ready_timeout_s = float(ready_timeout_s)
        self.name_prefix = name_prefix
        self.client_factory = client_factory or self._default_client
        self.say = say or log.info
        try:
            self.ray = connect(address, namespace)
        except RayUnavailable as exc:
            raise BackendError(str(exc)) from None
        self.procs: dict[str, RayProcess] = {}
        self.groups: dict[str, Any] = {}
        self.retirements: dict[str, threading.Thread] = {}
        self.events: list[dict] = []  # what each retirement took
        self._lock = threading.Lock()

    def _default_client(self):
        from astralight.dataflow.client import DataflowClient

        return DataflowClient(self.dataflow_url, retry_s=10.0, timeout=10.0)

    def argv(self, instance_id: str) -> list[str]:
        """The instance's command; its first item stands for the node's Python interpreter."""
        return ["python", "-m", "astralight.cli", "raas", "serve", "--dataflow",
                self.dataflow_url, "--config", str(self.raas_config), "--instance_id", instance_id]

    def launch(self, instance_id: str, n: int | None = None) -> RayProcess:
        from ray.util.placement_group import placement_group, remove_placement_group

        if self.alive(instance_id):
            raise BackendError(f"instance {instance_id} is already running")
        group = placement_group([bundle(self.resources)], name=f"{self.name_prefix}{instance_id}")
        try:
            self.ray.get(group.ready(), timeout=self.ready_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise BackendError(f"launch {instance_id}: Ray could not place {bundle(self.resources)} "
                               f"within {self.ready_timeout_s:g}s; free now: "
                               f"{self.ray.available_resources()}") from None
        base = dict(os.environ)
        overlay, removed = env_overlay(handoff_env({**base, **self.env}, ROLLOUT), base)
        try:
            proc = start_actor(instance_options(self.resources, group,
                                                f"{self.name_prefix}{instance_id}"),
                               self.argv(instance_id), overlay, removed,
                               self.log_dir / f"{instance_id}.log", self.cpus, signal.SIGTERM,
                               self.ready_timeout_s)
        except Exception as exc:
            remove_placement_group(group)
            raise BackendError(f"launch {instance_id}: {exc}") from None
        self.procs[instance_id], self.groups[instance_id] = proc, group
        info = proc.info
        self.say(f"{instance_id}: started on node {info['node_id'][:8]} ({info['node_ip']}), "
                 f"GPUs {info['gpu_ids'] or 'none'}, pid {info['pid']}")
        return proc

    def manages(self, instance_id: str) -> bool:
        return instance_id in self.procs

    def alive(self, instance_id: str) -> bool | None:
        """Whether its process runs; None for an instance it did not start."""
        proc = self.procs.get(instance_id)
        return None if proc is None else proc.poll() is None

    def returncode(self, instance_id: str) -> int | None:
        proc = self.procs.get(instance_id)
        return None if proc is None else proc.poll()

    def retire(self, instance_id: str, n: int | None = None, wait: bool = False) -> None:
        """Drain ``instance_id``, stop it and free its resources, in a thread (``wait``: join)."""
        if instance_id not in self.procs:
            raise BackendError(f"instance {instance_id} was not started by this backend")
        with self._lock:
            thread = self.retirements.get(instance_id)
            if thread is None or not thread.is_alive():
                thread = threading.Thread(target=self._retire, args=(instance_id,),
                                          name=f"retire-{instance_id}", daemon=True)
                self.retirements[instance_id] = thread
                thread.start()
        if wait:
            thread.join()

    def _retire(self, instance_id: str) -> None:
        proc, t0 = self.procs[instance_id], time.monotonic()
        how = drain_then_stop(instance_id, proc, self.client_factory, self.drain_timeout_s,
                              self.kill_after_s, self.say)
        self._free(instance_id)
        event = {"instance_id": instance_id, "how": how, "exit_code": proc.returncode,
                 "seconds": round(time.monotonic() - t0, 2)}
        with self._lock:
            self.events.append(event)
        self.say(f"{instance_id}: stopped ({how}, exit {proc.returncode}, "
                 f"{event['seconds']:.1f}s after retirement began); its placement group removed")

    def _free(self, instance_id: str) -> None:
        """End the actor and remove its placement group."""
        from ray.util.placement_group import remove_placement_group

        self.procs[instance_id].release()
        group = self.groups.pop(instance_id, None)
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - already removed
                pass

    def stop_now(self) -> None:
        """A second signal: no more waiting for drains; SIGTERM every running instance."""
        self.drain_timeout_s = 0.0
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for retirements in progress (at most ``timeout_s`` in all), then stop what still
        runs (SIGTERM, SIGKILL ``kill_after_s`` later) and free every actor and group."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in list(self.retirements.values()):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for iid, proc in self.procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=self.kill_after_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
            if iid in self.groups:
                self._free(iid)
