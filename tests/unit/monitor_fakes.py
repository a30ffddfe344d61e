"""Fakes for the DataflowMonitor unit tests: a logger that records every call
(:class:`RecordingLogger`; with W&B's ``log_table``: :class:`TableLogger`; with TensorBoard's
``experiment.add_text``: :class:`TextLogger`), and :func:`monitor_with`, a monitor on a
:class:`tests.fakes.FakeMonitorClient` (its dataflow) with a stand-in trainer (so no fit is run).

Shared here so that tests never import from one another (no test module imports from a
``test_*`` module; ``tests/unit/test_no_cross_test_imports.py`` checks it).
"""

from __future__ import annotations

from types import SimpleNamespace

from astralight.callbacks import DataflowMonitor
from tests.fakes import FakeMonitorClient


class RecordingLogger:
    def __init__(self):
        self.calls: list[tuple[dict, int]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.calls.append((dict(metrics), step))

    def finalize(self, status: str) -> None:
        self.calls.append(({"finalize": status}, -1))

    def merged(self) -> dict:
        out = {}
        for metrics, _ in self.calls:
            out.update(metrics)
        return out


class TableLogger(RecordingLogger):
    """A logger with W&B's ``log_table`` (what Lightning's ``WandbLogger`` has)."""

    def __init__(self):
        super().__init__()
        self.tables: list[dict] = []

    def log_table(self, key, columns=None, data=None, dataframe=None, step=None) -> None:
        self.tables.append({"key": key, "columns": list(columns), "data": data, "step": step})


class TextExperiment:
    def __init__(self):
        self.texts: list[tuple[str, str, int | None]] = []

    def add_text(self, tag: str, text: str, global_step: int | None = None) -> None:
        self.texts.append((tag, text, global_step))


class TextLogger(RecordingLogger):
    """A logger whose ``experiment`` has TensorBoard's ``add_text``."""

    def __init__(self):
        super().__init__()
        self.experiment = TextExperiment()


def monitor_with(stats: dict, evals: dict | None = None, n_loggers: int = 1,
                 loggers: list | None = None, completion_rows: dict | None = None, **kwargs):
    """A monitor on a :class:`~tests.fakes.FakeMonitorClient` (answering ``completion_rows`` as its
    ``completions``, see there) and a stand-in trainer with ``n_loggers`` recording loggers, or
    ``loggers`` (``trainer.logger`` is the first, as in Lightning); ``kwargs`` go to the
    monitor."""
    monitor = DataflowMonitor(dataflow_url="http://127.0.0.1:1", model_id="policy",
                              steps_per_version=2, **kwargs)
    monitor.client = FakeMonitorClient(stats, evals, completions=completion_rows)
    loggers = loggers if loggers is not None else [RecordingLogger() for _ in range(n_loggers)]
    trainer = SimpleNamespace(logger=loggers[0] if loggers else None, loggers=loggers,
                              global_rank=0, global_step=14)
    return monitor, trainer
