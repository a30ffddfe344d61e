"""A workflow wrapper that adds a heavy-tailed delay to every task: the long tail of agentic rollouts.

Tool calls, retries, sandboxes and multi-turn environments make rollout latency heavy-tailed: most
tasks finish fast, a few take many times longer. A synchronous RL loop waits for the slowest task
of every batch; an asynchronous one keeps generating. ``LongTailLatency`` wraps any workflow and
holds each task back by its own delay, drawn from a capped log-normal (seeded per task id), before
the inner workflow runs it, so the same system can measure sync against async on the same workload
(``tests/benchmarks/bench_async_vs_sync.py``). The delay is an ``asyncio.sleep`` in that task's own
episode: every other task in flight keeps generating and is pushed as soon as it is done.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import numpy as np

from astralight.protocol import Sample, Task
from astralight.workflows.base import Workflow, as_episode_runner


class LongTailLatency(Workflow):
    """Args:
        inner: the workflow that does the work (its ``name`` is this workflow's name); one with
            the older synchronous ``run(tasks, engines)`` is run through
            :func:`astralight.workflows.base.as_episode_runner`.
        median_s: median delay per task, seconds.
        sigma: log-normal shape; 0 makes every delay ``median_s``; 1.5 gives a tail whose
            maximum over 32 tasks is ~20x the median.
        cap_s: no delay is longer than this.
        seed: seeds the delays (per task id, so a re-issued task gets the same delay).
        train_only: eval tasks run without delay (they measure the policy, not the system).

    ``delays_s`` lists the delay of every task run so far.
    """

    def __init__(self, inner: Workflow, median_s: float = 0.2, sigma: float = 1.5,
                 cap_s: float = 10.0, seed: int = 0, train_only: bool = True):
        try:
            self.runner = as_episode_runner(inner)
        except TypeError as exc:
            raise TypeError(f"inner: expected a workflow, got {type(inner).__name__} "
                            f"({exc})") from None
        if median_s < 0 or sigma < 0 or cap_s < 0:
            raise ValueError("median_s, sigma, cap_s: must be >= 0")
        self.inner, self.median_s, self.sigma, self.cap_s = inner, median_s, sigma, cap_s
        self.seed, self.train_only = seed, train_only
        self.name = getattr(inner, "name", "")
        self._lock = threading.Lock()
        self.delays_s: list[float] = []

    def delay_for(self, task: Task) -> float:
        """The delay of ``task`` (deterministic in the seed and the task id)."""
        if self.train_only and task.kind == "eval":
            return 0.0
        key = [self.seed] + [ord(c) for c in task.task_id[-32:]]
        z = float(np.random.default_rng(key).standard_normal())
        return min(self.cap_s, self.median_s * math.exp(self.sigma * z))

    async def run(self, task: Task, engines: dict[str, Any]) -> list[Sample]:
        """Sleep the task's delay (only this episode waits), then run it with the inner
        workflow and return its samples unchanged."""
        delay = self.delay_for(task)
        with self._lock:
            self.delays_s.append(delay)
        if delay > 0:
            await asyncio.sleep(delay)
        return await self.runner.run(task, engines)
