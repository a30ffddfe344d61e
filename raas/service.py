"""The RaaS main loop: register, lease, run the workflow, push, refresh weights, repeat.

    astralight raas serve --dataflow http://127.0.0.1:8400 --config raas.yaml
    python -m astralight.raas.service --dataflow URL --config raas.yaml

One lease cycle: apply a newer verified weight version if one is ready (the only pause in
generation), lease up to ``max_concurrency`` tasks, run them through the workflow in one batch,
push each task's samples (pushes are idempotent by task id). Liveness is kept by a heartbeat
thread so a long generation does not look like a dead instance; it reports how many tasks are
in flight and learns from the reply when the dataflow wants the instance drained.

Membership. The service tracks its in-flight tasks (leased, not yet pushed or returned), so
nothing it holds waits for a lease to expire when it can say so at once:

* drain (first SIGTERM / SIGINT, or the dataflow's drain route seen through the heartbeat):
  stop leasing, let the cycles in flight finish and push, return leased tasks not yet
  started, deregister, exit 0;
* hard stop (a second signal, a drain still running after ``drain_timeout_s``, or a drain
  whose dataflow has been unreachable for ``DRAIN_UNREACHABLE_S``): return every in-flight
  task, deregister, exit 130 at once (``HARD_STOP_EXIT``);
* a workflow exception returns the cycle's tasks as failed; tasks of another workflow are
  returned unfailed for an instance that runs it;
* rejoin: a heartbeat, lease or push answered 404 for this instance (a dataflow restarted,
  on its old state or a fresh one) registers again under the same instance id, once however
  many threads noticed; a push the dataflow answers with an unknown or never-leased task (a
  fresh state forgot it) is counted as dropped and the loop goes on.

The service decides nothing about data: which tasks exist, which samples are trained on and
what is stale belong to the dataflow.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from astralight.raas.config import RaaSConfig, build_engine, parse_config
from astralight.raas.engine import SerializedEngine
from astralight.raas.weight_sync import WeightSync

log = logging.getLogger("astralight.raas")

HARD_STOP_EXIT = 130
"""Exit code of a hard stop (second signal, or a drain past ``drain_timeout_s``)."""
HARD_STOP_CALLS_S = 10.0
"""How long a hard stop waits for its return and deregister calls before exiting anyway."""
GOODBYE_RETRY_S = 10.0
"""How long the last calls (return, deregister) wait for an unreachable dataflow."""
DRAIN_UNREACHABLE_S = 10.0
"""A drain whose dataflow stays unreachable this long becomes a hard stop (nothing it finishes
could be delivered; the dataflow re-issues the leases when they expire)."""


@dataclass
class Counters:
    """What the periodic progress line reports (cumulative since start)."""

    cycles: int = 0
    tasks_done: int = 0
    samples_pushed: int = 0
    duplicate_pushes: int = 0
    tokens_generated: int = 0
    generate_s: float = 0.0
    workflow_errors: int = 0
    push_errors: int = 0
    dataflow_errors: int = 0
    unsupported_tasks: int = 0
    empty_tasks: int = 0
    tasks_returned: int = 0
    pushes_dropped: int = 0
    rejoins: int = 0


def _status(exc: BaseException) -> int | None:
    """HTTP status of a DataflowError (duck-typed, so the client module stays optional here)."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _field(exc: BaseException) -> str | None:
    return getattr(exc, "field", None)


class RaaSService:
    """A rollout service instance. ``client_factory()`` returns a DataflowClient; ``engines``
    (``{model_id: Engine}``) may be passed in ready-made, else they are built from the config."""

    def __init__(self, config: RaaSConfig, client_factory: Callable[[], Any] | None = None,
                 engines: dict[str, Any] | None = None, out=None):
        self.config = config
        self.client_factory = client_factory or self._default_client_factory
        self.engines = engines
        self.out = out or sys.stdout
        self.counters = Counters()
        self.stop_event = threading.Event()
        self.client = None
        self.instance_id: str | None = config.instance_id
        self.lease_seconds = 60.0
        self.syncs: dict[str, WeightSync] = {}
        self._heartbeat: threading.Thread | None = None
        self._started = time.monotonic()
        self._last_progress = time.monotonic()
        self._push_pool: ThreadPoolExecutor | None = None
        self._tls = threading.local()
        self._push_clients: list = []
        self._clients_lock = threading.Lock()
        self._worker_codes: list[int] = []
        self._counters_lock = threading.Lock()
        # membership: what we hold, whether we are draining, who registers
        self._in_flight: set[str] = set()
        self._in_flight_lock = threading.Lock()
        self._state_lock = threading.RLock()  # RLock: a signal may arrive while it is held
        self._signals = 0
        self._register_lock = threading.Lock()
        self._registrations = 0  # bumped by every successful register (rejoin guard)
        self.draining = False
        self.drain_reason = ""
        self.drain_unreachable_s = DRAIN_UNREACHABLE_S
        self._hard_stop = threading.Event()
        self._hard_stop_done = threading.Event()
        self._drain_timer: threading.Timer | None = None
        self._heartbeat_stop = threading.Event()
        self._left = False
        self._ready_at: float | None = None
        self._first_push_said = False
        self._exit = os._exit  # a hard stop ends the process; tests substitute a recorder

    def _default_client_factory(self):
        from astralight.dataflow.client import DataflowClient

        return DataflowClient(self.config.dataflow, token=self.config.token)

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    # ------------------------------------------------------------------ start-up

    def start(self) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        if self.engines is None:
            self.engines = {}
            for i, mid in enumerate(cfg.model_ids):
                self.engines[mid] = build_engine(mid, cfg.engines[mid], cfg.seed + i)
        if cfg.concurrent_cycles > 1:
            self.engines = {m: e if isinstance(e, SerializedEngine) else SerializedEngine(e)
                            for m, e in self.engines.items()}
        engines_s = time.perf_counter() - t0
        self.client = self.client_factory()
        self.register()
        for mid in cfg.model_ids:
            self.syncs[mid] = WeightSync(self.client_factory, mid, self.engines[mid],
                                         check_interval_s=cfg.weight_check_interval_s,
                                         background=cfg.background_weight_sync,
                                         download_dir=cfg.weight_download_dir,
                                         stream_min_bytes=cfg.weight_stream_min_bytes).start()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="raas-heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        warm = sum(getattr(e, "warmup_s", 0.0) for e in self.engines.values())
        versions = " ".join(f"{m}=v{e.version}" for m, e in self.engines.items())
        self._ready_at = time.monotonic()
        self.say(f"raas ready instance={self.instance_id} model_ids={cfg.model_ids} {versions} "
                 f"engines_up_s={engines_s:.2f} warmup_s={warm:.2f} dataflow={cfg.dataflow}")

    def register(self, client: Any = None) -> None:
        """Register under this instance's id (one made up the first time), with its capacity."""
        with self._register_lock:
            self._register_locked(client or self.client)

    def _register_locked(self, client: Any) -> None:
        wf = self.config.workflow
        meta = {"workflow": getattr(wf, "name", type(wf).__name__), "pid": os.getpid(),
                "versions": {m: int(e.version) for m, e in self.engines.items()}}
        reply = client.register(self.config.model_ids, self.config.max_concurrency,
                                instance_id=self.instance_id or f"raas-{uuid.uuid4().hex[:8]}",
                                meta=meta, capacity_units=self.config.capacity_units)
        self.instance_id = reply["instance_id"]
        self.lease_seconds = float(reply.get("lease_seconds", self.lease_seconds))
        self._registrations += 1

    def rejoin(self, seen: int, client: Any = None, why: str = "") -> bool:
        """Register again (same instance id) after a 404 for this instance, unless another
        thread already did.

        ``seen`` is the registration count the caller read before the call that got the 404:
        if it moved since, that registration already answered the 404 and this one is skipped
        (a lease, a heartbeat and a few pushes all notice a restarted dataflow at once). One
        lock serializes registrations, so two threads never register at the same time.
        """
        with self._register_lock:
            if self._registrations != seen or self._left:  # (never undo a deregistration)
                return False
            self._register_locked(client or self.client)
        with self._counters_lock:
            self.counters.rejoins += 1
        self.say(f"raas registered again as {self.instance_id} ({why or 'unknown instance'})")
        return True

    def _heartbeat_loop(self) -> None:
        client = self.client_factory()
        try:
            while not self._heartbeat_stop.wait(self.config.heartbeat_interval_s
                                                or max(self.lease_seconds / 3.0, 0.5)):
                self.heartbeat_once(client)
        finally:
            client.close()

    def heartbeat_once(self, client: Any = None) -> dict | None:
        """One heartbeat with the in-flight count: rejoin on 404, drain if the reply says so."""
        client = client or self.client
        seen = self._registrations
        try:
            reply = client.heartbeat(self.instance_id, in_flight=self.in_flight_count())
        except Exception as exc:  # the main loop notices a dead dataflow too
            if _status(exc) == 404:  # (the heartbeat names nothing else that could be unknown)
                try:
                    self.rejoin(seen, client, why="heartbeat: the dataflow does not know us")
                except Exception as again:
                    log.warning("registering again failed: %s", again)
            else:
                log.warning("heartbeat failed: %s", exc)
            return None
        if isinstance(reply, dict):
            if reply.get("lease_seconds"):
                self.lease_seconds = float(reply["lease_seconds"])
            if reply.get("drain"):
                self.drain("the dataflow's drain route")
        return reply

    # ------------------------------------------------------------------ in-flight tasks

    def in_flight_count(self) -> int:
        with self._in_flight_lock:
            return len(self._in_flight)

    def in_flight_ids(self) -> list[str]:
        with self._in_flight_lock:
            return sorted(self._in_flight)

    def _track(self, task_ids) -> None:
        with self._in_flight_lock:
            self._in_flight.update(task_ids)

    def _untrack(self, task_ids) -> list[str]:
        """Forget ``task_ids``; returns those that were still held (not returned meanwhile)."""
        with self._in_flight_lock:
            held = [t for t in task_ids if t in self._in_flight]
            self._in_flight.difference_update(held)
        return held

    def return_tasks(self, task_ids, failed: bool = False, why: str = "",
                     client: Any = None) -> int:
        """Give tasks back to the dataflow (leasable at once); their leases need not expire.

        Best effort: if the call fails the leases expire and the dataflow re-issues them anyway.
        """
        ids = self._untrack(list(task_ids))
        if not ids:
            return 0
        client = client or self.client
        try:
            client.return_tasks(self.instance_id, ids, failed=failed)
        except Exception as exc:
            log.warning("could not return %d task(s) (%s): %s; their leases will expire instead",
                        len(ids), why, exc)
            return 0
        with self._counters_lock:
            self.counters.tasks_returned += len(ids)
        log.info("returned %d task(s)%s: %s", len(ids), " as failed" if failed else "", why)
        return len(ids)

    # ------------------------------------------------------------------ the loop

    def run_cycle(self, client: Any = None) -> int:
        """One lease cycle; returns the number of tasks whose samples were pushed.

        ``client``: the calling thread's own client when several cycles run at once.
        """
        client = client or self.client
        for sync in self.syncs.values():
            sync.refresh()
        per_cycle = max(1, self.config.max_concurrency // self.config.concurrent_cycles)
        seen = self._registrations
        try:
            tasks = client.lease(self.instance_id, per_cycle)
        except Exception as exc:
            if _status(exc) in (404, 410):  # the dataflow forgot us (restarted, expired): rejoin
                log.warning("lease refused (%s); registering again", exc)
                self.rejoin(seen, client, why="lease: the dataflow does not know us")
                return 0
            raise
        with self._counters_lock:
            self.counters.cycles += 1
            cycle = self.counters.cycles
        if not tasks:
            return 0
        ids = [t.task_id for t in tasks]
        self._track(ids)
        if self.stop_event.is_set():  # a drain began while this lease was on the wire
            self.return_tasks(ids, why="draining: leased, not started", client=client)
            return 0
        try:
            return self._run_leased(tasks, cycle, client)
        except Exception:  # e.g. a weight download or the dataflow failing mid-cycle
            self.return_tasks(ids, why="the cycle failed", client=client)  # those still held
            raise

    def _run_leased(self, tasks: list, cycle: int, client: Any) -> int:
        """Run and push the tasks one lease brought; every task leaves the in-flight set."""
        wf = self.config.workflow
        name = getattr(wf, "name", "")
        runnable = [t for t in tasks if not name or t.workflow == name]
        if len(runnable) < len(tasks):
            other = [t.task_id for t in tasks if t not in runnable]
            self.counters.unsupported_tasks += len(other)
            log.error("%d leased task(s) want a workflow other than %r; returned for an "
                      "instance that runs theirs", len(other), name)
            self.return_tasks(other, why=f"workflow is not {name!r}", client=client)
        if not runnable:
            return 0
        self._catch_up(runnable)
        start = time.perf_counter()
        try:
            results = wf.run(runnable, self.engines)
        except Exception:
            self.counters.workflow_errors += 1
            log.exception("workflow failed on %d task(s); returned to the dataflow as failed",
                          len(runnable))
            self.return_tasks([t.task_id for t in runnable], failed=True,
                              why="the workflow raised", client=client)
            return 0
        self.counters.generate_s += time.perf_counter() - start
        if self.config.cycle_delay_s > 0 and self._hard_stop.wait(self.config.cycle_delay_s):
            return 0  # a hard stop returned these tasks
        if self._hard_stop.is_set():
            return 0
        done = 0
        to_push = []
        for task in runnable:
            samples = results.get(task.task_id, [])
            if not samples:  # e.g. a prompt too long for the engine; the workflow logged why
                self.counters.empty_tasks += 1
                self._untrack([task.task_id])  # left to expire (returning it would loop on it)
                continue
            to_push.append((task, samples))
        unreachable = None
        for (task, samples), outcome in zip(to_push, self._push_all(to_push)):
            self._untrack([task.task_id])
            if isinstance(outcome, Exception):
                status = _status(outcome)
                if status in (404, 409, 410):  # unknown / never leased / gone: nothing to retry
                    with self._counters_lock:
                        self.counters.pushes_dropped += 1
                    log.warning("push of task %s dropped: %s (a dataflow restarted on a fresh "
                                "state no longer knows the task)", task.task_id, outcome)
                    continue
                self.counters.push_errors += 1
                log.error("push of task %s refused: %s", task.task_id, outcome)
                if not status:  # None/0: the dataflow is unreachable
                    unreachable = unreachable or outcome
                continue
            done += 1
            if not self._first_push_said:
                self._first_push_said = True
                since = time.monotonic() - (self._ready_at or self._started)
                self.say(f"raas first push: lease cycle {cycle}, {since:.2f}s after ready")
            self.counters.samples_pushed += int(outcome.get("accepted", len(samples)))
            self.counters.duplicate_pushes += bool(outcome.get("duplicate"))
            self.counters.tokens_generated += sum(int(s.loss_mask.sum()) for s in samples)
        self.counters.tasks_done += done
        if unreachable is not None:  # let serve() count it and back off
            raise unreachable
        return done

    def _push_all(self, items: list) -> list:
        """Push each ``(task, samples)``; return each reply or exception, in order.

        Up to ``push_concurrency`` pushes are in flight at once (each thread with its own
        client): on a link with tens of ms of round-trip time, one push per round trip would
        otherwise cost more than generating the samples. Pushes are idempotent per task, so a
        retried or reordered push is harmless.
        """
        def one(task, samples, client):
            seen = self._registrations
            try:
                return client.push(self.instance_id, task.task_id, samples)
            except Exception as exc:
                if not (_status(exc) == 404 and _field(exc) == "instance_id"):
                    return exc
            try:  # the dataflow restarted and forgot us: rejoin, then push once more
                self.rejoin(seen, client, why="push: the dataflow does not know us")
                return client.push(self.instance_id, task.task_id, samples)
            except Exception as exc:
                return exc

        workers = min(self.config.push_concurrency, len(items))
        if workers <= 1:
            return [one(task, samples, self.client) for task, samples in items]
        if self._push_pool is None:
            self._push_pool = ThreadPoolExecutor(max_workers=self.config.push_concurrency,
                                                 thread_name_prefix="raas-push")
        futures = [self._push_pool.submit(lambda t=t, s=s: one(t, s, self._thread_client()))
                   for t, s in items]
        return [f.result() for f in futures]

    def _thread_client(self):
        client = getattr(self._tls, "client", None)
        if client is None:
            client = self._tls.client = self.client_factory()
            with self._clients_lock:
                self._push_clients.append(client)
        return client

    def _catch_up(self, tasks: list) -> None:
        """Load the versions the tasks ask for before running them.

        An eval task of version v is scheduled when v is published, possibly before this RaaS
        has loaded v: load it now, so the eval measures the version it is named after. A task of
        the synchronous mode names ``min_versions``: the round's samples must come from exactly
        the version the trainers just published.
        """
        want: dict[str, int] = {}
        for t in tasks:
            if t.kind == "eval" and t.eval_version is not None and t.model_ids[0] in self.syncs:
                want[t.model_ids[0]] = max(want.get(t.model_ids[0], -1), t.eval_version)
            for mid, version in (t.min_versions or {}).items():
                if mid in self.syncs:
                    want[mid] = max(want.get(mid, -1), int(version))
        for mid, version in want.items():
            if self.engines[mid].version < version:
                self.syncs[mid].refresh(force=True)
                if self.engines[mid].version < version:
                    log.warning("tasks for %s v%d run on v%d: that version could not be loaded",
                                mid, version, self.engines[mid].version)

    def serve(self) -> int:
        """Run cycles until stopped (signal, ``max_cycles``) and return the exit code.

        With ``concurrent_cycles`` N > 1, N - 1 more threads run the same loop, each with its own
        dataflow client; a lease cycle stalled on its slowest rollout then no longer stalls the
        instance (the asynchronous answer to long-tail rollouts).
        """
        extra = [threading.Thread(target=self._serve_loop, args=(True,), daemon=True,
                                  name=f"raas-cycle-{i + 1}")
                 for i in range(self.config.concurrent_cycles - 1)]
        for t in extra:
            t.start()
        code = self._serve_loop(False)
        self.stop_event.set()
        for t in extra:
            while t.is_alive() and not self._hard_stop.is_set():
                t.join(0.2)
        if self._hard_stop.is_set():  # its own thread returns the tasks, deregisters and exits
            self._hard_stop_done.wait(HARD_STOP_CALLS_S + 1)
            self.maybe_progress(force=True)
            return HARD_STOP_EXIT
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        code = max([code] + self._worker_codes)
        if code == 0:  # (a dataflow given up on would not answer the goodbye either)
            self.leave()
        self.maybe_progress(force=True)
        return code

    def _serve_loop(self, worker: bool) -> int:
        cfg = self.config
        cycles = 0
        client = self._thread_client() if worker else None
        failing_since = None
        while not self.stop_event.is_set():
            try:
                n = self.run_cycle(client) if worker else self.run_cycle()
                failing_since = None
            except Exception as exc:
                self.counters.dataflow_errors += 1
                now = time.monotonic()
                failing_since = failing_since or now
                log.error("cycle failed: %s", exc)
                if now - failing_since > cfg.dataflow_give_up_s:
                    self.say(f"raas giving up: the dataflow has failed for "
                             f"{now - failing_since:.0f}s")
                    if worker:
                        self._worker_codes.append(1)
                    self.stop_event.set()
                    return 1
                n = 0
            cycles += 1
            if not worker:
                self.maybe_progress()
            if cfg.max_cycles is not None and cycles >= cfg.max_cycles:
                break
            if n == 0:
                self.stop_event.wait(cfg.poll_interval_s)
        return 0

    # ------------------------------------------------------------------ observation

    def progress_line(self) -> str:
        c = self.counters
        refreshes = sum(s.refreshes for s in self.syncs.values())
        pause = sum(s.pause_s_total for s in self.syncs.values())
        failures = sum(s.failures for s in self.syncs.values())
        fulls = sum(s.full_pulls for s in self.syncs.values())
        deltas = sum(s.delta_pulls for s in self.syncs.values())
        fallbacks = sum(s.full_fallbacks for s in self.syncs.values())
        tok_s = c.tokens_generated / c.generate_s if c.generate_s > 0 else 0.0
        versions = " ".join(f"{m}=v{e.version}" for m, e in (self.engines or {}).items())
        return (f"[raas {time.monotonic() - self._started:6.0f}s] cycles {c.cycles}"
                f" | tasks {c.tasks_done} | samples {c.samples_pushed} (dup {c.duplicate_pushes})"
                f" | tok/s {tok_s:.0f} | refreshes {refreshes}"
                f" (pause {pause:.2f}s, pulls full={fulls} delta={deltas}"
                f" full_fallbacks={fallbacks}) | {versions} | errors wf={c.workflow_errors}"
                f" push={c.push_errors} dataflow={c.dataflow_errors} weights={failures}"
                f" empty={c.empty_tasks} unsupported={c.unsupported_tasks}"
                f" | returned {c.tasks_returned} dropped {c.pushes_dropped} rejoins {c.rejoins}"
                f" in_flight {self.in_flight_count()}")

    def maybe_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_progress >= self.config.progress_interval_s:
            self._last_progress = now
            self.say(self.progress_line())

    # ------------------------------------------------------------------ shutdown

    def request_stop(self, signum: int | None = None, *_: Any) -> None:
        """Stop request (the SIGTERM / SIGINT handler): the first drains, a second one (or a
        signal during a drain the dataflow asked for) is a hard stop.

        From a signal the work runs on a short-lived thread: a handler interrupts the main
        thread anywhere, possibly inside a lock the work needs.
        """
        self._signals += 1
        n = self._signals
        if signum is None:
            self._on_stop_request(n, "stop request")
        else:
            name = signal.Signals(signum).name
            threading.Thread(target=self._on_stop_request, args=(n, name), daemon=True,
                             name="raas-signal").start()

    def _on_stop_request(self, n: int, name: str) -> None:
        if n > 1 or self.draining:
            self.hard_stop(f"{name} during a drain")
        else:
            self.drain(name)

    def drain(self, reason: str) -> None:
        """Stop leasing; the cycles in flight finish and push, then :meth:`leave` runs.

        Idempotent (the heartbeat repeats the dataflow's request). After ``drain_timeout_s``
        a drain that has not finished becomes a hard stop.
        """
        with self._state_lock:
            if self.draining:
                return
            self.draining, self.drain_reason = True, reason
        self.say(f"raas stopping (drain: {reason}): finishing {self.in_flight_count()} in-flight "
                 f"task(s), then returning what is left and deregistering")
        self.stop_event.set()
        timer = threading.Timer(self.config.drain_timeout_s, self.hard_stop,
                                args=(f"the drain outlasted drain_timeout_s="
                                      f"{self.config.drain_timeout_s:g}",))
        timer.daemon = True
        self._drain_timer = timer
        timer.start()
        threading.Thread(target=self._watch_drain, name="raas-drain-watch", daemon=True).start()

    def _watch_drain(self, interval_s: float = 1.0) -> None:
        """While a drain runs, probe the dataflow every ``interval_s`` (one attempt, short
        timeout); unreachable for :data:`DRAIN_UNREACHABLE_S` in a row -> hard stop.

        Why: when a whole run stops at once (its launcher killed, a node going down) the
        dataflow is gone too, and each push of a finishing task would retry it for the client's
        ``retry_s`` (60 s) in turn: the drain would hold the GPU for minutes, up to
        ``drain_timeout_s``, to deliver nothing. An error answer counts as reachable."""
        from astralight.dataflow.client import DataflowUnreachable

        client = self.client_factory()
        if not callable(getattr(client, "info", None)):
            return
        for name, cap in (("retry_s", 0.0), ("timeout", 2.0)):
            if isinstance(getattr(client, name, None), (int, float)):
                setattr(client, name, min(getattr(client, name), cap))
        since = None
        try:
            while not self._hard_stop.wait(interval_s) and not self._left:
                try:
                    client.info()
                    since = None
                except DataflowUnreachable as exc:
                    since = since if since is not None else time.monotonic()
                    if time.monotonic() - since >= self.drain_unreachable_s:
                        self.hard_stop(f"the dataflow has been unreachable for "
                                       f"{self.drain_unreachable_s:g} s during the drain ({exc})")
                        return
                except Exception:  # noqa: BLE001 - an answer, even an error: it is there
                    since = None
        finally:
            if client is not self.client and callable(getattr(client, "close", None)):
                client.close()

    def hard_stop(self, reason: str) -> None:
        """Return every in-flight task, deregister and exit ``HARD_STOP_EXIT`` now.

        The calls run on their own thread (a signal handler must not wait on locks the
        interrupted thread may hold) and are given ``HARD_STOP_CALLS_S``; then the process
        exits without waiting for generations in flight (their results are no longer ours).
        """
        with self._state_lock:
            if self._hard_stop.is_set():
                return
            self._hard_stop.set()
            self.draining = True
        self.stop_event.set()
        self.say(f"raas hard stop ({reason}): returning {self.in_flight_count()} in-flight "
                 f"task(s), deregistering, exiting {HARD_STOP_EXIT}")
        threading.Thread(target=self._hard_stop_thread, name="raas-hard-stop", daemon=True).start()

    def _hard_stop_thread(self) -> None:
        calls = threading.Thread(target=self._goodbye, args=(True,), name="raas-goodbye",
                                 daemon=True)
        calls.start()
        calls.join(HARD_STOP_CALLS_S)
        self.maybe_progress(force=True)
        self._hard_stop_done.set()
        self._exit(HARD_STOP_EXIT)

    def leave(self) -> None:
        """Leave the pool cleanly: stop heartbeats, return what is still held, deregister."""
        self._heartbeat_stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=5)
        self._goodbye()

    def _goodbye(self, own_client: bool = False) -> None:
        """Return what is still held and deregister, once. ``own_client``: on a thread of its
        own (hard stop), with a client of its own."""
        with self._state_lock:
            if self._left or self.instance_id is None or self.client is None:
                return
            self._left = True
        self._heartbeat_stop.set()
        client = self.client_factory() if own_client else self.client
        if isinstance(getattr(client, "retry_s", None), (int, float)):
            client.retry_s = min(client.retry_s, GOODBYE_RETRY_S)  # the process is ending
        try:
            held = self.in_flight_ids()
            returned = self.return_tasks(held, why="leaving the pool", client=client) if held else 0
            try:
                reply = client.deregister(self.instance_id)
            except Exception as exc:
                log.warning("deregister failed: %s (the dataflow will see the instance go quiet "
                            "and re-issue its leases when they expire)", exc)
                return
            released = reply.get("returned", 0) if isinstance(reply, dict) else 0
            self.say(f"raas left the pool: instance={self.instance_id} returned={returned}"
                     f" released_by_dataflow={released}")
        finally:
            if own_client and client is not self.client:
                client.close()

    def write_held_weights_report(self, path: str) -> dict:
        """Write what each engine holds (read back from the engine) next to what it should hold.

        JSON ``{model_id: {version, manifest_version, held: {name: sha256}, expected: {name:
        sha256}, mismatched: [names]}}``; ``expected`` are the checksums in the manifest of the
        shadow copy's version (the trainer's bf16 cast). Reading back costs about one forward
        pass per hidden size; it is meant for audits and tests, not for every refresh.
        """
        import json

        from astralight.weights.bf16 import tensor_checksum

        report = {}
        for mid, engine in (self.engines or {}).items():
            sync = self.syncs.get(mid)
            if sync is not None:
                sync.apply_ready(wait=True)  # the engine on the newest verified version
            manifest = sync.state.manifest if sync is not None else None
            if manifest is not None and manifest.version != engine.version:
                manifest = None  # not what the engine holds: nothing to compare with
            entry: dict[str, Any] = {"version": int(engine.version),
                                     "manifest_version": manifest.version if manifest else None}
            held_fn = getattr(engine, "held_weights", None)
            if held_fn is None:
                entry["error"] = f"{type(engine).__name__} cannot report its weights"
            else:
                shapes = {n: t["shape"] for n, t in manifest.tensors.items()} if manifest else None
                held = held_fn(shapes)
                entry["held"] = {n: tensor_checksum(t) for n, t in held.items()}
                if manifest is not None:
                    entry["expected"] = {n: t["sha256"] for n, t in manifest.tensors.items()}
                    entry["mismatched"] = sorted(n for n, sha in entry["expected"].items()
                                                 if entry["held"].get(n) != sha)
            if sync is not None:
                entry["sync"] = {**sync.stats(), "events": list(sync.events)}
            report[mid] = entry
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        for mid, entry in report.items():
            bad = entry.get("mismatched")
            self.say(f"raas held weights {mid} v{entry['version']}: "
                     + ("verified against the manifest" if bad == [] else
                        f"{len(bad)} tensors differ from the manifest" if bad else
                        entry.get("error", "no manifest to compare with")))
        return report

    def close(self) -> None:
        self.stop_event.set()
        self._heartbeat_stop.set()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        for sync in self.syncs.values():
            sync.close()  # stops its thread; the shadow copy stays readable
        if self.config.held_weights_report and self.engines:
            try:
                self.write_held_weights_report(self.config.held_weights_report)
            except Exception:
                log.exception("could not write held_weights_report")
        if self._push_pool is not None:
            self._push_pool.shutdown(wait=True)
            self._push_pool = None
        for client in self._push_clients:
            if client is not self.client:
                client.close()
        self._push_clients = []
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if self.client is not None:
            self.client.close()
        for engine in (self.engines or {}).values():
            engine.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``astralight raas serve``; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per heartbeat and lease
    try:
        config = parse_config(argv)
    except ValueError as exc:
        print(f"raas: bad configuration: {exc}", file=sys.stderr)
        return 2
    try:
        import torch

        if not torch.cuda.is_available():
            # measured on CPU: the in-process engine core starts in ~3 s instead of spawning one
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    except ImportError:  # pragma: no cover
        pass
    service = RaaSService(config)
    try:
        service.start()
        signal.signal(signal.SIGTERM, service.request_stop)
        signal.signal(signal.SIGINT, service.request_stop)
        code = service.serve()
        service.say(f"raas exit {code}")
        return code
    finally:
        service.close()


if __name__ == "__main__":
    sys.exit(main())
