"""Run a function in a pool of killable worker processes, with a hard timeout per call.

Why: some reward computations (symbolic math in sympy, regexes on adversarial text) can hang on
pathological input. Their libraries' own timeouts use ``signal.alarm``, which only works in the
main thread, while the RaaS calls rewards from worker threads; and a Python thread cannot be
stopped. A process can: each call runs in a worker process, and a call that does not answer within
``timeout_s`` gets its worker SIGKILLed (and replaced on the next call), so a hang costs one
timeout and never a stuck RaaS thread or a spinning core.

Workers are plain ``python -m astralight.rewards.subprocess_pool MODULE.FUNCTION`` processes
speaking JSON lines on stdin/stdout (no pickle, no fork of the caller: started by fork+exec, safe
in a process that holds threads or an inference engine). Arguments and results must be JSON
values. Workers start lazily, at most ``workers`` at a time; the first call pays the start-up
(interpreter + imports), bounded separately by ``start_timeout_s``. A worker exits when its stdin
closes, so workers die with the pool's process.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["SubprocessPool", "PoolTimeout", "PoolError"]

#: largest reply line a worker may send (results are small JSON values)
MAX_REPLY_BYTES = 1 << 20


class PoolTimeout(TimeoutError):
    """The call did not finish within the pool's ``timeout_s``; its worker was killed."""


class PoolError(RuntimeError):
    """The function raised in the worker, or the worker died or answered garbage."""


def _import_function(path: str):
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"function: expected 'package.module.function', got {path!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"function: cannot import {path!r} ({exc})") from None
    if not callable(fn):
        raise ValueError(f"function: {path!r} is not callable")
    return fn


class _Worker:
    """One worker process and its line-buffered reply stream."""

    def __init__(self, function: str, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "astralight.rewards.subprocess_pool", function],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.buf = b""

    def send(self, obj: Any) -> None:
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        self.proc.stdin.flush()

    def readline(self, deadline: float) -> bytes | None:
        """One reply line, or None when ``deadline`` passes first. EOF raises PoolError."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise PoolError(f"worker exited (code {self.proc.poll()})")
            self.buf += chunk
            if len(self.buf) > MAX_REPLY_BYTES:
                raise PoolError(f"worker reply longer than {MAX_REPLY_BYTES} bytes")
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed child always exits
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class SubprocessPool:
    """``pool.call(*args)`` runs ``function(*args)`` in a worker process; thread-safe.

    Args:
        function: import path ``package.module.function`` of the function the workers run.
        workers: most worker processes (and so most concurrent calls; others wait for a worker).
        timeout_s: hard limit on one call once a worker has it; past it the worker is killed and
            :class:`PoolTimeout` raised.
        start_timeout_s: limit on starting one worker (interpreter + imports).
    """

    def __init__(self, function: str, workers: int = 2, timeout_s: float = 10.0,
                 start_timeout_s: float = 120.0):
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError("timeout_s/start_timeout_s: must be > 0")
        self.function = function
        self.workers = workers
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(workers)
        self._closed = False
        #: counters: calls, timeouts (workers killed), errors, started (workers started)
        self.stats = {"calls": 0, "timeouts": 0, "errors": 0, "started": 0}
        # the worker environment: our sys.path, so the function imports as it does here
        self._env = dict(os.environ)
        self._env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
        self._env.setdefault("PYTHONUNBUFFERED", "1")
        atexit.register(_close_ref, weakref.ref(self))

    def _start_worker(self) -> _Worker:
        worker = _Worker(self.function, self._env)
        try:
            line = worker.readline(time.monotonic() + self.start_timeout_s)
        except PoolError:
            worker.kill()
            raise PoolError(f"worker for {self.function!r} died while starting; see its stderr") \
                from None
        if line is None:
            worker.kill()
            raise PoolError(f"worker for {self.function!r} did not start within "
                            f"{self.start_timeout_s} s")
        reply = json.loads(line)
        if not reply.get("ready"):
            worker.kill()
            raise PoolError(f"worker for {self.function!r} failed to start: {reply.get('error')}")
        with self._lock:
            self._all.add(worker)
            self.stats["started"] += 1
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)

    def call(self, *args: Any) -> Any:
        """``function(*args)`` in a worker. Raises :class:`PoolTimeout` past ``timeout_s`` and
        :class:`PoolError` when the function raised (message included) or the worker died."""
        if self._closed:
            raise PoolError("the pool is closed")
        with self._slots:
            with self._lock:
                self.stats["calls"] += 1
                worker = self._idle.pop() if self._idle else None
            if worker is None or worker.proc.poll() is not None:
                if worker is not None:
                    self._discard(worker)
                worker = self._start_worker()
            try:
                worker.send({"args": list(args)})
                line = worker.readline(time.monotonic() + self.timeout_s)
            except (OSError, PoolError) as exc:
                self._discard(worker)
                with self._lock:
                    self.stats["errors"] += 1
                raise PoolError(f"worker for {self.function!r} failed: {exc}") from None
            if line is None:
                self._discard(worker)
                with self._lock:
                    self.stats["timeouts"] += 1
                raise PoolTimeout(f"{self.function} took longer than {self.timeout_s} s; "
                                  f"worker killed")
            with self._lock:
                if self._closed:
                    worker.kill()
                else:
                    self._idle.append(worker)
            try:
                reply = json.loads(line)
            except ValueError:
                reply = {"error": f"unreadable reply {line[:200]!r}"}
            if not isinstance(reply, dict) or "result" not in reply:
                reply = reply if isinstance(reply, dict) else {"error": f"bad reply {reply!r:.200}"}
                with self._lock:
                    self.stats["errors"] += 1
                raise PoolError(f"{self.function} raised: {reply.get('error')}")
            return reply["result"]

    def close(self) -> None:
        """Stop every worker (idle ones at once; busy ones are killed too)."""
        with self._lock:
            self._closed = True
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.kill()

    def __del__(self):  # pragma: no cover - best effort at interpreter teardown
        try:
            self.close()
        except Exception:
            pass


def _close_ref(ref) -> None:
    pool = ref()
    if pool is not None:
        pool.close()


def _worker_main(function: str) -> None:
    """The worker loop: one JSON request line in, one JSON reply line out."""
    # keep the protocol stream to ourselves: whatever the function prints goes to stderr
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    try:
        fn = _import_function(function)
    except Exception as exc:
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
        return
    out.write(b'{"ready": true}\n')
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            reply = {"result": fn(*request["args"])}
            data = json.dumps(reply).encode()
        except Exception as exc:  # report, keep serving
            data = json.dumps({"error": f"{type(exc).__name__}: {exc}"[:2000]}).encode()
        out.write(data + b"\n")


if __name__ == "__main__":
    _worker_main(sys.argv[1])
