"""A workflow wrapper that adds a heavy-tailed delay to every task: the long tail of agentic rollouts.

Tool calls, retries, sandboxes and multi-turn environments make rollout latency heavy-tailed: most
tasks finish fast, a few take many times longer. A synchronous RL loop waits for the slowest task
of every batch; an asynchronous one keeps generating. ``LongTailLatency`` wraps any workflow and
holds each cycle's results back until the slowest of its tasks' delays has passed, with delays
drawn from a capped log-normal (seeded), so the same system can measure sync against async on the
same workload (``tests/benchmarks/bench_async_vs_sync.py``). Run it with
``RaaSConfig.concurrent_cycles`` equal to ``max_concurrency`` (one task per cycle) so every task
is pushed as soon as its own delay is over.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np

from astralight.protocol import Sample, Task
from astralight.workflows.base import Workflow


class LongTailLatency(Workflow):
    """Args:
        inner: the workflow that does the work (its ``name`` is this workflow's name).
        median_s: median delay per task, seconds.
        sigma: log-normal shape; 0 makes every delay ``median_s``; 1.5 gives a tail whose
            maximum over 32 tasks is ~20x the median.
        cap_s: no delay is longer than this.
        seed: seeds the delays (per task id, so a re-issued task gets the same delay).
        train_only: eval tasks run without delay (they measure the policy, not the system).
    """

    def __init__(self, inner: Workflow, median_s: float = 0.2, sigma: float = 1.5,
                 cap_s: float = 10.0, seed: int = 0, train_only: bool = True):
        if not isinstance(inner, Workflow):
            raise TypeError(f"inner: expected a Workflow, got {type(inner).__name__}")
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

    def run(self, tasks: list[Task], engines: dict[str, Any]) -> dict[str, list[Sample]]:
        start = time.monotonic()
        results = self.inner.run(tasks, engines)
        delays = [self.delay_for(t) for t in tasks]
        with self._lock:
            self.delays_s.extend(delays)
        wait = max(delays, default=0.0) - (time.monotonic() - start)
        if wait > 0:
            time.sleep(wait)
        return results
