"""LongTailLatency: seeded heavy-tailed delays per task, capped, none for evals, results intact."""

from __future__ import annotations

import numpy as np
import pytest

from astralight.protocol import Task
from astralight.workflows import latency
from astralight.workflows.base import Workflow
from astralight.workflows.latency import LongTailLatency


class Echo(Workflow):
    name = "echo"

    def run(self, tasks, engines):
        return {t.task_id: [t.task_id] for t in tasks}


def _tasks(n, kind="train"):
    return [Task(task_id=f"{kind}:{i}", prompt="1+1=", n=1, model_ids=["p"], kind=kind)
            for i in range(n)]


def test_delays_are_seeded_per_task_capped_and_heavy_tailed():
    wf = LongTailLatency(Echo(), median_s=0.2, sigma=1.5, cap_s=10.0, seed=3)
    tasks = _tasks(2000)
    d = np.array([wf.delay_for(t) for t in tasks])
    assert d.max() <= 10.0 and d.min() > 0
    assert np.median(d) == pytest.approx(0.2, rel=0.15)
    assert d.mean() > 2 * np.median(d)  # the tail carries the mean
    assert [wf.delay_for(t) for t in tasks[:5]] == list(d[:5])  # same task, same delay
    other = LongTailLatency(Echo(), seed=4)
    assert [other.delay_for(t) for t in tasks[:5]] != list(d[:5])
    assert wf.delay_for(_tasks(1, "eval")[0]) == 0.0
    assert wf.name == "echo"


def test_run_returns_the_inner_results_after_the_slowest_delay(monkeypatch):
    slept = []
    monkeypatch.setattr(latency.time, "sleep", slept.append)
    wf = LongTailLatency(Echo(), median_s=1.0, sigma=0.0)
    tasks = _tasks(3)
    assert wf.run(tasks, {}) == {t.task_id: [t.task_id] for t in tasks}
    assert len(slept) == 1 and 0.9 < slept[0] <= 1.0
    with pytest.raises(TypeError, match="inner"):
        LongTailLatency("not a workflow")
