"""Fakes of the autoscaler's surroundings, shared by the autoscaler unit tests: a backend that
records launches and retirements (:class:`FakeBackend`) and a clock the test moves
(:class:`Clock`). Its dataflow client is :class:`tests.fakes.FakeAutoscaleDataflow`.

Shared here so that tests never import from one another (no test module imports from a
``test_*`` module; ``tests/unit/test_no_cross_test_imports.py`` checks it).
"""

from __future__ import annotations


class FakeBackend:
    def __init__(self):
        self.running: set[str] = set()
        self.calls: list[tuple] = []

    def launch(self, instance_id, n=None):
        self.calls.append(("launch", instance_id, n))
        self.running.add(instance_id)

    def retire(self, instance_id, n=None):
        self.calls.append(("retire", instance_id, n))
        self.running.discard(instance_id)

    def alive(self, instance_id):
        return instance_id in self.running

    def returncode(self, instance_id):
        return None if instance_id in self.running else -9

    def close(self):
        self.calls.append(("close",))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, seconds: float) -> None:
        """The Autoscaler's ``sleep``: time passes at once."""
        self.t += seconds
