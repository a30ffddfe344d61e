"""The request machinery shared by the RaaS engines, over the contract in :mod:`astralight.engine`.

The contract (:class:`~astralight.engine.Engine`, :class:`~astralight.engine.SamplingSpec`,
:class:`~astralight.engine.Completion` and its helpers) is what workflows see; this module
implements its three ways in, all over one primitive, :meth:`EngineBase.submit` (thread-safe,
returns a ``concurrent.futures.Future``):

- ``await generate(ids, params)`` and ``await generate_many(prompts, params)`` for async workflows;
- ``generate_batch(prompts, params)`` (blocking) for scripts, tests and sync workflows running in
  an executor thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from astralight.engine import Completion, SamplingSpec



class EngineBase:
    """The async / many / blocking entry points over one primitive, :meth:`submit`.

    Subclasses implement ``submit(prompt_token_ids, params) -> Future[Completion]`` (thread-safe;
    the future may complete on any thread) and may implement ``cancel(future)`` to stop a
    request whose caller went away (a cancelled episode).
    """

    version: int = 0

    def submit(self, prompt_token_ids: list[int], params: SamplingSpec) -> Future:
        raise NotImplementedError(f"{type(self).__name__} must implement submit(prompt, params)")

    def cancel(self, future: Future) -> None:  # noqa: B027 - optional hook
        """Stop the request behind ``future`` (default: let it finish unobserved)."""

    async def generate(self, prompt_token_ids: list[int], params: SamplingSpec) -> Completion:
        future = self.submit(list(prompt_token_ids), params)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.cancel(future)
            raise

    async def generate_many(self, prompts: list[list[int]], params: SamplingSpec) -> list[Completion]:
        futures = [self.submit(list(p), params.for_request(i)) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except BaseException:  # cancelled, or one request failed: stop the others
            for f in futures:
                if not f.done():
                    self.cancel(f)
            raise

    def generate_batch(self, prompts: list[list[int]], params: SamplingSpec) -> list[Completion]:
        futures = [self.submit(list(p), params.for_request(i)) for i, p in enumerate(prompts)]
        return [f.result() for f in futures]


@dataclass
class _Job:
    prompt: list[int]
    params: SamplingSpec
    future: Future = field(default_factory=Future)


class BatchedEngine(EngineBase):
    """An engine whose model computes a batch at a time (transformers, test fakes).

    One worker thread takes what has been submitted, groups consecutive requests with equal,
    unseeded sampling (up to ``max_batch``) into one ``_generate(prompts, params)`` call (a
    seeded request is a call of its own, so ``_generate`` seeds its prompt ``i`` with
    ``seed + i`` as the synchronous contract did), and runs control calls
    (:meth:`call`: weight updates) between batches, never in the middle of one. Subclasses
    implement ``_generate`` (the old synchronous batch contract) and stamp nothing: every
    completion gets the version the engine had when its batch started.
    """

    max_batch: int = 64

    def _generate(self, prompts: list[list[int]], params: SamplingSpec) -> list[Completion]:
        raise NotImplementedError(f"{type(self).__name__} must implement _generate")

    def _worker_queue(self) -> "queue.SimpleQueue":
        q = self.__dict__.get("_jobs")
        if q is None:
            with _WORKER_START:
                q = self.__dict__.get("_jobs")
                if q is None:
                    q = self.__dict__["_jobs"] = queue.SimpleQueue()
                    worker = threading.Thread(target=self._work, args=(q,), daemon=True,
                                              name=f"{type(self).__name__}-worker")
                    self.__dict__["_worker"] = worker
                    worker.start()
        return q

    def submit(self, prompt_token_ids: list[int], params: SamplingSpec) -> Future:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids: empty prompt")
        job = _Job(list(prompt_token_ids), params)
        self._worker_queue().put(job)
        return job.future

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread between batches; blocking; returns its result."""
        future: Future = Future()
        self._worker_queue().put((fn, future))
        return future.result()

    def _work(self, q: "queue.SimpleQueue") -> None:
        pending: list = []
        while True:
            item = pending.pop(0) if pending else q.get()
            if item is None:
                return
            if isinstance(item, tuple):
                fn, future = item
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
                continue
            batch = [item]
            while True:  # what else is waiting now, in order: same sampling joins the batch
                try:
                    pending.append(q.get_nowait())
                except queue.Empty:
                    break
            rest = []
            for other in pending:  # a seeded request runs alone: its seed is its own
                if (isinstance(other, _Job) and other.params == item.params
                        and item.params.seed is None and len(batch) < self.max_batch
                        and not rest):
                    batch.append(other)
                else:
                    rest.append(other)
            pending = rest
            live = [j for j in batch if j.future.set_running_or_notify_cancel()]
            if not live:
                continue
            version = int(self.version)
            try:
                out = self._generate([j.prompt for j in live], item.params)
                if len(out) != len(live):
                    raise RuntimeError(f"{type(self).__name__} returned {len(out)} completions "
                                       f"for {len(live)} prompts")
            except BaseException as exc:  # noqa: BLE001 - every caller gets the error
                for j in live:
                    j.future.set_exception(exc)
                continue
            for j, c in zip(live, out):
                if c.version is None and c.versions is None:
                    c.version = version
                    c.versions = [version] * len(c.token_ids)
                j.future.set_result(c)

    def close(self) -> None:
        """Stop the worker after what was submitted before, and wait for it (up to
        ``CLOSE_JOIN_S``). Why wait: a daemon thread still inside the model when the
        interpreter finalizes is killed there, and killed inside torch it aborts the process."""
        q = self.__dict__.pop("_jobs", None)
        worker = self.__dict__.pop("_worker", None)
        if q is not None:
            q.put(None)
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=CLOSE_JOIN_S)


_WORKER_START = threading.Lock()

#: seconds :meth:`BatchedEngine.close` waits for the batch the worker is computing
CLOSE_JOIN_S = 30.0
