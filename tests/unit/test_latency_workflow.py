"""LongTailLatency: seeded heavy-tailed delays per task, capped, none for evals, results intact;
each task waits only its own delay, before its inner episode runs; old-style inner workflows run
through the adapter."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

from astralight.engine import SamplingSpec
from astralight.protocol import Task
from astralight.trainer.tinymodel import build_tokenizer
from astralight.workflows import latency
from astralight.workflows.base import Workflow
from astralight.workflows.latency import LongTailLatency
from tests.unit.engine_fakes import PromptScriptEngine, run_tasks


class Echo(Workflow):
    """An episode runner whose samples are its task id; records when each task started."""

    name = "echo"

    def __init__(self, events=None):
        self.events = [] if events is None else events

    async def run(self, task, engines):
        self.events.append(("run", task.task_id))
        return [task.task_id]


class OldEcho(Workflow):
    """The older synchronous contract: a batch of tasks, blocking engine calls, a dict."""

    name = "old_echo"

    def run(self, tasks, engines):
        comps = engines["p"].generate([[5, 6, 7]] * len(tasks), SamplingSpec(max_tokens=2))
        return {t.task_id: [(t.task_id, c.finish_reason)] for t, c in zip(tasks, comps)}


def _tasks(n, kind="train"):
    return [Task(task_id=f"{kind}:{i}", prompt="1+1=", n=1, model_ids=["p"], kind=kind)
            for i in range(n)]


def _fake_sleep(monkeypatch, events, gates=None):
    """Replace the module's ``asyncio.sleep``: record ``("sleep", delay)`` and wait on
    ``gates[delay]`` (an asyncio.Event) when there is one."""
    gates = {} if gates is None else gates

    async def sleep(delay):
        events.append(("sleep", delay))
        if delay in gates:
            await gates[delay].wait()

    monkeypatch.setattr(latency, "asyncio", types.SimpleNamespace(sleep=sleep))


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


def test_run_sleeps_the_tasks_delay_then_returns_the_inner_samples(monkeypatch):
    events = []
    _fake_sleep(monkeypatch, events)
    wf = LongTailLatency(Echo(events), median_s=1.0, sigma=0.0)
    task = _tasks(1)[0]
    assert asyncio.run(wf.run(task, {})) == [task.task_id]
    assert events == [("sleep", 1.0), ("run", task.task_id)]  # the delay comes first
    assert wf.delays_s == [1.0]
    events.clear()
    ev = _tasks(1, "eval")[0]
    assert asyncio.run(wf.run(ev, {})) == [ev.task_id]
    assert events == [("run", ev.task_id)]  # no delay for evals
    with pytest.raises(TypeError, match="inner"):
        LongTailLatency("not a workflow")


def test_a_long_delay_holds_only_its_own_task(monkeypatch):
    events = []
    wf = LongTailLatency(Echo(events), median_s=0.2, sigma=1.5, cap_s=10.0, seed=3)
    tasks = _tasks(4)
    slow = max(tasks, key=wf.delay_for)
    assert len({wf.delay_for(t) for t in tasks}) == len(tasks)  # the gate holds the slow one only

    async def main():
        gate = asyncio.Event()
        _fake_sleep(monkeypatch, events, {wf.delay_for(slow): gate})
        runs = {t.task_id: asyncio.ensure_future(wf.run(t, {})) for t in tasks}
        fast = await asyncio.gather(*(runs[t.task_id] for t in tasks if t is not slow))
        slow_was_done = runs[slow.task_id].done()
        gate.set()
        return fast, slow_was_done, await runs[slow.task_id]

    fast, slow_was_done, slow_out = asyncio.run(main())
    assert not slow_was_done  # the others finished while the slow task still slept
    assert fast == [[t.task_id] for t in tasks if t is not slow]
    assert slow_out == [slow.task_id]
    assert sorted(wf.delays_s) == sorted(wf.delay_for(t) for t in tasks)


def test_an_old_style_inner_workflow_runs_through_the_adapter(monkeypatch):
    events = []
    _fake_sleep(monkeypatch, events)
    tok = build_tokenizer()
    engine = PromptScriptEngine(lambda prompt, k: "1", tok)
    wf = LongTailLatency(OldEcho(), median_s=0.5, sigma=0.0)
    assert wf.name == "old_echo" and wf.inner.name == "old_echo"
    tasks = _tasks(3)
    out = run_tasks(wf, tasks, {"p": engine})
    # each task ran alone through the synchronous inner (one request each), results its own
    assert out == {t.task_id: [(t.task_id, "stop")] for t in tasks}
    assert len(engine.requests) == 3 and events == [("sleep", 0.5)] * 3
