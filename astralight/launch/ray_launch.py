"""``astralight run --backend ray``: the run's components as Ray actors on an existing cluster.

The launch is the local one (:mod:`astralight.launch.runner`: the same recipe, configs, commands,
supervision, stop sequence, progress and summary); only where each process runs changes. Each
component becomes a :class:`RayComponent`: a :class:`~astralight.launch.components.Component`
whose process is the child of a :class:`~astralight.launch.ray_process.ProcessActor`, its log still
``RUN/logs/NAME.log`` (the run folder must be on a file system every node shares, as on Slurm).

Placement (recipe ``ray``, :func:`ray_settings`):

- the **dataflow** runs on the launcher's own node (node affinity): the launcher chose its port
  there and reads it every second; it binds that node's IP, not loopback, so the others reach it.
  A non-loopback bind needs a token: set ``ASTRALIGHT_TOKEN`` (or the scoped tokens) before the
  launch (the dataflow refuses to start without one, naming the variable).
- every **RaaS**, **trainer** and the **autoscaler** gets one bundle of a placement group created
  for the run (``ray.strategy``, default ``PACK``; ``SPREAD`` puts them on different nodes), with
  the resources of its kind (``ray.raas``, ``ray.trainer``, ``ray.autoscale``: ``num_gpus``,
  ``num_cpus``, ``memory``, custom ``resources``). A restarted component gets the same bundle.
  With ``autoscale:`` the autoscaler runs ``--backend ray`` and gives each instance a placement
  group of its own (:mod:`astralight.autoscale.ray_backend`).

``RUN/ray_actors.json`` lists, for each component, its actor's name (namespace ``ray.namespace``),
node, GPUs and child pid: what an operator (or a test) finds to ``ray.kill``. At the end of the
run the placement group is removed and the driver disconnects; the cluster keeps running.
Tokens reach the actors as actor-creation arguments (Ray keeps them in its control store); the
``..._FILE`` forms of the token variables keep them off it, given a file every node can read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astralight.launch.components import Component
from astralight.launch.recipe import RecipeError
from astralight.launch.state import write_atomic
from astralight.launch.supervise import exit_reason
from astralight.launch.ray_process import (RayUnavailable, bundle, check_resources, connect, env_overlay,
                                    start_actor)

#: ``recipe.ray`` keys and their defaults (resources per component kind)
RAY_DEFAULTS = {"address": None, "namespace": "astralight", "strategy": "PACK",
                "ready_timeout_s": 300.0,
                "dataflow": {"num_cpus": 1}, "raas": {"num_gpus": 1, "num_cpus": 1},
                "trainer": {"num_gpus": 1, "num_cpus": 1}, "autoscale": {"num_cpus": 0}}
KINDS = ("dataflow", "raas", "trainer", "autoscale")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: the backends of ``astralight run --backend``
BACKENDS = ("local", "ray")


def ray_settings(spec: Any) -> dict:
    """``recipe.ray`` checked, defaults filled in (a kind given replaces its defaults whole)."""
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        raise RecipeError(f"recipe.ray: must be a mapping such as {{address: auto, raas: "
                          f"{{num_gpus: 1}}}}, got {spec!r}")
    unknown = sorted(set(spec) - set(RAY_DEFAULTS))
    if unknown:
        raise RecipeError(f"recipe.ray.{unknown[0]}: unknown key; known: "
                          f"{', '.join(RAY_DEFAULTS)}")
    out = {**RAY_DEFAULTS, **spec}
    if out["strategy"] not in STRATEGIES:
        raise RecipeError(f"recipe.ray.strategy: must be one of {', '.join(STRATEGIES)} (Ray's "
                          f"placement-group strategies), got {out['strategy']!r}")
    timeout = out["ready_timeout_s"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise RecipeError(f"recipe.ray.ready_timeout_s: must be seconds > 0, got {timeout!r}")
    for key in ("address", "namespace"):
        if out[key] is not None and not isinstance(out[key], str):
            raise RecipeError(f"recipe.ray.{key}: must be a string, got {out[key]!r}")
    for kind in KINDS:
        try:
            out[kind] = check_resources(out[kind], f"recipe.ray.{kind}")
        except ValueError as exc:
            raise RecipeError(str(exc)) from None
    return out


def actor_options(resources: dict) -> dict:
    """Ray ``.options()`` resources of one component's actor (0 CPUs unless asked: Ray's
    default of 1 would make a CPU-less request wait for a free core)."""
    return {"num_cpus": resources.get("num_cpus", 0), "num_gpus": resources.get("num_gpus", 0),
            **({"memory": resources["memory"]} if resources.get("memory") else {}),
            **({"resources": resources["resources"]} if resources.get("resources") else {})}


@dataclass
class RayComponent(Component):
    """A component whose process a Ray actor runs (see the module docstring); ``placement``
    is the run's :class:`RayRun`."""

    placement: Any = None
    #: the running process's actor name, node and GPUs (``RUN/ray_actors.json``)
    where: dict = field(default_factory=dict)

    def start(self, pool: Any = None) -> None:
        """Start (or restart) the process in a new actor: on the launcher's node for the
        dataflow, in this component's bundle otherwise. ``pool`` (prewarming) does not apply."""
        if self.proc is not None:
            self.proc.release()  # a restart: the dead (or abandoned) actor goes first
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None
        base = os.environ if self.base_env is None else self.base_env
        overlay, removed = env_overlay(self.child_env(), base)
        options = self.placement.options_for(self)
        self.proc = start_actor(options, self.argv + list(self.extra_argv), overlay, removed,
                                self.log_path, self.cpus, self.stop_signal,
                                self.placement.settings["ready_timeout_s"])
        self.prewarmed = False
        self.where = {"actor": options["name"], "namespace": self.placement.settings["namespace"],
                      **self.proc.info}
        self.lifetimes.append([self.proc.info["started_at"], None])
        self.placement.record(self)

    def alive(self) -> bool:
        alive = super().alive()
        if not alive and self.proc is not None and self.proc.died and not self.where.get("died"):
            self.where["died"] = self.proc.died  # said once, in its log and on the terminal
            note = f"[launch] {self.name}: its Ray actor died: {self.proc.died}"
            print(note, flush=True)
            with open(self.log_path, "a") as log:
                log.write(note + "\n")
            self.placement.record(self)
        return alive

    def exit_reason(self, rc: int | None) -> str:
        """Why it exited, for the supervisor's line: a dead actor (its -9 is Ray's, not the
        out-of-memory killer's), else what the status says."""
        if self.proc is not None and self.proc.died:
            return f" (its Ray actor died: {self.proc.died})"
        return exit_reason(rc)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        """Signal the child, wait up to ``timeout_s``, SIGKILL it after that; then end the
        actor, which gives its bundle back."""
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.release()
        self.alive()
        return self.proc.returncode


class RayRun:
    """One launch's connection to the Ray cluster: its placement group (a bundle per RaaS,
    trainer and autoscaler), the actors' names, and ``RUN/ray_actors.json``."""

    def __init__(self, settings: dict, run_dir: Path, base_env: dict):
        self.settings, self.run_dir, self.base_env = settings, Path(run_dir), base_env
        self.ray = connect(settings["address"], settings["namespace"])
        ctx = self.ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.node_ip = self.ray.util.get_node_ip_address()
        self.gcs_address = ctx.gcs_address
        self.group = None
        self.bundles: dict[str, int] = {}
        self.actors: dict[str, dict] = {}

    def place(self, comps: list["RayComponent"]) -> None:
        """Reserve one bundle per component but the dataflow, and wait until Ray has placed
        them all (RecipeError naming the resources when the cluster cannot)."""
        from ray.util.placement_group import placement_group, remove_placement_group

        placed = [c for c in comps if c.kind != "dataflow"]
        self.bundles = {c.name: i for i, c in enumerate(placed)}
        bundles = [bundle(self.settings[c.kind]) for c in placed]
        self.group = placement_group(bundles, strategy=self.settings["strategy"],
                                     name=f"astralight:{self.run_dir.name}")
        timeout = self.settings["ready_timeout_s"]
        try:
            self.ray.get(self.group.ready(), timeout=timeout)
        except self.ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            self.group = None
            asked = {c.name: b for c, b in zip(placed, bundles)}
            raise RecipeError(
                f"recipe.ray: the Ray cluster could not place {asked} "
                f"({self.settings['strategy']}) within ready_timeout_s={timeout:g}; it has "
                f"{self.ray.cluster_resources()} in all: lower recipe.ray.raas / "
                "recipe.ray.trainer, or add nodes") from None

    def options_for(self, comp: "RayComponent") -> dict:
        """The Ray options of ``comp``'s actor: its kind's resources, its bundle (the dataflow:
        this node), a name unique to the run."""
        from ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                                    PlacementGroupSchedulingStrategy)

        options = actor_options(self.settings[comp.kind])
        if comp.kind == "dataflow":
            strategy = NodeAffinitySchedulingStrategy(self.node_id, soft=False)
        else:
            strategy = PlacementGroupSchedulingStrategy(self.group, self.bundles[comp.name])
        attempt = len(comp.lifetimes)
        name = f"{self.run_dir.name}:{comp.name}" + (f":{attempt}" if attempt else "")
        return {**options, "scheduling_strategy": strategy, "name": name}

    def record(self, comp: "RayComponent") -> None:
        self.actors[comp.name] = dict(comp.where)
        write_atomic(self.run_dir / "ray_actors.json", json.dumps(self.actors, indent=2) + "\n")

    def close(self) -> None:
        """Remove the placement group and disconnect (the cluster keeps running)."""
        try:
            if self.group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.group)
        finally:
            self.ray.shutdown()


def ray_components(comps: list[Component], run: RayRun) -> list[RayComponent]:
    """The run's components (:func:`~astralight.launch.components.build_components`) as
    :class:`RayComponent` s on a :class:`RayRun`: the dataflow bound to its node's IP, the
    autoscaler given ``--backend ray`` and the cluster's address. Placed, not started."""
    settings = run.settings
    out = []
    for comp in comps:
        argv = list(comp.argv)
        if comp.kind == "dataflow":
            argv += ["--host", run.node_ip]
        elif comp.kind == "autoscale":
            argv += ["--backend", "ray", "--ray-address", run.gcs_address,
                     "--ray-namespace", settings["namespace"],
                     "--ray-resources", json.dumps(settings["raas"])]
        out.append(RayComponent(comp.name, argv, comp.log_path, env=comp.env, cpus=comp.cpus,
                                config=comp.config, extra_argv=comp.extra_argv,
                                base_env=comp.base_env, placement=run))
    run.place(out)
    return out


def connect_run(recipe: dict, run_dir: Path, base_env: dict) -> RayRun:
    """The :class:`RayRun` of a launch (RecipeError for a bad ``recipe.ray`` or a missing Ray,
    naming the extra, before anything starts)."""
    try:
        return RayRun(ray_settings(recipe.get("ray")), run_dir, base_env)
    except RayUnavailable as exc:
        raise RecipeError(str(exc)) from None

