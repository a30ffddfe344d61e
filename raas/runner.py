"""The episode runner: every leased task is its own asyncio task, leased as slots free up.

One event loop (the service's main thread) does all of it:

- **lease**: whenever fewer than ``max_concurrency`` episodes are in flight, lease as many tasks
  as there are free slots (the dataflow may grant fewer). A lease that finds no room is a long
  poll of up to ``poll_interval_s``: the dataflow answers it as soon as room opens (a trainer's
  pull, a push, a publish), so the engine does not idle out the rest of a poll interval after
  the trainers made room;
- **episodes**: ``await workflow.run(task, engines)`` per task, so a multi-turn episode submits
  its next turn as soon as its own environment step returns and a long episode never holds a
  short one; the engine batches whatever all episodes have in flight (continuous batching);
- **pushes**: finished tasks go to a push queue; each push request carries every task that is
  ready by then (``push_many``, each task idempotent), up to ``push_concurrency`` requests in
  flight, so a far dataflow's round trip is paid per batch, not per task;
- **weights**: a refresh task loads newer verified versions into the engines while episodes run
  (the engine applies a version between two of its steps; requests in flight continue under it);
- **runs**: every leased task is tagged with the dataflow run it was leased in (read before the
  engines are checked: :meth:`~astralight.raas.membership.Membership.note_run` marks them first).
  When the run changes, episodes of the old one are cancelled, their finished samples are
  dropped and never pushed (each push names its run: a dataflow of another run refuses it), and
  no lease is taken until every engine holds the new run's published version; if the new run has
  published none, the RaaS exits ``RUN_CHANGED_EXIT`` (see :mod:`astralight.raas.membership`).

Blocking calls (the dataflow client, weight loads, environment steps inside workflows) run on the
loop's executor threads; nothing on the loop blocks. Counters are updated only on the loop or
through :meth:`Counters.add` (one lock).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from astralight.raas.membership import RUN_CHANGED_EXIT, _field, _status, refused_secret
from astralight.raas.weight_sync import EngineConfigError
from astralight.launch.supervise import EXIT_USAGE
from astralight.workflows.base import BrokenWorkflowError, TaskFailedError, as_episode_runner

log = logging.getLogger("astralight.raas")

PUSH_BATCH_TASKS = 64
"""Most tasks one push request carries."""
LEASE_GATHER_S = 0.01
"""With fewer than an eighth of the slots free, wait this long for more before leasing."""
RESYNC_RETRY_S = 1.0
"""After a run change, how long to wait between two tries to load the new run's weights."""
_NOW = object()  # "the run the service follows now" (a default argument)


class OtherRun(Exception):
    """A push outcome: the samples were generated in another run of the dataflow than the one
    this RaaS follows now; dropped, never sent."""


def _log_unexpected(task: asyncio.Task) -> None:
    """Done-callback: an episode or push task that died of something it did not handle."""
    if not task.cancelled() and task.exception() is not None:
        log.error("RaaS task %s failed unexpectedly", task.get_name(), exc_info=task.exception())


@dataclass
class Counters:
    """What the progress line reports (cumulative since start); :meth:`add` under one lock."""

    cycles: int = 0  # lease calls
    tasks_done: int = 0
    samples_pushed: int = 0
    duplicate_pushes: int = 0
    tokens_generated: int = 0
    generate_s: float = 0.0  # sum of episode wall times
    workflow_errors: int = 0
    push_errors: int = 0
    push_requests: int = 0
    dataflow_errors: int = 0
    unsupported_tasks: int = 0
    empty_tasks: int = 0
    tasks_returned: int = 0
    pushes_dropped: int = 0
    rejoins: int = 0
    run_changes: int = 0  # the dataflow's run changed (restarted on another state_dir)
    cross_run_dropped: int = 0  # finished tasks of an old run, never pushed to the new one
    episodes_cancelled: int = 0
    reissued_while_running: int = 0
    peak_in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def raise_to(self, name: str, value: float) -> None:
        """``name`` becomes ``value`` if that is larger (a peak)."""
        with self._lock:
            setattr(self, name, max(getattr(self, name), value))



class EpisodeRunner:
    """Runs the service's lease / episode / push loop on one event loop (see module docstring).

    ``service`` is the :class:`~astralight.raas.service.RaaSService`: its config, engines,
    membership (tracking, return, rejoin), weight syncs and clients.
    """

    def __init__(self, service: Any):
        self.service = service
        self.config = service.config
        self.workflow = as_episode_runner(self.config.workflow)
        self.episodes: dict[str, asyncio.Task] = {}
        self.runs: dict[str, str | None] = {}  # task_id -> the dataflow run it was leased in
        self.loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._push_queue: asyncio.Queue | None = None
        self._pushes: set[asyncio.Task] = set()
        self._failing_since: float | None = None
        self._refused: list[str] = []  # tasks whose samples the dataflow refused (4xx)
        self.leases = 0
        self.leases_granted = 0  # leases that brought at least one task
        self.exit_code = 0
        self._control: ThreadPoolExecutor | None = None
        self._push_pool: ThreadPoolExecutor | None = None
        self._weights: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ thread-safe controls

    def wake(self) -> None:
        """Wake the loop (from any thread): a stop was requested."""
        loop, wake = self.loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    def cancel_all(self) -> None:
        """Cancel every episode in flight (from any thread); their engine requests are aborted."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._cancel_all)

    def _cancel_all(self) -> None:
        for task in list(self.episodes.values()):
            task.cancel()

    def cancel_other_runs(self) -> None:
        """Cancel (from any thread) the episodes leased in another run than the service's."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._cancel_other_runs)

    def _cancel_other_runs(self) -> None:
        current = self.service.run_id
        for task_id, task in list(self.episodes.items()):
            if self.runs.get(task_id) != current:
                task.cancel()

    # ------------------------------------------------------------------ the loop

    def _setup(self) -> None:
        self.loop = asyncio.get_running_loop()
        workers = max(16, self.config.max_concurrency + self.config.push_concurrency + 4)
        self.loop.set_default_executor(ThreadPoolExecutor(max_workers=workers,
                                                          thread_name_prefix="raas-exec"))
        self._wake = asyncio.Event()
        self._push_queue = asyncio.Queue()
        if self._control is None:  # lease / return calls on the service's client, one at a time
            self._control = ThreadPoolExecutor(1, thread_name_prefix="raas-dataflow")
            # weight loads never queue behind environment steps on the default executor
            self._weights = ThreadPoolExecutor(2, thread_name_prefix="raas-weights")
            self._push_pool = ThreadPoolExecutor(self.config.push_concurrency,
                                                 thread_name_prefix="raas-push")

    async def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the control thread (the service's own dataflow client)."""
        return await self.loop.run_in_executor(self._control, functools.partial(fn, *args))

    def close(self) -> None:
        for pool in (self._control, self._push_pool, self._weights):
            if pool is not None:
                pool.shutdown(wait=True)
        self._control = self._push_pool = self._weights = None

    async def serve(self) -> int:
        """Lease and run until stopped (or ``max_cycles`` lease calls); return the exit code.

        On a drain the episodes in flight finish and push; on a hard stop they are cancelled
        (membership returns their tasks).
        """
        self._setup()
        svc, cfg = self.service, self.config
        refresher = asyncio.create_task(self._refresh_loop())
        pusher = asyncio.create_task(self._push_loop())
        try:
            while not svc.stop_event.is_set():
                run = svc.run_id  # (read before the engines' check: see Membership.note_run)
                if svc.stale_engines():  # a new run: its weights first
                    await self._resync()
                    continue
                free = cfg.max_concurrency - len(self.episodes)
                if free <= 0:
                    await self._nap(cfg.progress_interval_s)
                    svc.maybe_progress()
                    continue
                if free < max(1, cfg.max_concurrency // 8) and self.episodes:
                    # a few slots free: let more end first (short episodes end in bursts), so a
                    # lease carries several tasks instead of one round trip per task
                    await asyncio.sleep(LEASE_GATHER_S)
                    free = cfg.max_concurrency - len(self.episodes)
                asked = time.monotonic()
                granted = await self._lease(free, wait_s=cfg.poll_interval_s, run=run)
                if granted is None:  # the dataflow failed; give up or back off
                    if self.exit_code:
                        break
                    await self._nap(cfg.poll_interval_s)
                    continue
                svc.maybe_progress()
                if cfg.max_cycles is not None and self.leases >= cfg.max_cycles:
                    break
                left = cfg.poll_interval_s - (time.monotonic() - asked)
                if granted == 0 and left > 0:  # the long poll ended early (a stop, a fake)
                    await self._nap(left)
            await self._finish()
        finally:
            refresher.cancel()
            pusher.cancel()
            await asyncio.gather(refresher, pusher, return_exceptions=True)
        return self.exit_code

    async def cycle_once(self) -> int:
        """One lease, its episodes run to the end and pushed; returns the tasks pushed.
        (Tests and tools; the service runs :meth:`serve`.)"""
        if self.loop is None or self.loop is not asyncio.get_running_loop():
            self._setup()
        done_before = self.service.counters.tasks_done
        pusher = asyncio.create_task(self._push_loop())
        try:
            await self._refresh_once()
            run = self.service.run_id
            if self.service.stale_engines():
                await self._resync()
                if self.service.stale_engines():
                    return 0
            granted = await self._lease(self.config.max_concurrency, raise_errors=True, run=run)
            if granted:
                await self._finish()
        finally:
            pusher.cancel()
            await asyncio.gather(pusher, return_exceptions=True)
        return self.service.counters.tasks_done - done_before

    async def _nap(self, seconds: float | None) -> None:
        """Sleep until an episode ends, a stop is requested, or ``seconds`` pass."""
        self._wake.clear()
        if self.service.stop_event.is_set():
            return
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _finish(self) -> None:
        """Wait for the episodes in flight (a hard stop cancels them) and their pushes."""
        while self.episodes:
            await asyncio.gather(*list(self.episodes.values()), return_exceptions=True)
        await self._push_queue.join()
        while self._pushes:
            await asyncio.gather(*list(self._pushes), return_exceptions=True)

    # ------------------------------------------------------------------ leasing

    async def _lease(self, free: int, raise_errors: bool = False,
                     wait_s: float = 0.0, run: Any = _NOW) -> int | None:
        """Lease up to ``free`` tasks (``wait_s`` > 0: a long poll, see the module docstring)
        and start an episode for each runnable one, tagged with ``run`` (default: the run the
        service follows now); the number of episodes started, or None when the dataflow failed
        (counted; after ``dataflow_give_up_s`` of failures the runner gives up) or took this
        instance id over (the service stops)."""
        svc = self.service
        run = svc.run_id if run is _NOW else run
        client = svc.client
        seen = svc._registrations
        lease = functools.partial(client.lease, wait_s=wait_s) if wait_s > 0 else client.lease
        try:
            tasks = await self._call(lease, svc.instance_id, free)
        except Exception as exc:
            if refused_secret(exc):  # another process holds our id, or a rejoin raced the call
                return None if await self._call(svc.check_taken_over, exc, seen, "a lease") else 0
            if _status(exc) in (404, 410):  # the dataflow forgot us (restarted, expired): rejoin
                log.warning("lease refused (%s); registering again", exc)
                try:
                    await self._call(svc.rejoin, seen, client,
                                     "lease: the dataflow does not know us")
                except Exception as again:  # noqa: BLE001 - e.g. the dataflow still restarting
                    if raise_errors:
                        raise
                    self._dataflow_failed(again)
                    return None
                return 0
            if raise_errors:
                raise
            self._dataflow_failed(exc)
            return None
        self._failing_since = None
        self.leases += 1
        svc.counters.add(cycles=1)
        if not tasks:
            return 0
        if run != svc.run_id:  # the run changed during the call: nothing of either is started
            log.warning("dropped %d task(s) leased while the dataflow's run changed (their "
                        "leases expire)", len(tasks))
            return 0
        self.leases_granted += 1
        ids = [t.task_id for t in tasks]
        svc._track(ids)
        if svc.stop_event.is_set():  # a drain began while this lease was on the wire
            await self._call(svc.return_tasks, ids, False, "draining: leased, not started")
            return 0
        name = getattr(self.workflow, "name", "")
        other = [t.task_id for t in tasks if name and t.workflow != name]
        if other:
            svc.counters.add(unsupported_tasks=len(other))
            log.error("%d leased task(s) want a workflow other than %r; returned for an "
                      "instance that runs theirs", len(other), name)
            await self._call(svc.return_tasks, other, False, f"workflow is not {name!r}")
        started = 0
        for task in tasks:
            if task.task_id in other:
                continue
            if task.task_id in self.episodes:  # re-issued to us while its episode still runs
                svc.counters.add(reissued_while_running=1)
                continue  # (the running episode pushes it; a push is idempotent per task)
            episode = asyncio.create_task(self._episode(task, run))
            episode.add_done_callback(_log_unexpected)
            self.episodes[task.task_id] = episode
            self.runs[task.task_id] = run
            started += 1
        svc.counters.raise_to("peak_in_flight", len(self.episodes))
        return started

    def _dataflow_failed(self, exc: BaseException) -> None:
        svc, cfg = self.service, self.config
        svc.counters.add(dataflow_errors=1)
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        log.error("dataflow call failed: %s", exc)
        if now - self._failing_since > cfg.dataflow_give_up_s:
            svc.say(f"raas giving up: the dataflow has failed for "
                    f"{now - self._failing_since:.0f}s")
            self.exit_code = 1
            svc.stop_event.set()

    # ------------------------------------------------------------------ episodes

    async def _episode(self, task: Any, run: str | None = None) -> None:
        """Run one task (leased in dataflow run ``run``) and queue its samples for pushing (or
        return it); its slot stays taken until then, so ``max_concurrency`` bounds the tasks
        held, not just those generating."""
        try:
            await self._run_episode(task, run)
        except asyncio.CancelledError:
            self.service.counters.add(episodes_cancelled=1)
            raise
        finally:
            if self.episodes.get(task.task_id) is asyncio.current_task():
                del self.episodes[task.task_id]
                self.runs.pop(task.task_id, None)
            self._wake.set()

    async def _return(self, task: Any, run: str | None, failed: bool, why: str) -> None:
        """Return ``task`` unless the dataflow's run changed since it was leased (in the new
        run its id may name another task, one this instance holds)."""
        if run == self.service.run_id:
            await self._call(self.service.return_tasks, [task.task_id], failed, why)

    async def _run_episode(self, task: Any, run: str | None = None) -> None:
        svc = self.service
        start = time.perf_counter()
        try:
            await self._catch_up(task)
        except EngineConfigError as exc:  # no version will ever load: stop, naming why
            await self._return(task, run, False, "its weight version cannot be loaded")
            self._stop_on_config_error(exc)
            return
        except Exception as exc:  # not the task's fault: another instance may run it
            log.error("task %s: could not load the version it needs (%s); returned",
                      task.task_id, exc)
            await self._return(task, run, False, "its weight version could not be loaded")
            return
        try:
            samples = await self.workflow.run(task, svc.engines)
        except BrokenWorkflowError as exc:  # every episode fails alike: nothing to train on
            svc.counters.add(workflow_errors=1)
            await self._return(task, run, True, "the workflow is broken")
            self._exit_usage(f"the workflow is broken: {exc}")
            return
        except TaskFailedError as exc:  # its episodes failed: returned at once, not left to expire
            svc.counters.add(workflow_errors=1)
            log.warning("%s; returned to the dataflow as failed", exc)
            await self._return(task, run, True, "every episode failed")
            return
        except Exception:
            svc.counters.add(workflow_errors=1)
            log.exception("workflow failed on task %s; returned to the dataflow as failed",
                          task.task_id)
            await self._return(task, run, True, "the workflow raised")
            return
        svc.counters.add(generate_s=time.perf_counter() - start)
        wrong = [s for s in samples or () if s.task_id != task.task_id
                 or s.model_id not in task.model_ids]
        if wrong:
            svc.counters.add(workflow_errors=1)
            log.error("task %s: the workflow returned %d sample(s) of another task or policy "
                      "(e.g. task_id=%r model_id=%r); returned to the dataflow as failed",
                      task.task_id, len(wrong), wrong[0].task_id, wrong[0].model_id)
            await self._return(task, run, True, "samples of another task")
            return
        if not samples:  # e.g. a prompt too long for the engine; the workflow logged why
            svc.counters.add(empty_tasks=1)
            svc._untrack([task.task_id])  # left to expire (returning it would loop on it)
            return
        if self.config.cycle_delay_s > 0:
            await asyncio.sleep(self.config.cycle_delay_s)
        if svc._hard_stop.is_set() or svc.taken_over:
            return  # a hard stop returned this task; a taken-over instance sends nothing more
        if run != svc.run_id:  # made with the old run's weights: never pushed to the new run
            svc.counters.add(cross_run_dropped=1)
            return
        self._push_queue.put_nowait((task, list(samples), run))

    async def _catch_up(self, task: Any) -> None:
        """Load the version a task asks for before running it.

        An eval task of version v is scheduled when v is published, possibly before this RaaS
        has loaded v: load it now, so the eval measures the version it is named after. A task of
        the synchronous mode names ``min_versions``: its samples must come from exactly the
        version the trainers just published.
        """
        svc = self.service
        want: dict[str, int] = {}
        if task.kind == "eval" and task.eval_version is not None and task.model_ids[0] in svc.syncs:
            want[task.model_ids[0]] = int(task.eval_version)
        for mid, version in (task.min_versions or {}).items():
            if mid in svc.syncs:
                want[mid] = max(want.get(mid, -1), int(version))
        for mid, version in want.items():
            if svc.engines[mid].version < version:
                await self.loop.run_in_executor(self._weights, svc.syncs[mid].refresh, True)
                if svc.engines[mid].version < version:
                    log.warning("task %s for %s v%d runs on v%d: that version could not be "
                                "loaded", task.task_id, mid, version, svc.engines[mid].version)

    # ------------------------------------------------------------------ weights

    async def _resync(self) -> None:
        """After a run change: load the new run's published version into every engine that
        holds the old run's weights (forced checks, waiting for the loads). If the new run has
        published no version of one of them yet, exit ``RUN_CHANGED_EXIT`` (its v0 is the
        initial model, which only a restart gives back; waiting instead could stall the run:
        its trainer needs samples of v0 to publish v1); if a pull failed, try again later."""
        svc = self.service
        for mid in svc.stale_engines():
            await self.loop.run_in_executor(self._weights, svc.syncs[mid].refresh, True)
        stale = svc.stale_engines()
        if not stale:
            versions = " ".join(f"{m}=v{e.version}" for m, e in svc.engines.items())
            svc.say(f"raas resynced to the dataflow's run {svc.run_id}: {versions}")
            return
        unpublished = [m for m in stale if svc.syncs[m].new_run_unpublished]
        if unpublished:
            svc.say(f"raas exiting {RUN_CHANGED_EXIT}: the dataflow's run {svc.run_id} has "
                    f"published no version of {unpublished} yet; its v0 is the initial model, "
                    f"which these engines no longer hold (they loaded the old run's weights). "
                    f"Start this RaaS again (the launcher does) to serve v0")
            self.exit_code = RUN_CHANGED_EXIT
            svc.stop_event.set()
            return
        # the sync logged why the pull failed; the next try waits for its backoff (a forced
        # pull of a whole model every second would swamp the dataflow)
        await self._nap(max([RESYNC_RETRY_S] + [svc.syncs[m].retry_in() for m in stale]))

    def _exit_usage(self, why: str) -> None:
        """Stop the service with exit 2 (a usage or config error: the launcher shows this line
        and the log's tail, and restarts nothing), ``why`` on its own line."""
        self.service.say(f"raas exiting {EXIT_USAGE}: {why}")
        self.exit_code = EXIT_USAGE
        self.service.stop_event.set()

    def _stop_on_config_error(self, exc: EngineConfigError) -> None:
        self._exit_usage(f"a published weight version cannot be loaded by this engine as "
                         f"configured, so every rollout would go stale: {exc}")

    async def _refresh_once(self) -> None:
        for sync in self.service.syncs.values():
            await self.loop.run_in_executor(self._weights, sync.refresh)

    async def _refresh_loop(self) -> None:
        """Load verified versions while episodes run (the pause is the engine's, between two
        of its steps)."""
        interval = max(0.02, min(0.1, self.config.weight_check_interval_s))
        while True:
            try:
                await self._refresh_once()
            except EngineConfigError as exc:
                self._stop_on_config_error(exc)
                return
            except Exception as exc:  # noqa: BLE001 - the sync logged, counted and backs off
                log.debug("weight refresh failed: %s", exc)
            await asyncio.sleep(interval)

    # ------------------------------------------------------------------ pushing

    async def _push_loop(self) -> None:
        """Take what is ready, push it as one request; up to ``push_concurrency`` at once."""
        limit = asyncio.Semaphore(self.config.push_concurrency)
        while True:
            batch = [await self._push_queue.get()]
            while len(batch) < PUSH_BATCH_TASKS and not self._push_queue.empty():
                batch.append(self._push_queue.get_nowait())
            await limit.acquire()
            push = asyncio.create_task(self._push(batch, limit))
            push.add_done_callback(_log_unexpected)
            self._pushes.add(push)
            push.add_done_callback(self._pushes.discard)

    async def _push(self, batch: list, limit: asyncio.Semaphore) -> None:
        try:
            outcomes = await self.loop.run_in_executor(self._push_pool, self._push_blocking, batch)
            self._account(batch, outcomes)
            refused, self._refused = self._refused, []
            if refused:  # leased again at once elsewhere (failed: counts against this instance)
                await self._call(self.service.return_tasks, refused, True,
                                 "the dataflow refused its samples")
        except Exception:  # noqa: BLE001 - never leave a batch's tasks tracked
            log.exception("pushing %d task(s) failed", len(batch))
            self.service._untrack([task.task_id for task, _, _ in batch])
        finally:
            limit.release()
            for _ in batch:
                self._push_queue.task_done()

    def _push_blocking(self, batch: list) -> list:
        """On an executor thread, with that thread's own client: one ``push_many`` request (or,
        for a client without it, one push per task) of the tasks leased in the run the service
        follows now, naming it (the others: :class:`OtherRun`, never sent); a 404 for this
        instance rejoins and pushes those tasks once more, unless the rejoin found a new run.
        A 403 ``instance_secret`` stops the service if the id was taken over."""
        svc = self.service
        if svc.taken_over:
            return [OtherRun("this instance id was taken over")] * len(batch)
        client = svc._thread_client()
        seen = svc._registrations
        run = svc.run_id
        outcomes: list = [OtherRun(f"leased in the dataflow's run {tag}, now {run}")
                          for _, _, tag in batch]
        live = [i for i, (_, _, tag) in enumerate(batch) if tag == run]
        items = {i: (batch[i][0].task_id, batch[i][1]) for i in live}
        for i, o in zip(live, self._send(client, [items[i] for i in live], run) if live else []):
            outcomes[i] = o
        refused = [i for i in live if refused_secret(outcomes[i])]
        if refused and svc.check_taken_over(outcomes[refused[0]], seen, "a push"):
            return outcomes  # (accounted as dropped: the service is stopping)
        forgot = [i for i in live if isinstance(outcomes[i], Exception)
                  and _status(outcomes[i]) == 404 and _field(outcomes[i]) == "instance_id"]
        retry = sorted(refused + forgot)
        if retry:
            try:  # the dataflow restarted and forgot us: rejoin, then push once more
                if forgot:
                    svc.rejoin(seen, client, why="push: the dataflow does not know us")
                again = ([OtherRun(f"the dataflow's run is now {svc.run_id}")] * len(retry)
                         if svc.run_id != run else
                         self._send(client, [items[i] for i in retry], run))
            except Exception as exc:  # noqa: BLE001 - each task gets the error
                again = [exc] * len(retry)
            for i, o in zip(retry, again):
                outcomes[i] = o
        return outcomes

    def _send(self, client: Any, items: list, run: str | None = None) -> list:
        """Push ``items`` in one request (or one per task), naming dataflow run ``run``."""
        svc = self.service
        if hasattr(client, "push_run_id"):
            client.push_run_id = run  # (each push thread has its own client)
        svc.counters.add(push_requests=1)
        many = getattr(client, "push_many", None)
        if callable(many):
            try:
                return list(many(svc.instance_id, items))
            except Exception as exc:  # noqa: BLE001 - the whole request failed
                return [exc] * len(items)
        out = []
        for task_id, samples in items:
            try:
                out.append(client.push(svc.instance_id, task_id, samples))
            except Exception as exc:  # noqa: BLE001 - this task's outcome
                out.append(exc)
        return out

    def _dropped(self, task: Any, outcome: Any) -> bool:
        """Whether a push outcome is nobody's failure, only counted and logged: the instance was
        taken over (``pushes_dropped``), or the samples belong to another run of the dataflow
        (``cross_run_dropped``): never sent (:class:`OtherRun`; the run change already forgot
        the task, and its id may now be a new run's task), or refused by a dataflow of another
        run (409 ``run_id``: forgotten here)."""
        svc = self.service
        other_run = isinstance(outcome, OtherRun) or (
            _status(outcome) == 409 and _field(outcome) == "run_id")
        if not (svc.taken_over or other_run):
            return False
        if not isinstance(outcome, OtherRun):
            svc._untrack([task.task_id])
        svc.counters.add(**({"pushes_dropped": 1} if svc.taken_over else {"cross_run_dropped": 1}))
        log.info("push of task %s dropped: %s", task.task_id, outcome)
        return True

    def _account(self, batch: list, outcomes: list) -> None:
        svc = self.service
        for (task, samples, _), outcome in zip(batch, outcomes):
            if self._dropped(task, outcome):
                continue
            status = _status(outcome) if isinstance(outcome, Exception) else None
            if not (status and 400 <= status < 500 and status not in (404, 409, 410)):
                svc._untrack([task.task_id])  # (a refused task stays tracked until returned)
            if isinstance(outcome, Exception):
                if status in (404, 409, 410):  # unknown / never leased / gone: nothing to retry
                    svc.counters.add(pushes_dropped=1)
                    log.warning("push of task %s dropped: %s (a dataflow restarted on a fresh "
                                "state no longer knows the task)", task.task_id, outcome)
                    continue
                svc.counters.add(push_errors=1)
                log.error("push of task %s refused: %s", task.task_id, outcome)
                if not status:  # None/0: the dataflow is unreachable
                    self._dataflow_failed(outcome)
                elif 400 <= status < 500:  # the samples are bad: the task failed here
                    self._refused.append(task.task_id)
                continue
            self._failing_since = None
            svc.first_push_said()
            svc.counters.add(tasks_done=1,
                             samples_pushed=int(outcome.get("accepted", len(samples))),
                             duplicate_pushes=int(bool(outcome.get("duplicate"))),
                             tokens_generated=sum(int(s.loss_mask.sum()) for s in samples))
