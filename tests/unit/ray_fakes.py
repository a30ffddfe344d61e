"""Fakes of Ray for the Ray backend's unit tests: a ``ray`` module stand-in whose actors answer
from a script (:class:`FakeRay`, :class:`FakeActor`) and the launcher's cluster connection
(:class:`FakeRayRun`). The real thing runs in ``tests/integration/test_ray_cluster.py``.

Shared here so that tests never import from one another (no test module imports from a
``test_*`` module; ``tests/unit/test_no_cross_test_imports.py`` checks it).
"""

from __future__ import annotations

from types import SimpleNamespace


class ActorDied(Exception):
    """Stands for ``ray.exceptions.RayActorError``."""


class GetTimeout(Exception):
    """Stands for ``ray.exceptions.GetTimeoutError``."""


class _Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args):
        return (self.actor, self.name, args)  # the "object ref" FakeRay.get resolves


class FakeActor:
    """An actor whose child exits with ``code`` once ``exit_after_polls`` polls have seen it
    running (None: never); ``dead`` makes every call fail as on a killed actor; ``busy`` makes
    every call time out."""

    def __init__(self, exit_after_polls: int | None = None, code: int = 0):
        self.exit_after_polls, self.code = exit_after_polls, code
        self.polls, self.signals, self.dead, self.busy, self.killed = 0, [], False, False, False

    def __getattr__(self, name):
        return _Method(self, name)

    def answer(self, name, args):
        if self.dead:
            raise ActorDied("The actor died unexpectedly before finishing this task.")
        if self.busy:
            raise GetTimeout()
        if name == "poll":
            self.polls += 1
            if self.exit_after_polls is not None and self.polls > self.exit_after_polls:
                return self.code
            return None
        if name == "signal":
            self.signals.append(args[0])
            return None
        if name == "kill":
            self.killed = True
            self.exit_after_polls, self.code = 0, -9
            return -9
        raise AttributeError(name)


class FakeRay:
    """The parts of the ``ray`` module :class:`~astralight.launch.ray_process.RayProcess` uses."""

    exceptions = SimpleNamespace(RayActorError=ActorDied, GetTimeoutError=GetTimeout)

    def __init__(self):
        self.kills = []

    def get(self, ref, timeout=None):
        actor, name, args = ref
        return actor.answer(name, args)

    def kill(self, actor, no_restart=True):
        self.kills.append(actor)
        actor.dead = True


class FakeRayRun:
    """The launcher's cluster connection (:class:`~astralight.launch.ray_launch.RayRun`) without
    a cluster: ``place`` records the components it would reserve bundles for."""

    def __init__(self, settings: dict, node_ip: str = "10.0.0.5",
                 gcs_address: str = "10.0.0.5:6379"):
        self.settings, self.node_ip, self.gcs_address = settings, node_ip, gcs_address
        self.placed: list[str] = []

    def place(self, comps):
        self.placed = [c.name for c in comps if c.kind != "dataflow"]
