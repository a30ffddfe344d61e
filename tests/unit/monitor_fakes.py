"""Fakes for the DataflowMonitor unit tests: a dataflow client answering ``stats`` and
``eval_results`` from dicts (:class:`FakeClient`), a logger that records every call
(:class:`RecordingLogger`), and :func:`monitor_with`, a monitor on such a client with a stand-in
trainer (so no fit is run).

Shared here so that tests never import from one another (no test module imports from a
``test_*`` module; ``tests/unit/test_no_cross_test_imports.py`` checks it).
"""

from __future__ import annotations

from types import SimpleNamespace

from astralight.callbacks import DataflowMonitor


class FakeClient:
    def __init__(self, stats: dict, evals: dict | None = None):
        self._stats, self._evals = stats, evals or {}

    def stats(self) -> dict:
        return self._stats

    def eval_results(self, model_id: str) -> dict:
        return self._evals


class RecordingLogger:
    def __init__(self):
        self.calls: list[tuple[dict, int]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.calls.append((dict(metrics), step))

    def merged(self) -> dict:
        out = {}
        for metrics, _ in self.calls:
            out.update(metrics)
        return out


def monitor_with(stats: dict, evals: dict | None = None, n_loggers: int = 1):
    """A monitor on a :class:`FakeClient` and a stand-in trainer with ``n_loggers`` recording
    loggers (``trainer.logger`` is the first, as in Lightning)."""
    monitor = DataflowMonitor(dataflow_url="http://127.0.0.1:1", model_id="policy",
                              steps_per_version=2)
    monitor.client = FakeClient(stats, evals)
    loggers = [RecordingLogger() for _ in range(n_loggers)]
    trainer = SimpleNamespace(logger=loggers[0] if loggers else None, loggers=loggers,
                              global_rank=0, global_step=14)
    return monitor, trainer
