"""Membership of a RaaS instance in the pool: register, heartbeat, rejoin, drain, hard stop.

Joining: the first registration waits for a dataflow that is not up yet, for up to
``dataflow_give_up_s``, saying "waiting for the dataflow at URL (n s)" every few seconds, and
stops waiting as soon as :attr:`stop_event` is set. It sends the workflow's name: a dataflow whose
``workflow:`` is another refuses the registration (409), which ends the RaaS with exit status 2.

The service tracks its in-flight tasks (leased, not yet pushed or returned), so nothing it holds
waits for a lease to expire when it can say so at once:

* drain (first SIGTERM / SIGINT, or the dataflow's drain route seen through the heartbeat):
  stop leasing, let the episodes in flight finish and push, deregister, exit 0;
* hard stop (a second signal, a drain still running after ``drain_timeout_s``, or a drain
  whose dataflow has been unreachable for ``DRAIN_UNREACHABLE_S``): cancel every episode,
  return every in-flight task, deregister, exit 130 at once (``HARD_STOP_EXIT``); when the
  dataflow is the reason, those calls get one attempt each (no retries): the RaaS of a run whose
  dataflow stopped exits about ``DRAIN_UNREACHABLE_S`` after its signal;
* rejoin: a heartbeat, lease or push answered 404 for this instance (a dataflow restarted,
  on its old state or a fresh one) registers again under the same instance id, once however
  many threads noticed;
* a new run: the dataflow names its run id (:mod:`astralight.dataflow.run_id`) at registration,
  in heartbeats and to the weight syncs. Another run than the one this RaaS follows (a dataflow
  restarted on a fresh ``state_dir``) is said in one line ("the dataflow's run changed (old ->
  new)"); everything of the old run is dropped: the in-flight tasks (never returned: their ids
  mean other tasks in the new run) and their samples, queued pushes, and the engines' weights
  (:meth:`WeightSync.follow_run`). The runner leases again once every engine is on the new run's
  published version, pulled in full; if the new run has published none yet (its v0 is the
  initial model, which an engine that loaded the old run's weights no longer holds) the RaaS
  exits :data:`RUN_CHANGED_EXIT`, to be started again (the launcher does) from the initial
  model. Why not wait for the new run's first version instead: its trainer needs samples of v0
  to produce it, so every RaaS waiting would stall the run;
* taken over: a heartbeat, lease or push refused with 403 ``instance_secret`` (another process
  registered this instance id with its own secret, e.g. a replacement started with the same
  ``--instance_id`` while this one was frozen) ends the RaaS at once with
  :data:`TAKEN_OVER_EXIT`, in one line, sending nothing more as that instance (no return, no
  deregistration: the id is the other process's now). Why not re-register under a new id:
  whoever started the replacement (an operator, the autoscaler) counts instances by id, and a
  silent newcomer would be one it never started; the tasks this one held come back when their
  leases expire.

Liveness is kept by a heartbeat thread, so a long generation never looks like a dead instance;
it reports how many tasks are in flight and learns from the reply when the dataflow wants the
instance drained. Everything here is thread-safe: signals, the heartbeat thread, the drain timer
and the event loop all call in.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from typing import Any

from astralight.engine import engine_limits

log = logging.getLogger("astralight.raas")

HARD_STOP_EXIT = 130
TAKEN_OVER_EXIT = 3
"""Exit code of a RaaS whose instance id another process registered (403 ``instance_secret``)."""
RUN_CHANGED_EXIT = 4
"""Exit code of a RaaS whose dataflow started a new run that has published no version yet
while its engines hold the old run's weights (a restart starts from the initial model, v0)."""
"""Exit code of a hard stop (second signal, or a drain past ``drain_timeout_s``)."""
HARD_STOP_CALLS_S = 10.0
"""How long a hard stop waits for its return and deregister calls before exiting anyway."""
GOODBYE_RETRY_S = 10.0
"""How long the last calls (return, deregister) wait for an unreachable dataflow."""
DRAIN_UNREACHABLE_S = 10.0
"""A drain whose dataflow stays unreachable this long becomes a hard stop (nothing it finishes
could be delivered; the dataflow re-issues the leases when they expire)."""


def _status(exc: BaseException) -> int | None:
    """HTTP status of a DataflowError (duck-typed, so the client module stays optional here)."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _field(exc: BaseException) -> str | None:
    return getattr(exc, "field", None)


def refused_secret(exc: BaseException) -> bool:
    """The dataflow refused this process's instance secret (403 ``instance_secret``)."""
    return _status(exc) == 403 and _field(exc) == "instance_secret"


REGISTER_RETRY_S = 2.0
"""Seconds between two registrations while our fixed instance id is still live at the dataflow."""


class Membership:
    """The membership half of :class:`astralight.raas.service.RaaSService` (a mixin).

    Uses the service's ``config``, ``client``, ``client_factory``, ``engines``, ``counters``,
    ``stop_event``, ``say``, ``maybe_progress`` and ``_exit``; calls ``_on_stop(hard)`` when a
    drain or hard stop begins (the episode runner wakes up, and on a hard stop cancels its
    episodes).
    """

    def _init_membership(self) -> None:
        self.instance_id: str | None = self.config.instance_id
        self.lease_seconds = 60.0
        self._heartbeat: threading.Thread | None = None
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
        self._drain_watch: threading.Thread | None = None
        self._drain_watch_stop = threading.Event()
        self._signal_thread: threading.Thread | None = None
        self._heartbeat_stop = threading.Event()
        self._left = False
        #: the drain watch found the dataflow gone: the goodbye makes one attempt, no retries
        self._dataflow_gone = False
        #: the dataflow run this RaaS works for (None: not known, or a dataflow naming none)
        self.run_id: str | None = None
        self._run_lock = threading.Lock()
        self._taken_over = threading.Event()

    def _on_stop(self, hard: bool = False) -> None:  # noqa: B027 - the service overrides it
        """A drain (``hard=False``) or hard stop began."""

    def _on_run_change(self) -> None:  # noqa: B027 - the service overrides it
        """The dataflow's run changed: episodes of the old run must stop."""

    def _heartbeat_stats(self) -> dict:
        """``{"stats": {...}}`` for the heartbeat: the engines' weight-update figures summed
        (the balance report shows the pause), or nothing when the engines keep none."""
        totals: dict[str, float] = {}
        for entry in self.engine_stats().values():
            for key, value in entry.items():
                if key != "weight_pause_s_last":
                    key = "weight_pause_s" if key == "weight_pause_s_total" else key
                    totals[key] = totals.get(key, 0.0) + float(value)
        return {"stats": totals} if totals else {}

    def register(self, client: Any = None) -> None:
        """Join the pool at start-up: register under this instance's id (one made up the first
        time), with its capacity, its workflow's name and its engines' limits
        (:meth:`registration_limits`), waiting up to ``dataflow_give_up_s`` for a dataflow that
        is not up yet (:meth:`_register_locked`)."""
        with self._register_lock:
            self._register_locked(client or self.client, wait=True)

    def registration_limits(self) -> dict:
        """``{model_id: {vocab_size, max_model_len}}`` of the engines serving the registered
        model_ids (:func:`astralight.engine.engine_limits`): the dataflow refuses pushed
        samples with token ids outside the vocabulary or longer than the context, with no
        config of its own."""
        out = {}
        for m in self.config.model_ids:
            engine = self.engines.get(m)
            limits = engine_limits(engine) if engine is not None else {}
            if limits:
                out[m] = limits
        return out

    def _register_locked(self, client: Any, wait: bool = False) -> None:
        """Register; while the dataflow says our fixed ``instance_id`` is still held by a live
        instance (403 ``instance_secret``: this RaaS restarted within ``lease_seconds`` and lost
        the secret with its process), wait for that registration to lapse, saying so, and try
        again. It lapses ``lease_seconds`` after the old process was last heard from.

        With ``wait`` (the first registration) an unreachable dataflow is waited for up to
        ``dataflow_give_up_s`` (the client logs "waiting for the dataflow at URL (n s)" every few
        seconds), and the wait ends at once when :attr:`stop_event` is set (raising
        ``DataflowStopped``); a rejoin keeps the client's own ``retry_s`` (the runner's
        ``dataflow_give_up_s`` counts its failures). A registration the dataflow
        refuses (409: this RaaS runs another workflow than the dataflow's ``workflow:``; 422: a
        bad field) raises ``DataflowError`` naming the key: a configuration error, not retried."""
        from astralight.dataflow.client import DataflowError

        deadline = None
        while True:
            try:
                if wait:
                    return self._register_waiting(client)
                return self._register_once(client)
            except DataflowError as exc:
                if exc.status != 403 or exc.field != "instance_secret":
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._dataflow_lease_seconds(client) + REGISTER_RETRY_S
                    self.say(f"raas: instance {self.instance_id} is still registered and live at "
                             "the dataflow (this RaaS restarted within lease_seconds); waiting "
                             "for that registration to lapse (start without --instance_id to "
                             "join at once under a new id)")
                if now >= deadline or self.stop_event.is_set():
                    raise
                time.sleep(REGISTER_RETRY_S)

    def _dataflow_lease_seconds(self, client: Any) -> float:
        """The dataflow's ``lease_seconds`` (``/v1/info``), or this side's default."""
        try:
            return float(client.info()["lease_seconds"])
        except Exception:  # noqa: BLE001 - an estimate for a wait is enough
            return float(self.lease_seconds)

    def _register_waiting(self, client: Any) -> None:
        """:meth:`_register_once` with the client retrying an unreachable dataflow for
        ``dataflow_give_up_s`` and waking on :attr:`stop_event` (both restored afterwards: later
        calls keep the client's own retry, and a drain must not cut the pushes it finishes)."""
        give_up = float(getattr(self.config, "dataflow_give_up_s", 0.0) or 0.0)
        saved = {name: getattr(client, name) for name in ("retry_s", "stop")
                 if hasattr(client, name)}
        if "retry_s" in saved and isinstance(saved["retry_s"], (int, float)):
            client.retry_s = max(saved["retry_s"], give_up)
        if "stop" in saved:
            client.stop = self.stop_event
        try:
            return self._register_once(client)
        finally:
            for name, value in saved.items():
                setattr(client, name, value)

    def workflow_name(self) -> str:
        """The name tasks must carry for this RaaS to run them (what the episode runner matches
        ``Task.workflow`` against; "" runs any task), sent at registration: the dataflow refuses
        an instance whose workflow is not its ``workflow:`` setting."""
        name = getattr(self.config.workflow, "name", "")
        return name if isinstance(name, str) else ""

    def _register_once(self, client: Any) -> None:
        meta = {"workflow": self.workflow_name(), "pid": os.getpid(),
                "versions": {m: int(e.version) for m, e in self.engines.items()
                             if m in self.config.model_ids}}  # frozen engines are not registered
        limits = self.registration_limits()
        reply = client.register(self.config.model_ids, self.config.max_concurrency,
                                instance_id=self.instance_id or f"raas-{uuid.uuid4().hex[:8]}",
                                meta=meta, capacity_units=self.config.capacity_units,
                                **({"limits": limits} if limits else {}))
        self.instance_id = reply["instance_id"]
        self.lease_seconds = float(reply.get("lease_seconds", self.lease_seconds))
        self.note_run(reply.get("run_id"), "registration")  # (before the count moves: see rejoin)
        self._registrations += 1

    # ------------------------------------------------------------------ runs

    def note_run(self, run_id: Any, where: str) -> bool:
        """The dataflow named run ``run_id`` (at ``where``); True when it is another run than
        the one this RaaS followed. Then, once however many threads see it: every weight sync
        follows the new run (before :attr:`run_id` moves, so a lease that reads the new run
        finds the engines marked stale), the in-flight tasks are dropped without being returned
        (the new run's tasks may have the same ids), the episodes are cancelled
        (:meth:`_on_run_change`) and one line says so. The first run seen is adopted."""
        if not isinstance(run_id, str) or not run_id:
            return False
        with self._run_lock:
            old = self.run_id
            if run_id == old:
                return False
            for sync in list(getattr(self, "syncs", {}).values()):
                sync.follow_run(run_id)
            self.run_id = run_id
            if old is None:
                return False
            dropped = self._drop_in_flight()
            self.counters.add(run_changes=1)
        self._on_run_change()
        stale = self.stale_engines()
        self.say(f"raas: the dataflow's run changed ({old} -> {run_id}, seen at {where}): it "
                 f"was restarted on another state_dir; dropped {dropped} in-flight task(s) and "
                 f"their samples (never pushed to the new run)"
                 + (f" and the old run's weights of {stale}; leasing again once the new run's "
                    f"published version is loaded in full" if stale else
                    "; the engines still hold the initial model (v0), leasing goes on"))
        return True

    def stale_engines(self) -> list[str]:
        """The model_ids whose engines hold weights of another run than :attr:`run_id`."""
        return [m for m, sync in getattr(self, "syncs", {}).items() if sync.engine_stale]

    def _drop_in_flight(self) -> int:
        """Forget every in-flight task without returning it; how many there were."""
        with self._in_flight_lock:
            n = len(self._in_flight)
            self._in_flight.clear()
        return n

    # ------------------------------------------------------------------ taken over

    @property
    def taken_over(self) -> bool:
        """Another process registered this instance id (see :meth:`check_taken_over`)."""
        return self._taken_over.is_set()

    def check_taken_over(self, exc: BaseException, seen: int, where: str) -> bool:
        """Whether ``exc`` (of a call made when the registration count was ``seen``) means this
        instance id was taken over; if so, stop at once (:meth:`_stop_taken_over`).

        A 403 ``instance_secret`` on a call made with the secret of the current registration
        means another process holds the id now. One made just before a registration of ours
        (a rejoin issues a new secret) is not: the count moved, and the caller just retries."""
        if not refused_secret(exc):
            return False
        with self._register_lock:  # (a registration in progress finishes first)
            if self._registrations != seen:
                return False
        self._stop_taken_over(where)
        return True

    def _stop_taken_over(self, where: str) -> None:
        """End this RaaS at once with :data:`TAKEN_OVER_EXIT`: cancel the episodes and drop what
        it holds, sending nothing more as the instance (every such call is refused, and the id
        is the other process's now); one line says so."""
        with self._state_lock:
            if self._taken_over.is_set():
                return
            self._taken_over.set()
            self._left = True  # (no goodbye: return and deregister would act on the other's id)
            self.draining = True
        self._heartbeat_stop.set()
        dropped = self._drop_in_flight()
        self.say(f"raas: instance {self.instance_id} was taken over: the dataflow refused this "
                 f"process's instance secret on {where} (another process registered the same "
                 f"instance_id); exiting {TAKEN_OVER_EXIT} at once, dropping {dropped} in-flight "
                 f"task(s) (their leases expire and are re-issued). Give each RaaS its own "
                 f"--instance_id, or none")
        self.stop_event.set()
        self._on_stop(hard=True)

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
        self.counters.add(rejoins=1)
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
            reply = client.heartbeat(self.instance_id, in_flight=self.in_flight_count(),
                                     **self._heartbeat_stats())
        except Exception as exc:  # the main loop notices a dead dataflow too
            if self.check_taken_over(exc, seen, "a heartbeat"):
                return None
            if _status(exc) == 404:  # (the heartbeat names nothing else that could be unknown)
                try:
                    self.rejoin(seen, client, why="heartbeat: the dataflow does not know us")
                except Exception as again:
                    log.warning("registering again failed: %s", again)
            else:
                log.warning("heartbeat failed: %s", exc)
            return None
        if isinstance(reply, dict):
            self.note_run(reply.get("run_id"), "a heartbeat")
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
        if not ids or self.taken_over:  # (taken over: the call would act on another's id)
            return 0
        client = client or self.client
        try:
            client.return_tasks(self.instance_id, ids, failed=failed)
        except Exception as exc:
            log.warning("could not return %d task(s) (%s): %s; their leases will expire instead",
                        len(ids), why, exc)
            return 0
        self.counters.add(tasks_returned=len(ids))
        log.info("returned %d task(s)%s: %s", len(ids), " as failed" if failed else "", why)
        return len(ids)

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
            self._signal_thread = threading.Thread(target=self._on_stop_request, args=(n, name),
                                                   daemon=True, name="raas-signal")
            self._signal_thread.start()

    def _on_stop_request(self, n: int, name: str) -> None:
        if n > 1 or self.draining:
            self.hard_stop(f"{name} during a drain")
        else:
            self.drain(name)

    def drain(self, reason: str) -> None:
        """Stop leasing; the episodes in flight finish and push, then :meth:`leave` runs.

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
        self._on_stop()
        timer = threading.Timer(self.config.drain_timeout_s, self.hard_stop,
                                args=(f"the drain outlasted drain_timeout_s="
                                      f"{self.config.drain_timeout_s:g}",))
        timer.daemon = True
        self._drain_timer = timer
        timer.start()
        self._drain_watch = threading.Thread(target=self._watch_drain, name="raas-drain-watch",
                                             daemon=True)
        self._drain_watch.start()

    def _stop_drain_threads(self) -> None:
        """End the drain timer and the drain watch, and wait for them and for the last signal's
        thread (seconds: the watch's probe has a 2 s timeout). Why: a thread still running when
        the interpreter finalizes is killed wherever it stands, and one killed inside a C++
        library aborts the process (exit -6) after a clean drain."""
        self._drain_watch_stop.set()
        for name in ("_signal_thread", "_drain_timer", "_drain_watch"):  # the first starts the rest
            thread = getattr(self, name)
            if thread is None or thread is threading.current_thread():
                continue
            if isinstance(thread, threading.Timer):
                thread.cancel()
            if thread.is_alive():
                thread.join(timeout=5)

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
            while not self._drain_watch_stop.wait(interval_s) and not self._left:
                try:
                    client.info()
                    since = None
                except DataflowUnreachable as exc:
                    since = since if since is not None else time.monotonic()
                    if time.monotonic() - since >= self.drain_unreachable_s:
                        self._dataflow_gone = True
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
            self._drain_watch_stop.set()
            self.draining = True
        self.stop_event.set()
        self._on_stop(hard=True)
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
            # the process is ending; a dataflow already unreachable for drain_unreachable_s gets
            # one attempt, not GOODBYE_RETRY_S more (a RaaS whose run stopped frees its GPU now)
            cap = 0.0 if self._dataflow_gone else GOODBYE_RETRY_S
            client.retry_s = min(client.retry_s, cap)
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

