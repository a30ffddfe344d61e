"""The dataflow service's state machine, independent of HTTP.

:class:`Dataflow` is the facade over the prompt sources, task leases, fresh queues, served
batches, policy versions, weight files, eval scheduling, the RaaS pool and the data algorithms
(prompt curators before rollout, sample filters after it, replay at serving, queue orders), all
kept durable in a :class:`Store`. It owns the lock, the store and the transactions, and
delegates each job to its module: the pool (:mod:`~astralight.dataflow.pool`, rules in
:mod:`~astralight.dataflow.membership`), task creation and leasing
(:mod:`~astralight.dataflow.leasing`), ingest checks and advantages
(:mod:`~astralight.dataflow.ingest`), batch serving (:mod:`~astralight.dataflow.batches`),
versions and weight GC (:mod:`~astralight.dataflow.versions`), the plugins' durable state
(:mod:`~astralight.dataflow.plugin_state`), the counters (:mod:`~astralight.dataflow.counters`),
evals (:mod:`~astralight.dataflow.evals`) and the balance report
(:mod:`~astralight.dataflow.balance`). The data algorithms are plugins
(``astralight.dataflow.plugins``): the service only calls their hooks, counts what they decide
and persists their state. Every public method is one request: it takes the lock, does its work
in one SQLite transaction and returns plain data, raising :class:`ServiceError` (a 4xx naming
the field) for a bad request. In-memory structures (the fresh queues, the current versions)
change only after the transaction committed, so a crash at any point leaves SQLite as the truth
the next start rebuilds from. The lock is a :class:`~astralight.dataflow.durability.DurableLock`:
a request returns only once its commits are on disk, and concurrent requests share fsyncs (group
commit, ``group_commit``); :meth:`Dataflow.push_many` takes many tasks' pushes in one request
and waits once for them all.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from astralight.agents.stats import episode_counts
from astralight.dataflow import balance, batches, demand, evals, ingest, membership
from astralight.dataflow.config import DataflowConfig, build_plugins, instantiate_plugin
from astralight.dataflow.counters import COUNTERS, check_counter
from astralight.dataflow.durability import DurableLock
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.leasing import TaskLeasing
from astralight.dataflow.plugin_state import PluginState
from astralight.dataflow.plugins import DataPlugin, PromptOutcome
from astralight.dataflow.pool import Pool
from astralight.dataflow.queues import FreshQueue, QueueEntry
from astralight.dataflow.replay import ReplayEntry, ReplayPool
from astralight.dataflow.store import Store
from astralight.dataflow.versions import WeightIndex, check_manifest, check_version_jump
from astralight.dataflow.weightfiles import WeightFiles, check_file_name
from astralight.protocol import (SCHEMA_VERSION, Batch, Sample, Task, WeightManifest, decode,
                                 encode)
from astralight.tasks.base import PromptSource

log = logging.getLogger("astralight.dataflow")

MAX_LEASE_TASKS = 4096


class Dataflow:
    """All service state behind one lock; see the module docstring."""

    def __init__(self, config: DataflowConfig):
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
            try:
                self.eval_source.get(0)  # sources may build their list lazily; len() is final after
            except IndexError:
                raise ValueError("eval.source: the eval source is empty") from None
            self.eval_prompts = evals.eval_size(self.eval_source)
        #: a few sample completions per evaluated version (in memory; for the trainer's table)
        self.eval_completion_log = evals.CompletionLog()
        self.store = Store(self.state_dir / "dataflow.db", group_commit=config.group_commit)
        #: every request holds it; its outermost release waits until the commits are durable
        self.lock = DurableLock(self.store.durability)
        self.opened_at = time.time()  # batch ack timeouts count from here at the earliest
        self.weights = WeightFiles(self.state_dir / "weights")
        self.model_ids = list(config.model_ids)
        #: the RaaS instances: registered limits, reported stats, lease allowances
        self.pool = Pool(self.store, config)
        stored = self.store.latest_versions()
        self.versions = {m: stored.get(m, 0) for m in self.model_ids}
        self.primary = self.model_ids[0]
        self.plugins = build_plugins(config)
        self.curators = self.plugins["curators"]
        self.sample_filters = self.plugins["sample_filters"]
        self.replay_selectors = self.plugins["replay.selectors"]
        self.queues = {m: FreshQueue(self.plugins["queue_order"][m], config.max_staleness)
                       for m in self.model_ids}
        #: largest batch each policy's trainers pulled since start: the demand cap's floor
        self.largest_pull: dict[str, int] = dict.fromkeys(self.model_ids, 0)
        #: the plugins' generators, snapshots and curator journal
        self.plugin_state = PluginState(self.store, self.plugins, config.seed,
                                        config.plugin_state_every_s)
        self.plugin_state.load()
        #: creates train tasks and leases stored ones
        self.leasing = TaskLeasing(self.store, config, self.source, self.plugin_state,
                                   self.versions, self.queues, self.largest_pull, self._bump)
        self._rebuild_queues()
        self.replay_pools = {m: ReplayPool(config.replay.pool_size, config.replay.max_staleness,
                                           config.replay.max_uses) for m in self.model_ids}
        if config.replay.ratio > 0:
            self._rebuild_replay_pools()
        self.open_train = self.store.count_open_tasks("train")
        # (version, kind, published_at) of every stored version: what weight GC decides on
        self.index = WeightIndex(
            {m: [(r["version"], decode(bytes(r["manifest"])).kind, r["published_at"])
                 for r in self.store.version_rows(m)] for m in self.model_ids},
            config.weights_keep_s)
        self.weight_index = self.index.entries
        self.weights.purge_trash()
        stale_tmp = self.weights.purge_temp()  # uploads a crash interrupted: none is in flight now
        if stale_tmp:
            log.info("removed %d temporary file(s) of interrupted weight uploads", stale_tmp)
        self.gc_weights()
        with self.store.tx():
            # version 0's "publication": when this state folder first served (balance wall time)
            self.started_at = self.store.get_meta("started_at")
            if self.started_at is None:
                self.started_at = self.store.first_activity() or time.time()
                self.store.set_meta("started_at", self.started_at)
            for m in self.model_ids:  # version 0 at a fresh start; any version a crash left unscheduled
                self._maybe_schedule_eval(m, self.versions[m], time.time())
        self.store.durability.wait()  # what opening wrote is on disk before the first answer
        log.info("dataflow state in %s: versions %s, queued %s, open train tasks %d",
                 self.state_dir, self.versions, {m: len(q) for m, q in self.queues.items()},
                 self.open_train)

    def _rebuild_queues(self) -> None:
        for row in self.store.queued_samples():
            queue = self.queues.get(row["model_id"])
            if queue is None:
                log.warning("queued sample %d of model_id %r not in this config's model_ids; left in "
                            "the store", row["id"], row["model_id"])
                continue
            queue.push(QueueEntry(row["id"], row["min_version"], decode(bytes(row["blob"]))))

    # ------------------------------------------------------------------ data plugins

    def named_plugins(self) -> dict[str, DataPlugin]:
        """Every data plugin by its place in the config (``curators[0]``, ``queue_order.policy[0]``)."""
        return self.plugin_state.named()

    def _rebuild_replay_pools(self) -> None:
        """Refill each replay pool with the newest trained samples still replayable."""
        rp = self.config.replay
        for m, pool in self.replay_pools.items():
            rows = self.store.replay_candidates(m, self.versions[m] - rp.max_staleness, rp.pool_size)
            for r in reversed(rows):  # oldest first, as they entered the pool
                if rp.max_uses and r["uses"] >= rp.max_uses:
                    continue
                pool.add(ReplayEntry(r["id"], r["min_version"], decode(bytes(r["blob"])),
                                     added_version=self.versions[m], uses=int(r["uses"])))
            if len(pool):
                log.info("replay pool of %s: %d samples restored", m, len(pool))

    def close(self) -> None:
        with self.lock:
            try:
                with self.store.tx():
                    self.plugin_state.save(time.time())
            except Exception:  # never lose the database close over a plugin's state
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

    def _maybe_schedule_eval(self, model_id: str, version: int, now: float,
                             previous: int | None = None) -> int:
        """Evaluate ``version`` if it is a multiple of ``eval.every``, or if it is the first
        published version past one: a WeightPublisher that falls behind publishes only its newest
        snapshot, and the skipped multiple must not leave a hole in the eval curve."""
        every = self.config.eval.every
        crossed = previous is not None and version // every > previous // every
        if self.eval_source is None or (version % every and not crossed):
            return 0
        n = evals.schedule(self.store, self.eval_source, model_id, version, self.model_ids,
                           self.config.eval.k, self.config.workflow, now,
                           n=self.config.eval.samples(), pass_k=self.config.eval.pass_ks())
        if n:
            log.info("scheduled %d eval tasks for %s version %d", n, model_id, version)
        return n

    # ------------------------------------------------------------------ info

    def info(self) -> dict:
        cfg = self.config
        return {"service": "astralight-dataflow", "schema": SCHEMA_VERSION,
                "model_ids": self.model_ids, "versions": dict(self.versions),
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
        """Add an instance to the pool, or make a known one ``active`` again (after a restart of
        either side, a drain or a deregister) keeping its counters.

        ``limits``: what the instance's engines can produce per model_id (``vocab_size``,
        ``max_model_len``; :func:`membership.check_limits`); pushed samples are checked against
        them (:func:`ingest.sample_limits`). A vocabulary size that disagrees with ``vocab_sizes`` of
        the config, or with what another live instance registered for the same model_id, is
        refused (422 naming ``limits.<model_id>.vocab_size``): that RaaS serves another model.
        """
        if not model_ids:
            raise ServiceError(422, "model_ids", "must list the model_ids this instance serves")
        for m in model_ids:
            self._model(m, "model_ids")
        if capacity < 0:
            raise ServiceError(422, "capacity", "must be >= 0")
        if not (isinstance(capacity_units, (int, float)) and 0 < capacity_units < 1e6):
            raise ServiceError(422, "capacity_units", f"must be > 0 (GPUs or CPU slots), got "
                                                      f"{capacity_units!r}")
        limits = membership.check_limits(limits, list(model_ids))
        instance_id = instance_id or f"raas-{uuid.uuid4().hex[:12]}"
        now = time.time() if now is None else now
        with self.lock:
            self.pool.check_vocab_agreement(instance_id, limits, now)
            with self.store.tx():
                known = self.store.instance(instance_id) is not None
                self.store.upsert_instance(instance_id, list(model_ids), capacity, meta, now,
                                           float(capacity_units), self.config.lease_seconds,
                                           limits=limits)
            self.pool.instance_limits[instance_id] = limits
        log.info("instance %s %s for %s (capacity %d, %g capacity units%s)", instance_id,
                 "registered again" if known else "registered", model_ids, capacity,
                 capacity_units, f", limits {limits}" if limits else "")
        return {"instance_id": instance_id, "lease_seconds": self.config.lease_seconds,
                "versions": dict(self.versions)}

    def heartbeat(self, instance_id: str, in_flight: int | None = None,
                  now: float | None = None, stats: dict | None = None) -> dict:
        """Renew an instance; ``drain`` in the reply tells a draining (or deregistered) one to
        finish or return its tasks and deregister. ``stats``: the instance's own cumulative
        figures (its engines' weight-update pause), kept in memory for the instance table and
        the balance report (an observation, not state: a restart forgets it until the next
        heartbeat)."""
        if in_flight is not None and in_flight < 0:
            raise ServiceError(422, "in_flight", f"must be >= 0 tasks, got {in_flight}")
        with self.lock:
            inst = self.pool.instance(instance_id)
            with self.store.tx():
                self.store.touch_instance(instance_id, time.time() if now is None else now)
                if in_flight is not None:
                    self.store.set_reported_in_flight(instance_id, int(in_flight))
            if stats:
                self.pool.instance_stats[instance_id] = dict(stats)
            return {"instance_id": instance_id, "lease_seconds": self.config.lease_seconds,
                    "versions": dict(self.versions),
                    "drain": inst["state"] in (membership.DRAINING, membership.LEFT)}

    def drain(self, instance_id: str, now: float | None = None) -> dict:
        """Stop giving ``instance_id`` tasks; its heartbeat replies ``drain=True`` so it finishes
        or returns what it holds and deregisters. A deregistered instance stays ``left``."""
        now = time.time() if now is None else now
        with self.lock:
            inst = self.pool.instance(instance_id)
            state = inst["state"]
            if state == membership.ACTIVE:
                with self.store.tx():
                    self.store.set_instance_state(instance_id, membership.DRAINING)
                state = membership.DRAINING
                log.info("instance %s draining", instance_id)
            held = self.store.held_leases(now, instance_id)[instance_id]
        return {"instance_id": instance_id, "state": state, "in_flight": held}

    def return_tasks(self, instance_id: str, task_ids: list[str], failed: bool = False,
                     now: float | None = None) -> dict:
        """Hand back tasks ``instance_id`` leased and did not push: leasable again at once.
        ``failed``: the instance could not run them (counted against its health); otherwise it
        just will not (draining, unsupported workflow). Other task ids are ignored."""
        now = time.time() if now is None else now
        with self.lock:
            self.pool.instance(instance_id)
            with self.store.tx():
                n = self.pool.return_tasks(instance_id, task_ids, now, self._bump)
                if failed and n:
                    self.store.instance_failed(instance_id, n)
                self.store.touch_instance(instance_id, now)
        if n:
            log.info("instance %s returned %d task(s)%s", instance_id, n,
                     " as failed" if failed else "")
        return {"returned": n}

    def deregister(self, instance_id: str, now: float | None = None) -> dict:
        """Leave the pool: still-leased tasks become leasable at once, the state ``left``. A later
        register makes the instance active again."""
        now = time.time() if now is None else now
        with self.lock:
            self.pool.instance(instance_id)
            with self.store.tx():
                n = self.pool.return_tasks(instance_id, None, now, self._bump)
                self.store.touch_instance(instance_id, now)
                self.store.set_instance_state(instance_id, membership.LEFT, now)
        log.info("instance %s deregistered (%d task(s) returned)", instance_id, n)
        return {"returned": n}

    def lease(self, instance_id: str, max_tasks: int, now: float | None = None) -> list[Task]:
        """Lease up to ``max_tasks``: returned, expired or pending eval tasks, then train tasks,
        then new ones.

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
        cfg = self.config
        with self.lock:
            inst = self.pool.instance(instance_id)
            served = set(json.loads(inst["model_ids"]))
            now = time.time() if now is None else now
            max_tasks = self.pool.allowance(inst, max_tasks, now)
            deadline = now + cfg.lease_seconds
            out: list[Task] = []
            demands = self.lease_demand() if max_tasks else {}
            with self.store.tx():
                for kind in ("eval", "train"):
                    if len(out) >= max_tasks:
                        break
                    for row in self.store.leasable_tasks(kind, now):
                        if len(out) >= max_tasks:
                            break
                        if set(json.loads(row["model_ids"])) <= served:
                            out.append(self.leasing.issue(row, instance_id, deadline, now))
                created = 0
                while (len(out) < max_tasks and set(self.model_ids) <= served
                       and self.leasing.may_create(self.open_train + created, demands)):
                    row = self.leasing.create_train_task(now)
                    created += 1
                    out.append(self.leasing.issue(row, instance_id, deadline, now))
                self.store.touch_instance(instance_id, now, leased=len(out))
                if created:
                    self.plugin_state.maybe_save(now)
            self.open_train += created
            return out

    def lease_demand(self) -> dict[str, demand.Demand]:
        """Per policy, what its trainers consume and the most outstanding samples worth
        generating for it (:meth:`TaskLeasing.demands`). Call with the lock held."""
        return self.leasing.demands()

    def push(self, instance_id: str, task_id: str, samples: list[Sample],
             now: float | None = None) -> dict:
        """Accept a task's samples once; later pushes of the same task are ignored (duplicate).

        The first push is a task done by the pusher (its fail streak reset); when the pusher held
        the lease, its lease->push seconds count as its busy time and, for an eval task, as eval
        time of the policies at their current versions (``eval_task_ms``, the balance report)."""
        with self.lock:
            self.pool.instance(instance_id)
            row = self.store.task(task_id)
            if row is None:
                raise ServiceError(404, "task_id", f"unknown task {task_id!r}")
            model_ids = json.loads(row["model_ids"])
            now = time.time() if now is None else now
            if row["state"] == "done":
                with self.store.tx():
                    for m in model_ids:
                        self._bump(m, "duplicates_ignored")
                    self.store.touch_instance(instance_id, now)
                return {"accepted": 0, "filtered": 0, "duplicate": True}
            if row["lease_count"] == 0:
                raise ServiceError(409, "task_id", f"task {task_id!r} was never leased")
            ingest.validate_samples(
                row, model_ids, samples,
                limit=(decode(bytes(row["payload"])).n * len(model_ids)
                       * self.config.max_samples_per_rollout),
                limits_of=lambda m: ingest.sample_limits(instance_id, m, self.config.vocab_sizes,
                                                         self.pool.instance_limits),
                versions=self.versions, temperatures=self.config.temperatures)
            ingest.assign_advantages(samples)
            entries: list[QueueEntry] = []
            outcome = None
            with self.store.tx():
                if row["kind"] == "eval":  # scored, never queued for training
                    self._record_eval(row, samples, now)
                else:
                    kept, kept_groups, rewards = ingest.filter_groups(self.sample_filters,
                                                                      samples)
                    index = int(row["prompt_index"]) % len(self.source)
                    outcome = PromptOutcome(prompt_id=self.source.get(index).prompt_id,
                                            prompt_index=index,
                                            version=self.versions[self.primary],
                                            rewards=rewards, kept=kept_groups)
                    counts: Counter = Counter()
                    sync = self.config.mode == "sync"
                    for s in samples:
                        mv = s.min_version
                        if sync and mv < self.versions[s.model_id]:
                            state = "stale"  # an older round's sample: never trained in sync mode
                        else:
                            state = "queued" if id(s) in kept else "filtered"
                        sid = self.store.insert_sample(task_id, s.model_id, s.sample_index, mv,
                                                       s.reward, encode(s), now, state=state)
                        counts[s.model_id, "rollouts_generated"] += 1
                        for name, k in episode_counts(s.metadata).items():
                            counts[s.model_id, name] += k
                        if state == "queued":
                            entries.append(QueueEntry(sid, mv, s))
                        counts[s.model_id, {"queued": "samples_accepted", "stale": "stale_dropped",
                                            "filtered": "samples_filtered"}[state]] += 1
                    for m, group_kept in outcome.kept.items():
                        counts[m, "groups_filtered"] += not group_kept
                    journal_seq = self.plugin_state.journal("outcome", asdict(outcome))
                    for (m, name), k in counts.items():
                        self._bump(m, name, k)
                self.store.mark_done(task_id, now)
                self.store.touch_instance(instance_id, now, pushed=len(samples))
                busy = None
                if row["instance_id"] == instance_id and row["leased_at"] is not None:
                    busy = max(0.0, now - row["leased_at"])
                self.store.instance_done(instance_id, busy)
                if row["kind"] == "eval" and busy is not None:
                    for m in model_ids:
                        if m in self.queues:
                            self._bump(m, "eval_task_ms", round(1000 * busy))
                self.plugin_state.maybe_save(now)
            # committed: only now does the in-memory state follow
            if row["kind"] == "train":
                self.open_train -= 1
            for e in entries:
                self.queues[e.sample.model_id].push(e)
            if outcome is not None:
                self.plugin_state.apply_outcome(outcome, journal_seq)
            return {"accepted": len(entries) if row["kind"] == "train" else len(samples),
                    "filtered": len(samples) - len(entries) if row["kind"] == "train" else 0,
                    "duplicate": False}

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

    def _record_eval(self, row, samples: list[Sample], now: float) -> None:
        target = row["target_model"]
        mine = [s for s in samples if s.model_id == target]
        if len(mine) < len(samples):
            self._bump(target, "eval_samples_ignored", len(samples) - len(mine))
        if not mine:
            return
        report = evals.summarize(mine)
        self.store.insert_eval_report(target, row["eval_version"], row["prompt_index"],
                                      row["task_id"], now=now, **report)
        self._bump(target, "eval_samples_accepted", len(mine))
        prompt = None
        if self.eval_source is not None and row["prompt_index"] is not None:
            with contextlib.suppress(Exception):  # the table is a view: never fail a push for it
                prompt = self.eval_source.get(int(row["prompt_index"])).prompt
        self.eval_completion_log.add(target, int(row["eval_version"]), int(row["prompt_index"]),
                                     prompt, mine)

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
            self.largest_pull[model_id] = max(self.largest_pull[model_id], size)
            version = self.versions[model_id]
            queue, pool = self.queues[model_id], self.replay_pools[model_id]
            taken = batches.draw(queue, pool, size, self.config.replay.ratio, version,
                                 self.replay_selectors)
            chosen = taken.chosen
            if chosen is None and not taken.dropped and not taken.replay_stale:
                return None
            batch_id = uuid.uuid4().hex
            try:
                with self.store.tx():
                    self._record_stale(model_id, taken.dropped)
                    self._bump(model_id, "replay_stale_dropped", len(taken.replay_stale))
                    if chosen is not None:
                        self.store.insert_batch(batch_id, model_id, trainer_id, version, size,
                                                time.time())
                        self.store.set_sample_state([e.sample_id for e in chosen], "served",
                                                    batch_id)
                        self.store.insert_replays(batch_id,
                                                  [e.sample_id for e in taken.replayed])
                        self._bump(model_id, "samples_served", len(chosen))
                        self._bump(model_id, "replay_served", len(taken.replayed))
                        self._bump(model_id, "replay_exhausted", len(taken.exhausted))
                        self._bump(model_id, "batches_served")
            except BaseException:
                batches.undo(queue, pool, taken)  # the store was not changed: neither are they
                raise
            if chosen is None:
                return None
            return Batch(batch_id=batch_id, model_id=model_id, policy_version=version,
                         samples=[e.sample for e in chosen] + [e.sample for e in taken.replayed])

    def _record_stale(self, model_id: str, dropped: list[QueueEntry]) -> None:
        if dropped:
            self.store.set_sample_state([e.sample_id for e in dropped], "stale")
            self._bump(model_id, "stale_dropped", len(dropped))
            log.info("dropped %d stale samples of %s (current version %d, max_staleness %d)",
                     len(dropped), model_id, self.versions[model_id], self.config.max_staleness)

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
            row = self.store.batch(batch_id)
            if row is None:
                raise ServiceError(404, "batch_id", f"unknown batch {batch_id!r}")
            if row["state"] == "acked":
                return {"acked": True, "already": True}
            mid = row["model_id"]
            late = row["state"] == "requeued"
            rows = self.store.batch_samples(batch_id, ("served", "queued"))
            ids = [r["id"] for r in rows]
            # a re-serve is the only way a sample leaves this batch's id (stale drops keep it)
            twice = max(0, row["n"] - self.store.batch_member_count(batch_id)
                        - self.store.replay_count(batch_id)) if late else 0
            with self.store.tx():
                self.store.set_sample_state(ids, "acked")
                self.store.set_batch_state(batch_id, "acked", time.time())
                if step is not None:
                    self.store.set_acked_step(batch_id, step)
                n_replayed = self.store.set_replay_state(batch_id, "acked")
                self._bump(mid, "samples_acked", len(ids))
                self._bump(mid, "samples_trained", len(ids) + n_replayed)
                self._bump(mid, "batches_acked")
                if late:
                    self._bump(mid, "late_acks")
                if twice:
                    self._bump(mid, "late_acks_after_reserve")
                    self._bump(mid, "samples_trained_twice", twice)
                if wait_s is not None and step_s is not None and mid in self.queues:
                    self._bump(mid, "trainer_wait_ms", round(1000 * wait_s))
                    self._bump(mid, "trainer_step_ms", round(1000 * step_s))
                    self._bump(mid, "trainer_steps_timed")
                evicted = self._add_to_replay_pool(mid, rows) if mid in self.queues else []
            if mid in self.queues:
                self.queues[mid].remove([r["id"] for r in rows if r["state"] == "queued"])
            out = {"acked": True, "already": False, "samples": len(ids) + n_replayed,
                   "replay_evicted": len(evicted)}
            if late:
                out.update(batches.late_ack_report(row, rows, twice, len(ids),
                                                   self.config.batch_ack_timeout_s))
            return out

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
            with self.store.tx():
                rows = self.store.roll_back_batches(mid, step, now)
                samples = sum(int(r["n"]) for r in rows)
                if rows:
                    self._bump(mid, "batches_rolled_back", len(rows))
                    self._bump(mid, "samples_rolled_back", samples)
        if rows:
            log.warning("%s resumed at step %d: %d batches (%d samples) acked after that step were "
                        "trained into weights the restart discarded (counted as rolled back): %s",
                        mid, step, len(rows), samples, [r["batch_id"] for r in rows][:8])
        return {"model_id": mid, "step": step, "batches_rolled_back": len(rows),
                "samples_rolled_back": samples}

    def extend_batch(self, batch_id: str, now: float | None = None) -> dict:
        """Keep-alive of a served batch: its ack timeout counts again from ``now`` (durable).

        A trainer extends every batch it holds, pulled and not yet acked, every
        ``batch_ack_timeout_s / 3`` (the datamodule does, from a timer thread), so a live
        trainer whose step outlasts the timeout keeps its batch; only a dead or frozen one loses
        it. 404 for an unknown batch; 409 for one already acked or already re-queued (the
        trainer should stop extending it: re-queued samples may be served again).
        """
        now = time.time() if now is None else now
        timeout = self.config.batch_ack_timeout_s
        with self.lock:
            row = self.store.batch(batch_id)
            if row is None:
                raise ServiceError(404, "batch_id", f"unknown batch {batch_id!r}")
            if row["state"] == "acked":
                raise ServiceError(409, "batch_id", f"batch {batch_id} is already acknowledged; "
                                                    "there is nothing to keep alive")
            if row["state"] != "served":
                raise ServiceError(409, "batch_id", (
                    f"batch {batch_id} was re-queued: it was neither acked nor extended within "
                    f"batch_ack_timeout_s={timeout:g} s (was the trainer frozen?), so its samples "
                    "may be served again; it can no longer be extended. Ack it once trained "
                    "(the ack reports samples trained twice)"))
            with self.store.tx():
                self.store.renew_batch(batch_id, now)
                self._bump(row["model_id"], "batches_extended")
        return {"batch_id": batch_id, "extended": True, "deadline_s": timeout,
                "batch_ack_timeout_s": timeout}

    def _add_to_replay_pool(self, model_id: str, rows) -> list[ReplayEntry]:
        """Inside the ack's transaction: trained fresh samples become replayable (counted);
        the pool evicts its oldest beyond ``replay.pool_size`` (counted)."""
        if self.config.replay.ratio <= 0:
            return []
        added, evicted = batches.make_replayable(self.replay_pools[model_id], rows,
                                                 self.versions[model_id],
                                                 self.config.replay.max_staleness)
        self._bump(model_id, "replay_added", added)
        self._bump(model_id, "replay_evicted", len(evicted))
        return evicted

    def requeue_expired_batches(self, now: float | None = None) -> set[str]:
        """Put the samples of batches not acked within ``batch_ack_timeout_s`` back in their
        queues (at their original place in the order). Returns the model_ids that got samples.

        The timeout counts from when the service could last take the ack: a batch served before
        a restart gets a whole ``batch_ack_timeout_s`` after the restart, so a trainer that kept
        training it while the service was down can still ack it instead of the samples being
        served (and trained) a second time. A keep-alive (:meth:`extend_batch`) restarts it too.
        """
        now = time.time() if now is None else now
        woken: set[str] = set()
        if now - self.opened_at < self.config.batch_ack_timeout_s:
            return woken  # nothing can have expired since the service (re)started
        with self.lock:
            for batch in self.store.batches_served_before(now - self.config.batch_ack_timeout_s):
                mid = batch["model_id"]
                rows = self.store.batch_samples(batch["batch_id"], ("served",))
                with self.store.tx():
                    self.store.set_sample_state([r["id"] for r in rows], "queued")
                    self.store.set_batch_state(batch["batch_id"], "requeued")
                    self.store.set_replay_state(batch["batch_id"], "requeued")
                    self._bump(mid, "batches_requeued")
                    self._bump(mid, "samples_requeued", len(rows))
                if mid in self.queues:
                    for r in rows:
                        self.queues[mid].push(QueueEntry(r["id"], r["min_version"],
                                                         decode(bytes(r["blob"]))))
                    woken.add(mid)
                log.warning("batch %s of %s not acked within %.0f s: %d samples re-queued",
                            batch["batch_id"], mid, self.config.batch_ack_timeout_s, len(rows))
        return woken

    # ------------------------------------------------------------------ versions and weights

    def current_version(self, model_id: str) -> int:
        return self.versions[self._model(model_id)]

    def check_upload(self, model_id: str, version: int, name: str) -> None:
        """An upload of ``name`` for ``version`` may go ahead: a plain file name
        (:func:`check_file_name`), a version newer than the current one (published versions are
        immutable: 409) and within ``max_version_jump`` of it (422)."""
        self._model(model_id)
        check_file_name(name)
        if version <= self.versions[model_id]:
            raise ServiceError(409, "version", f"version {version} of {model_id!r} is not newer than "
                                               f"the current version {self.versions[model_id]}; "
                                               "published versions are immutable")
        check_version_jump(model_id, version, self.versions[model_id],
                           self.config.max_version_jump, "version")

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
        by at most ``max_version_jump`` at a time (:func:`astralight.dataflow.versions.check_manifest`)."""
        mid = self._model(manifest.model_id, "manifest.model_id")
        with self.lock:
            current = self.versions[mid]
            check_manifest(manifest, current, self.config.max_version_jump,
                           self.index.stored(mid), self.weights)
            now = time.time()
            manifest.created = manifest.created or now
            journal_seq = None
            with self.store.tx():
                self.store.insert_version(mid, manifest.version, encode(manifest), now)
                n_evals = self._maybe_schedule_eval(mid, manifest.version, now, previous=current)
                if mid == self.primary:
                    journal_seq = self.plugin_state.journal("version", {"version": manifest.version})
            self.versions[mid] = manifest.version
            self.weight_index[mid].append((manifest.version, manifest.kind, now))
            dropped = self.queues[mid].drop_stale(manifest.version)
            replay_stale = self.replay_pools[mid].drop_stale(manifest.version)
            if mid == self.primary:
                self.plugin_state.apply_version(manifest.version, journal_seq)
            with self.store.tx():
                self._record_stale(mid, dropped)
                self._bump(mid, "replay_stale_dropped", len(replay_stale))
                if mid == self.primary:
                    self.plugin_state.save(now)
            log.info("published %s version %d (%s, %d files)", mid, manifest.version, manifest.kind,
                     len(manifest.files))
            try:
                trash = self._collect_weights(now)
            except Exception:  # the version is published; GC retries at the next publication
                log.exception("weight GC failed")
                trash = []
        self.weights.purge(trash)  # outside the lock: deleting big files takes a while
        return {"model_id": mid, "version": manifest.version, "evals_scheduled": n_evals}

    # ------------------------------------------------------------------ weight GC

    def _collect_weights(self, now: float) -> list[Path]:
        """Under the lock: :meth:`WeightIndex.collect` when ``weights_gc`` is on; returns the
        folders to purge."""
        if not self.config.weights_gc:
            return []
        return self.index.collect(self.store, self.weights, self.versions, self._bump, now)

    def gc_due(self, now: float | None = None) -> bool:
        """Cheap check for the service's sweeper: would :meth:`gc_weights` remove something?"""
        return self.config.weights_gc and (time.time() if now is None else now) >= self.index.next_due

    def gc_weights(self, now: float | None = None) -> dict[str, list[int]]:
        """Collect old weight versions now (see ``DataflowConfig.weights_gc``); returns the
        removed published versions per model_id."""
        now = time.time() if now is None else now
        with self.lock:
            before = {m: [e[0] for e in self.weight_index[m]] for m in self.model_ids}
            trash = self._collect_weights(now)
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
            live = [r for r in table if r["live"]]
            counters = self.store.version_counters(model_id, since=first)
            times = self.store.version_times(model_id)
        wall = balance.window_wall_s(times, first, last, self.started_at, now)
        report = balance.window_report(counters, first, last,
                                       pool if pool is not None else len(live), wall_s=wall,
                                       capacity_units=sum(r["capacity_units"] for r in live))
        report.update(model_id=model_id, current_version=current, live_instances=len(live),
                      instances=table,
                      weight_pause_s=round(sum(float(r["reported"].get("weight_pause_s", 0))
                                               for r in table), 4))
        return report

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
        if self.eval_source is None:
            raise ServiceError(409, "eval", "this service has no eval.source, so nothing can be "
                                            "evaluated; set dataflow.eval.source")
        now = time.time() if now is None else now
        with self.lock:
            current = self.versions[mid]
            if self.store.eval_run_exists(mid, version):
                return {"model_id": mid, "version": version, "evals_scheduled": 0}
            if version != current:
                when = "is not published yet" if version > current else "is not the current one"
                raise ServiceError(409, "version", (
                    f"version {version} of {mid!r} {when} (current {current}); only the current "
                    f"version can be evaluated on request (its eval tasks are generated with the "
                    f"weights the RaaS hold)"))
            with self.store.tx():
                n = evals.schedule(self.store, self.eval_source, mid, version, self.model_ids,
                                   self.config.eval.k, self.config.workflow, now,
                                   n=self.config.eval.samples(), pass_k=self.config.eval.pass_ks())
        log.info("scheduled %d eval tasks for %s version %d on request", n, mid, version)
        return {"model_id": mid, "version": version, "evals_scheduled": n}

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
                                   benchmarks=evals.benchmark_map(self.eval_source))

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
                    "tasks": {"open_train": self.open_train,
                              "open_eval": self.store.count_open_tasks("eval"),
                              "source_cursor": int(self.store.get_meta("source_cursor", 0))}}
