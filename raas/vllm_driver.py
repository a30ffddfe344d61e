"""One thread that steps every in-process vLLM engine of the process: continuous batching.

vLLM's offline ``LLM`` runs a request batch to completion inside ``generate``; callers that arrive
meanwhile wait for the whole batch, which makes concurrent episodes slow. Its engine,
``LLM.llm_engine``, is a step machine instead: ``add_request`` queues a request, ``step()`` runs
one scheduler iteration (prefill and/or one decode token for every running request) and returns
what each request produced. The :class:`StepDriver` owns that machine for every engine of the
process, on one thread:

- requests submitted from any thread are added before the next step, so they join the running
  batch at once (continuous batching) and finish independently;
- everything else that touches an engine (weight loads, LoRA adapters, prefix-cache resets,
  read-backs) runs on the same thread *between two steps* (:meth:`StepDriver.call`): an update
  never lands inside a forward pass, and the requests in flight continue after it;
- several engines (a solver and a verifier policy) are stepped in turn by this one thread: two
  in-process vLLM engines must never run forward passes at the same time (they share vLLM's
  global forward context; measured: two threads generating at once crash vLLM).

Why not vLLM's ``AsyncLLM``: it always runs the engine core in a separate process; on this
project's 2-core machines that process boundary costs about 1.6x in throughput, while one
in-process driver thread keeps up with a single offline ``LLM.generate``
call (``tests/benchmarks/bench_raas_engine.py``). The engine core must be in-process for the
guarantees above (``VLLMEngine`` forces it): a multiprocess core steps on its own and queues its
outputs, so an update would no longer land between two steps. On GPUs the same path runs; an
``AsyncLLM`` backend (its busy loop overlaps scheduling with the GPU, and it stamps versions
itself with ``update_weight_version`` and ``CompletionOutput.weight_versions``) would be the
next step there.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Protocol

log = logging.getLogger(__name__)


class Steppable(Protocol):
    """What the driver needs of an engine (``VLLMEngine`` implements it)."""

    def busy(self) -> bool:
        """True while the engine has requests to step."""
        ...

    def step_once(self) -> None:
        """One engine step; deliver what it produced. Raises only for an engine-wide failure."""
        ...

    def fail_all(self, exc: BaseException) -> None:
        """Hand ``exc`` to every request in flight (after a failed step)."""
        ...


class StepDriver:
    """The process's engine-stepping thread (see the module docstring); use :func:`shared`."""

    def __init__(self, name: str = "vllm-step-driver"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._engines: list[Steppable] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.steps = 0

    # ------------------------------------------------------------------ API

    def post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the driver thread before its next step; do not wait. ``fn`` handles
        its own errors (an exception is logged and dropped)."""
        self._queue.put((fn, None))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the driver thread between two steps and return its result (blocking).

        Called from the driver thread itself (a callback that needs another call), it runs
        inline.
        """
        if threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        self._queue.put((fn, future))
        return future.result()

    def attach(self, engine: Steppable) -> None:
        self.call(lambda: self._engines.append(engine))

    def detach(self, engine: Steppable) -> None:
        self.call(lambda: self._engines.remove(engine) if engine in self._engines else None)

    @property
    def on_driver_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # ------------------------------------------------------------------ the thread

    def _do(self, item) -> None:
        fn, future = item
        if future is None:
            try:
                fn()
            except BaseException:  # noqa: BLE001 - a posted call must not kill the driver
                log.exception("engine driver: a posted call failed")
            return
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    def _run(self) -> None:
        while True:
            busy = [e for e in self._engines if e.busy()]
            if not busy:
                self._do(self._queue.get())  # idle: sleep until something arrives
            while True:  # everything submitted so far joins the next step
                try:
                    self._do(self._queue.get_nowait())
                except queue.Empty:
                    break
            for engine in [e for e in self._engines if e.busy()]:
                try:
                    engine.step_once()
                except BaseException as exc:  # noqa: BLE001 - fail its requests, keep going
                    log.exception("engine step failed; failing its requests in flight")
                    engine.fail_all(exc)
                self.steps += 1


_SHARED: StepDriver | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> StepDriver:
    """The driver of this process (started on first use)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = StepDriver()
        return _SHARED
