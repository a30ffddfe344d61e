"""The dataflow service's state machine, independent of HTTP.

:class:`Dataflow` is the facade over the prompt sources, task leases, fresh queues, served
batches, policy versions, weight files, eval scheduling, the RaaS pool and the data algorithms
(prompt curators before rollout, sample filters after it, replay at serving, queue orders), all
kept durable in a :class:`Store` (which returns typed rows, :mod:`~astralight.dataflow.rows`).
It owns the lock, the store and the structures its parts share (the current versions, fresh
queues and replay pools: :mod:`~astralight.dataflow.parts`), and delegates each job to its
part: the pool (:mod:`~astralight.dataflow.pool`, rules in
:mod:`~astralight.dataflow.membership`), task creation and leasing
(:mod:`~astralight.dataflow.leasing`), ingest of pushes (:mod:`~astralight.dataflow.ingest`),
batch serving, acks and re-queueing (:mod:`~astralight.dataflow.batches`), versions and weight GC
and publication (:mod:`~astralight.dataflow.versions`), the plugins' durable state
(:mod:`~astralight.dataflow.plugin_state`), the counters (:mod:`~astralight.dataflow.counters`),
evals (:mod:`~astralight.dataflow.evals`) and the balance report
(:mod:`~astralight.dataflow.balance`). The data algorithms are plugins
(``astralight.dataflow.plugins``): the service only calls their hooks, counts what they decide
and persists their state. Every public method is one request: it takes the lock, does its work
in one SQLite transaction and returns plain data, raising :class:`ServiceError` (a 4xx naming
the field) for a bad request. In-memory structures (the fresh queues, the current versions)
change only after the transaction committed: inside one, code registers the change with the
store's :class:`~astralight.dataflow.transaction.Transaction`, which runs it after the commit and
drops it on a rollback. So a crash or a failed commit at any point leaves SQLite as the truth
the next start rebuilds from. The lock is a :class:`~astralight.dataflow.durability.DurableLock`:
a request returns only once its commits are on disk, and concurrent requests share fsyncs (group
commit, ``group_commit``); :meth:`Dataflow.push_many` takes many tasks' pushes in one request
and waits once for them all.
"""
from __future__ import annotations

import logging
import sqlite3
import time
from dataclasses import asdict
from pathlib import Path

from astralight.dataflow import balance, batches, demand, evals, ingest, membership
from astralight.dataflow.config import DataflowConfig, build_plugins, instantiate_plugin
from astralight.dataflow.counters import COUNTERS, check_counter
from astralight.dataflow.durability import DurableLock
from astralight.dataflow.errors import ServiceError, StateDirError
from astralight.dataflow.leasing import TaskLeasing
from astralight.dataflow.parts import Shared
from astralight.dataflow.plugin_state import PluginState
from astralight.dataflow.plugins import DataPlugin
from astralight.dataflow.pool import Pool
from astralight.dataflow.queues import FreshQueue
from astralight.dataflow.replay import ReplayPool
from astralight.dataflow.run_id import open_run_id
from astralight.dataflow.storage_faults import opening_error
from astralight.dataflow.store import Store
from astralight.dataflow.versions import Publisher, WeightIndex
from astralight.dataflow.weightfiles import WeightFiles
from astralight.protocol import SCHEMA_VERSION, Batch, Sample, Task, WeightManifest, decode
from astralight.tasks.base import PromptSource

log = logging.getLogger("astralight.dataflow")

MAX_LEASE_TASKS = 4096


class Dataflow:
    """All service state behind one lock; see the module docstring."""

    def __init__(self, config: DataflowConfig):
        try:
            self._open(config)
        except (ServiceError, sqlite3.Error) as exc:  # the state failed while opening
            if isinstance(exc, ServiceError) and exc.status != 507:
                raise
            store = getattr(self, "store", None)
            if store is not None:
                store.conn.close()
                store.counter.close()
            if isinstance(exc, ServiceError):  # a write refused: full or unwritable (507)
                raise StateDirError(f"{exc.field}: the dataflow cannot start: {exc.message}"
                                    ) from None
            db = Path(config.state_dir) / "dataflow.db"
            raise opening_error(db.parent, db, exc) from None

    def _open(self, config: DataflowConfig) -> None:
        """Open the state and build every part on it (a :class:`StateDirError` -- one line naming
        ``state_dir`` -- for a state it must not serve: :mod:`astralight.dataflow.store`)."""
        self.config = config
        self.state_dir = Path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.source: PromptSource = instantiate_plugin(config.source, PromptSource, "source")
        if len(self.source) < 1:
            raise ValueError("source: the prompt source is empty")
        self.eval_source: PromptSource | None = None
        self.eval_prompts = 0
        if config.eval.source is not None:
            self.eval_source = instantiate_plugin(config.eval.source, PromptSource, "eval.source")
            self.eval_prompts = evals.check_source(self.eval_source)
        self.store = Store(self.state_dir / "dataflow.db", group_commit=config.group_commit,
                           integrity_check_s=config.integrity_check_s,
                           allow_lost_commits=config.allow_lost_commits)
        #: every request holds it; its outermost release waits until the commits are durable
        self.lock = DurableLock(self.store.durability)
        self.opened_at = time.time()  # batch ack timeouts count from here at the earliest
        self.weights = WeightFiles(self.state_dir / "weights")
        self.model_ids = list(config.model_ids)
        stored = self.store.latest_versions()
        self.versions = {m: stored.get(m, 0) for m in self.model_ids}
        self.primary = self.model_ids[0]
        self.plugins = build_plugins(config)
        self.curators = self.plugins["curators"]
        self.sample_filters = self.plugins["sample_filters"]
        self.replay_selectors = self.plugins["replay.selectors"]
        self.queues = {m: FreshQueue(self.plugins["queue_order"][m], config.max_staleness)
                       for m in self.model_ids}
        self.replay_pools = {m: ReplayPool(config.replay.pool_size, config.replay.max_staleness,
                                           config.replay.max_uses) for m in self.model_ids}
        shared = Shared(self.store, config, self.versions, self.queues, self.replay_pools,
                        self._bump)
        #: the RaaS instances: registered limits, reported stats, lease allowances
        self.pool = Pool(shared)
        #: eval scheduling and recording, with a few completions per evaluated version
        self.evals = evals.EvalScheduler(shared, self.eval_source)
        self.eval_completion_log = self.evals.completions
        #: per policy, the results of complete eval runs (fixed once complete), so polling
        #: :meth:`eval_results` does not re-read every report of the run under the lock
        self._complete_evals: dict[str, dict[int, dict]] = {}
        #: largest batch each policy's trainers pulled since start: the demand cap's floor
        self.largest_pull: dict[str, int] = dict.fromkeys(self.model_ids, 0)
        #: the plugins' generators, snapshots and curator journal
        self.plugin_state = PluginState(self.store, self.plugins, config.seed,
                                        config.plugin_state_every_s)
        self.plugin_state.load()
        #: creates train tasks and leases stored ones
        self.leasing = TaskLeasing(shared, self.source, self.plugin_state, self.largest_pull)
        #: serves, acks and re-queues batches (from the queues and pools it restores now)
        self.serving = batches.BatchServing(shared, self.replay_selectors, self.largest_pull)
        self.serving.restore()
        #: records pushes
        self.ingest = ingest.Ingest(shared, self.pool, self.leasing, self.evals,
                                    self.sample_filters)
        # (version, kind, published_at) of every stored version: what weight GC decides on
        self.index = WeightIndex(
            {m: [(r.version, r.manifest().kind, r.published_at)
                 for r in self.store.version_rows(m)] for m in self.model_ids},
            config.weights_keep_s)
        self.weight_index = self.index.entries
        #: publishes versions (their evals, what they make stale) and collects old weights
        self.publisher = Publisher(shared, self.weights, self.index, self.evals,
                                   self.plugin_state, self.serving)
        self.weights.purge_trash()
        stale_tmp = self.weights.purge_temp()  # uploads a crash interrupted: none is in flight now
        if stale_tmp:
            log.info("removed %d temporary file(s) of interrupted weight uploads", stale_tmp)
        self.gc_weights()
        # version 0's "publication": when this state folder first served (balance wall time)
        started_at = self.store.get_meta("started_at")
        with self.store.tx() as tx:
            if started_at is None:
                started_at = self.store.first_activity() or time.time()
                self.store.set_meta("started_at", started_at)
            tx.after_commit(setattr, self, "started_at", started_at)
            #: this state's run (kept across restarts on it; a fresh state_dir gets a new one)
            tx.after_commit(setattr, self, "run_id", open_run_id(self.store))
            for m in self.model_ids:  # version 0 at a fresh start; any version a crash left unscheduled
                self.evals.maybe_schedule(m, self.versions[m], time.time())
        self.store.durability.wait()  # what opening wrote is on disk before the first answer
        log.info("dataflow state in %s (run %s): versions %s, queued %s, open train tasks %d",
                 self.state_dir, self.run_id, self.versions,
                 {m: len(q) for m, q in self.queues.items()}, self.open_train)

    # ------------------------------------------------------------------ data plugins

    def named_plugins(self) -> dict[str, DataPlugin]:
        """Every data plugin by its place in the config (``curators[0]``, ``queue_order.policy[0]``)."""
        return self.plugin_state.named()

    @property
    def open_train(self) -> int:
        """Train tasks created and not done yet (:attr:`TaskLeasing.open_train`)."""
        return self.leasing.open_train

    def close(self) -> None:
        with self.lock:
            try:
                with self.store.tx() as tx:
                    self.plugin_state.save(tx, time.time())
            except Exception as exc:  # never lose the database close over a plugin's state
                if getattr(exc, "logged", False):  # a full state_dir: its line says why
                    log.error("could not save the data plugins' state at shutdown: %s", exc)
                else:
                    log.exception("could not save the data plugins' state at shutdown")
            self.store.close()

    # ------------------------------------------------------------------ helpers

    def _bump(self, model_id: str, name: str, k: int = 1) -> None:
        """Count an event for ``model_id`` in total and at its current version; ``name`` must be
        a declared counter (:func:`check_counter`: a typo raises instead of starting a new one)."""
        self.store.bump(model_id, check_counter(name), k, self.versions[model_id])

    def _model(self, model_id, field: str = "model_id") -> str:
        if model_id not in self.queues:
            raise ServiceError(404, field, f"unknown model_id {model_id!r}; this service serves "
                                           f"{self.model_ids}")
        return model_id

    # ------------------------------------------------------------------ info

    def info(self) -> dict:
        cfg = self.config
        return {"service": "astralight-dataflow", "schema": SCHEMA_VERSION,
                "run_id": self.run_id, "model_ids": self.model_ids,
                "versions": dict(self.versions),
                "workflow": cfg.workflow, "group_size": cfg.group_size,
                "lease_seconds": cfg.lease_seconds, "suspect_failures": cfg.suspect_failures,
                "slow_factor": cfg.slow_factor, "max_staleness": cfg.max_staleness,
                "queue_order": cfg.queue_order, "max_buffered_samples": cfg.max_buffered_samples,
                "data_plugins": {name: type(p).__name__ for name, p in self.named_plugins().items()},
                "replay": {"ratio": cfg.replay.ratio, "max_staleness": cfg.replay.max_staleness,
                           "pool_size": cfg.replay.pool_size, "max_uses": cfg.replay.max_uses},
                "batch_ack_timeout_s": cfg.batch_ack_timeout_s,
                "max_body_bytes": cfg.max_body_bytes,
                "max_weight_file_bytes": cfg.max_weight_file_bytes,
                "max_version_jump": cfg.max_version_jump,
                "temperatures": dict(cfg.temperatures),
                "limits": {m: self.pool.limits(m) for m in self.model_ids},
                "eval": {"enabled": self.eval_source is not None, "every": cfg.eval.every,
                         "k": cfg.eval.k, "n": cfg.eval.samples(),
                         "pass_k": cfg.eval.pass_ks(), "n_prompts": self.eval_prompts}}

    # ------------------------------------------------------------------ RaaS side

    def register(self, model_ids: list[str], capacity: int, instance_id: str | None,
                 meta: dict, capacity_units: float = 1.0, now: float | None = None,
                 limits: dict | None = None) -> dict:
        """Add an instance to the pool, or make a known one ``active`` again keeping its
        counters (:meth:`Pool.register`: the checks of ``capacity``, ``capacity_units`` and the
        engines' ``limits``)."""
        if not model_ids:
            raise ServiceError(422, "model_ids", "must list the model_ids this instance serves")
        for m in model_ids:
            self._model(m, "model_ids")
        now = time.time() if now is None else now
        with self.lock:
            instance_id = self.pool.register(list(model_ids), capacity, instance_id, meta,
                                             capacity_units, now, limits)
        return {"instance_id": instance_id, "lease_seconds": self.config.lease_seconds,
                "versions": dict(self.versions), "run_id": self.run_id}

    def heartbeat(self, instance_id: str, in_flight: int | None = None,
                  now: float | None = None, stats: dict | None = None) -> dict:
        """Renew an instance; ``drain`` in the reply tells a draining (or deregistered) one to
        finish or return its tasks and deregister. ``stats``: the instance's own cumulative
        figures (its engines' weight-update pause), kept in memory for the instance table and
        the balance report (an observation, not state: a restart forgets it until the next
        heartbeat)."""
        with self.lock:
            state = self.pool.heartbeat(instance_id, in_flight,
                                        time.time() if now is None else now, stats)
            return {"instance_id": instance_id, "lease_seconds": self.config.lease_seconds,
                    "versions": dict(self.versions), "run_id": self.run_id,
                    "drain": state in (membership.DRAINING, membership.LEFT)}

    def drain(self, instance_id: str, now: float | None = None) -> dict:
        """Stop giving ``instance_id`` tasks; its heartbeat replies ``drain=True`` so it finishes
        or returns what it holds and deregisters. A deregistered instance stays ``left``."""
        now = time.time() if now is None else now
        with self.lock:
            return self.pool.drain(instance_id, now)

    def return_tasks(self, instance_id: str, task_ids: list[str], failed: bool = False,
                     now: float | None = None) -> dict:
        """Hand back tasks ``instance_id`` leased and did not push: leasable again at once.
        ``failed``: the instance could not run them (counted against its health); otherwise it
        just will not (draining, unsupported workflow). Other task ids are ignored."""
        now = time.time() if now is None else now
        with self.lock:
            n = self.pool.hand_back(instance_id, task_ids, now, failed=failed)
        if n:
            log.info("instance %s returned %d task(s)%s", instance_id, n,
                     " as failed" if failed else "")
        return {"returned": n}

    def deregister(self, instance_id: str, now: float | None = None) -> dict:
        """Leave the pool: still-leased tasks become leasable at once, the state ``left``. A later
        register makes the instance active again."""
        now = time.time() if now is None else now
        with self.lock:
            n = self.pool.hand_back(instance_id, None, now, leave=True)
        log.info("instance %s deregistered (%d task(s) returned)", instance_id, n)
        return {"returned": n}

    def lease(self, instance_id: str, max_tasks: int, now: float | None = None) -> list[Task]:
        """Lease up to ``max_tasks``: returned, expired or pending eval tasks, then train tasks,
        then new ones (:meth:`TaskLeasing.lease`).

        The instance gets at most its allowance (:func:`membership.lease_allowance`: free
        capacity, nothing while draining, a probe while failing, fewer when slow). A task whose
        lease expired is handed out again (once per expiry: the new lease has a new deadline),
        and the expiry counts as a failure of the instance that held it; new train tasks are
        drawn from the source only while fewer than ``max_inflight_tasks`` are open and some
        policy's queue plus what the open tasks will deliver stays under
        ``max_buffered_samples`` and under its demand cap (:meth:`lease_demand`: what its
        trainers consume before those samples would go stale).
        """
        if not 0 <= max_tasks <= MAX_LEASE_TASKS:
            raise ServiceError(422, "max_tasks", f"must be in [0, {MAX_LEASE_TASKS}]")
        with self.lock:
            inst = self.pool.instance(instance_id)
            now = time.time() if now is None else now
            return self.leasing.lease(inst, self.pool.allowance(inst, max_tasks, now), now)

    def lease_demand(self) -> dict[str, demand.Demand]:
        """Per policy, what its trainers consume and the most outstanding samples worth
        generating for it (:meth:`TaskLeasing.demands`). Call with the lock held."""
        return self.leasing.demands()

    def check_run(self, run_id: str | None, field: str = "run_id") -> None:
        """Refuse (409 naming ``field``) what was made for another run than this state's:
        samples generated with the weights of the run a restart on a fresh ``state_dir``
        replaced (their versions would be taken for this run's). None: the caller did not say."""
        if run_id is not None and run_id != self.run_id:
            raise ServiceError(409, field, (
                f"made for dataflow run {run_id!r}, but this dataflow runs {self.run_id!r} (it "
                f"was restarted on another state_dir): samples generated with the other run's "
                f"weights are refused; drop them and resync the weights from this run"))

    def push(self, instance_id: str, task_id: str, samples: list[Sample],
             now: float | None = None) -> dict:
        """Accept a task's samples once; later pushes of the same task are ignored (duplicate).
        See :meth:`Ingest.push`."""
        with self.lock:
            return self.ingest.push(instance_id, task_id, samples,
                                    time.time() if now is None else now)

    def push_many(self, instance_id: str, items: list[tuple[str, list[Sample]]],
                  now: float | None = None) -> list[dict | ServiceError]:
        """Several tasks' pushes from one request: each item exactly as :meth:`push` of it alone
        (idempotent per task, a later item of an already accepted task is a duplicate), its
        reply or the :class:`ServiceError` push would raise, in order. One bad item does not
        stop the others. Each item is its own transaction (the lock is released in between,
        so pulls and leases are not held up by a big batch); the request waits once, at the
        end, until all of them are durable."""
        out: list[dict | ServiceError] = []
        with self.lock.deferred():
            for task_id, samples in items:
                try:
                    out.append(self.push(instance_id, task_id, samples, now=now))
                except ServiceError as exc:
                    out.append(exc)
        return out

    # ------------------------------------------------------------------ trainer side

    def check_pull(self, model_id: str, size: int) -> None:
        self._model(model_id)
        if not 1 <= size <= self.config.max_buffered_samples:
            raise ServiceError(422, "size", f"must be in [1, max_buffered_samples="
                                            f"{self.config.max_buffered_samples}]; raise "
                                            "max_buffered_samples to pull bigger batches")

    def pull(self, model_id: str, size: int, trainer_id: str | None = None) -> Batch | None:
        """Serve exactly ``size`` samples as a recorded batch, or None (stale ones dropped).

        With replay on, ``floor(size * replay.ratio)`` of them come from the replay pool (as many
        as it holds that are fresh enough), the rest from the fresh queue; the batch is formed
        only when the fresh queue can fill its share.
        """
        self.check_pull(model_id, size)
        with self.lock:
            return self.serving.pull(model_id, size, trainer_id)

    def ack(self, batch_id: str, wait_s: float | None = None, step_s: float | None = None,
            step: int | None = None) -> dict:
        """Mark a batch trained. ``wait_s`` / ``step_s``: the trainer's wait for this batch and
        its whole step, counted (in ms) at the current version for the balance report.
        ``step``: the trainer's optimizer step count after this batch (kept, so that a trainer
        resuming from an older checkpoint can say which acks its restart undid:
        :meth:`trainer_resumed`).

        A **late ack** (the batch was re-queued: neither acked nor extended within
        ``batch_ack_timeout_s``, which with the datamodule's keep-alive means the trainer was
        frozen, e.g. SIGSTOPped or swapped out, longer than that) is still accepted: the trainer
        did train the batch. Its samples still waiting in the queue are taken back (acked here,
        never served again). Those already served again in another batch cannot be un-trained:
        they are counted (``late_acks_after_reserve``, ``samples_trained_twice``: the audit's
        ``duplicates_trained`` must equal the latter), logged, and the answer says so
        (``trained_twice``, ``warning``) for the trainer to log.
        """
        with self.lock:
            return self.serving.ack(batch_id, wait_s, step_s, step)

    def trainer_resumed(self, model_id: str, step: int, now: float | None = None) -> dict:
        """A trainer of ``model_id`` restarted from a checkpoint taken after optimizer step
        ``step``: the batches it acked after that step were trained into weights the crash
        discarded. They stay acked (nothing is re-served: the versions published from them were
        generated with and may be in use, so training them again would count them twice in the
        run's history), and are marked rolled back and counted (``batches_rolled_back``,
        ``samples_rolled_back``: fresh and replayed samples), so the audit can say how much
        training a restart cost instead of calling it trained. Acks carrying no step (older
        trainers) are never marked. Idempotent: a batch is marked once.
        """
        mid = self._model(model_id, "model_id")
        now = time.time() if now is None else now
        with self.lock:
            return self.serving.trainer_resumed(mid, step, now)

    def extend_batch(self, batch_id: str, now: float | None = None) -> dict:
        """Keep-alive of a served batch: its ack timeout counts again from ``now`` (durable).

        A trainer extends every batch it holds, pulled and not yet acked, every
        ``batch_ack_timeout_s / 3`` (the datamodule does, from a timer thread), so a live
        trainer whose step outlasts the timeout keeps its batch; only a dead or frozen one loses
        it. 404 for an unknown batch; 409 for one already acked or already re-queued (the
        trainer should stop extending it: re-queued samples may be served again).
        """
        now = time.time() if now is None else now
        with self.lock:
            return self.serving.extend(batch_id, now)

    def requeue_expired_batches(self, now: float | None = None) -> set[str]:
        """Put the samples of batches not acked within ``batch_ack_timeout_s`` back in their
        queues (at their original place in the order). Returns the model_ids that got samples.

        The timeout counts from when the service could last take the ack: a batch served before
        a restart gets a whole ``batch_ack_timeout_s`` after the restart, so a trainer that kept
        training it while the service was down can still ack it instead of the samples being
        served (and trained) a second time. A keep-alive (:meth:`extend_batch`) restarts it too.
        """
        now = time.time() if now is None else now
        if now - self.opened_at < self.config.batch_ack_timeout_s:
            return set()  # nothing can have expired since the service (re)started
        with self.lock:
            return self.serving.requeue_expired(now)

    # ------------------------------------------------------------------ versions and weights

    def current_version(self, model_id: str) -> int:
        return self.versions[self._model(model_id)]

    def check_upload(self, model_id: str, version: int, name: str) -> None:
        """An upload of ``name`` for ``version`` may go ahead (:meth:`Publisher.check_upload`:
        a plain file name, a version newer than the current one and within
        ``max_version_jump`` of it)."""
        self._model(model_id)
        self.publisher.check_upload(model_id, version, name)

    def commit_upload(self, tmp: Path, model_id: str, version: int, name: str, sha256: str) -> None:
        """Move an uploaded file into place unless its version got published meanwhile."""
        self.weights.fsync(tmp)  # outside the lock: may take seconds for a big file
        with self.lock:
            try:
                self.check_upload(model_id, version, name)
            except ServiceError:
                self.weights.discard(tmp)
                raise
            self.weights.commit(tmp, model_id, version, name, sha256)

    def publish(self, manifest: WeightManifest) -> dict:
        """Record version N of a policy after checking its files; versions only move forward,
        by at most ``max_version_jump`` at a time (:meth:`Publisher.publish`)."""
        mid = self._model(manifest.model_id, "manifest.model_id")
        with self.lock:
            n_evals, trash = self.publisher.publish(manifest)
        self.weights.purge(trash)  # outside the lock: deleting big files takes a while
        return {"model_id": mid, "version": manifest.version, "evals_scheduled": n_evals}

    # ------------------------------------------------------------------ weight GC

    def gc_due(self, now: float | None = None) -> bool:
        """Cheap check for the service's sweeper: would :meth:`gc_weights` remove something?"""
        return self.config.weights_gc and (time.time() if now is None else now) >= self.index.next_due

    def gc_weights(self, now: float | None = None) -> dict[str, list[int]]:
        """Collect old weight versions now (see ``DataflowConfig.weights_gc``); returns the
        removed published versions per model_id."""
        now = time.time() if now is None else now
        with self.lock:
            before = {m: [e[0] for e in self.weight_index[m]] for m in self.model_ids}
            trash = self.publisher.collect(now)
            after = {m: {e[0] for e in self.weight_index[m]} for m in self.model_ids}
        self.weights.purge(trash)
        return {m: [v for v in before[m] if v not in after[m]] for m in self.model_ids}

    def manifest(self, model_id: str, version: int | None = None) -> WeightManifest | None:
        """The manifest of ``version`` (default: the latest); None if never published; 404
        naming the kept chain if it was garbage-collected."""
        self._model(model_id)
        with self.lock:
            blob = self.store.manifest_blob(model_id, version)
            if blob is None and version is not None:
                self.index.check_not_collected(model_id, version)
        return decode(blob) if blob is not None else None

    def weight_file(self, model_id: str, version: int, name: str) -> tuple[Path, dict]:
        """Path and manifest entry of a file of a published version (404 otherwise)."""
        manifest = self.manifest(model_id, version)
        if manifest is None:
            raise ServiceError(404, "version", f"version {version} of {model_id!r} is not published")
        if name not in manifest.files:
            raise ServiceError(404, "name", f"{name!r} is not a file of {model_id!r} version {version}")
        return self.weights.path(model_id, version, name), manifest.files[name]

    # ------------------------------------------------------------------ observation

    def version_counters(self, model_id: str, since: int = 0) -> dict[int, dict[str, int]]:
        """Counters of ``model_id`` per policy version: what happened while version v was current
        (the rollouts it cost to train version v+1, the prompts skipped, the samples replayed)."""
        self._model(model_id)
        with self.lock:
            return self.store.version_counters(model_id, since)

    def balance(self, model_id: str, window: int = 10, pool: int | None = None,
                now: float | None = None, last: int | None = None) -> dict:
        """The balance report over the last ``window`` completed versions of ``model_id``
        (:mod:`astralight.dataflow.balance`) with the instance table. ``pool`` (G) defaults to
        the live instances (not gone or left), whose capacity units normalise the throughput;
        the wall time runs from the publication of the window's first version (version 0: when
        the state folder first served) to that of the next version after it, or now.

        ``last`` ends the window at that version instead (at most the current one, whose window
        is still open): a reader that asks for ``last=L`` and then ``last=L+window`` gets
        windows that neither skip nor repeat a version, however late it asks (the launcher's
        ``balance.jsonl``)."""
        self._model(model_id)
        if window < 1:
            raise ServiceError(422, "window", f"must be >= 1 versions, got {window}")
        if pool is not None and pool < 0:
            raise ServiceError(422, "pool", f"must be >= 0 instances, got {pool}")
        with self.lock:
            current = self.versions[model_id]
            if last is not None and not 0 <= last <= current:
                raise ServiceError(422, "last", f"must be a version in 0..{current} (the current "
                                                f"version of {model_id!r}), got {last}")
            last = max(current - 1, 0) if last is None else last
            first = max(last - window + 1, 0)
            now = time.time() if now is None else now
            table = self.pool.table(now)
            counters = self.store.version_counters(model_id, since=first)
            times = self.store.version_times(model_id)
        return balance.pool_report(counters, first, last, table, pool,
                                   balance.window_wall_s(times, first, last, self.started_at, now),
                                   model_id=model_id, current_version=current)

    def request_eval(self, model_id: str, version: int, now: float | None = None) -> dict:
        """Evaluate ``version`` of ``model_id`` whatever ``eval.every`` says, once (a version
        already evaluated or scheduled is left as it is: ``evals_scheduled`` 0).

        Why: a run that stops at a version that is not a multiple of ``eval.every`` (a time
        budget, a target accuracy, a trainer's own ``max_time``, ``stop.versions`` chosen freely)
        would otherwise end without an evaluation of its last version. The launcher asks for
        it when the run stops, the trainer's DataflowMonitor at the end of fit.

        Only the current version can be newly scheduled: eval tasks are generated with the
        weights the RaaS hold, which are the current version's, so an older version's eval
        would be mislabelled (409); a version not published yet is a 409 too (ask again once it
        is). A service without ``eval.source`` answers 409.
        """
        mid = self._model(model_id)
        with self.lock:
            return self.evals.request(mid, version, time.time() if now is None else now)

    def eval_completions(self, model_id: str, version: int, limit: int | None = None) -> list[dict]:
        """Sample completions of the eval of ``(model_id, version)`` (at most ``limit``; see
        :class:`astralight.dataflow.evals.CompletionLog`); empty when none were kept."""
        self._model(model_id)
        with self.lock:
            return self.eval_completion_log.get(model_id, version, limit)

    def eval_results(self, model_id: str) -> dict[int, dict]:
        self._model(model_id)
        with self.lock:
            return evals.aggregate(self.store, model_id,
                                   benchmarks=evals.benchmark_map(self.eval_source),
                                   complete=self._complete_evals.setdefault(model_id, {}))

    def stats(self, now: float | None = None) -> dict:
        with self.lock:
            counters = self.store.counters()
            outstanding = self.store.outstanding_batches()
            now = time.time() if now is None else now
            models = {}
            for m in self.model_ids:
                c = dict.fromkeys(COUNTERS, 0)
                c.update(counters.get(m, {}))
                c.update(queue_depth=len(self.queues[m]), replay_pool=len(self.replay_pools[m]),
                         current_version=self.versions[m],
                         batches_outstanding=outstanding.get(m, 0), **self.index.summary(m))
                models[m] = c
            for m, d in self.lease_demand().items():
                models[m]["lease_demand"] = asdict(d)
            instances = self.pool.table(now)
            plugins = {name: {"class": type(p).__name__, "metrics": p.metrics()}
                       for name, p in self.named_plugins().items()}
            return {"time": now, "models": models, "instances": instances, "plugins": plugins,
                    "durability": self.store.durability.counters(),
                    "tasks": {"open_train": self.leasing.open_train,
                              "open_eval": self.store.count_open_tasks("eval"),
                              "source_cursor": int(self.store.get_meta("source_cursor", 0))}}
