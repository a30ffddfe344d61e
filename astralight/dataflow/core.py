"""The dataflow service's state machine, independent of HTTP.

:class:`Dataflow` owns the prompt sources, task leases, fresh queues, served batches, policy
versions, weight files, eval scheduling, the RaaS pool (membership, health and lease allowances,
:mod:`astralight.dataflow.membership`; the balance report, :mod:`astralight.dataflow.balance`)
and the data algorithms (prompt curators before rollout, sample filters after it, replay at
serving, queue orders), and keeps all of it durable in a :class:`Store`. The data algorithms are plugins (``astralight.dataflow.plugins``): this module
only calls their hooks, counts what they decide and persists their state. Every
public method is one request: it takes the lock, does its work in one SQLite transaction and
returns plain data, raising :class:`ServiceError` (a 4xx naming the field) for a bad request.
In-memory structures (the fresh queues, the current versions) change only after the transaction
committed, so a crash at any point leaves SQLite as the truth the next start rebuilds from.
The lock is a :class:`~astralight.dataflow.durability.DurableLock`: a request returns only once
its commits are on disk, and concurrent requests share fsyncs (group commit, ``group_commit``);
:meth:`Dataflow.push_many` takes many tasks' pushes in one request and waits once for them all.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
import zlib
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

import numpy as np

from astralight.agents.stats import episode_counts
from astralight.dataflow import balance, demand, evals, membership
from astralight.dataflow.config import DataflowConfig, build_plugins, instantiate_plugin
from astralight.dataflow.durability import DurableLock
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.plugins import DataPlugin, PromptOutcome
from astralight.dataflow.queues import FreshQueue, QueueEntry
from astralight.dataflow.replay import ReplayEntry, ReplayPool
from astralight.dataflow.store import Store
from astralight.dataflow.weightfiles import WeightFiles, check_file_name
from astralight.protocol import (LOGPROB_FLOOR, MAX_VOCAB_SIZE, SCHEMA_VERSION, Batch,
                                 ProtocolError, Sample, Task, WeightManifest,
                                 check_sample_metadata, decode, encode)
from astralight.tasks.base import PromptSource

log = logging.getLogger("astralight.dataflow")

ADV_EPS = 1e-6
MAX_LEASE_TASKS = 4096
#: per-model_id counters (persisted in SQLite); stats report all of them, zero when never bumped
COUNTERS = ("tasks_issued", "tasks_reissued", "eval_tasks_issued", "eval_tasks_reissued",
            "samples_accepted", "duplicates_ignored", "stale_dropped", "samples_served",
            "batches_served", "samples_acked", "batches_acked", "batches_requeued",
            "samples_requeued", "eval_samples_accepted", "eval_samples_ignored",
            "weight_versions_removed",
            # data algorithms
            "rollouts_generated", "prompts_submitted", "prompts_skipped", "prompts_forced",
            "groups_filtered", "samples_filtered", "replay_added", "replay_evicted",
            "replay_stale_dropped", "replay_exhausted", "replay_served", "samples_trained",
            # trainer timings reported with acks (balance report)
            "trainer_wait_ms", "trainer_step_ms", "trainer_steps_timed",
            # pool membership: tasks a RaaS handed back; lease->push time of finished eval tasks
            "tasks_returned", "eval_task_ms",
            # batch keep-alives; acks of batches already re-queued (a trainer frozen past
            # batch_ack_timeout_s), those whose samples had been served again meanwhile, and
            # the samples those trained a second time (what the audit reports as duplicates)
            "batches_extended", "late_acks", "late_acks_after_reserve", "samples_trained_twice",
            # acked batches whose training a trainer's restart from an older checkpoint undid
            "batches_rolled_back", "samples_rolled_back")
#: the generic curator safety valve never scans more than this many prompts for one task
MAX_CURATOR_SKIPS = 10_000


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
        #: what each instance's engines registered per model_id (``limits``; mirrors SQLite)
        self.instance_limits: dict[str, dict] = {
            r["instance_id"]: membership.stored_limits(r) for r in self.store.instances()}
        stored = self.store.latest_versions()
        self.versions = {m: stored.get(m, 0) for m in self.model_ids}
        self.primary = self.model_ids[0]
        self.plugins = build_plugins(config)
        self.curators = self.plugins["curators"]
        self.sample_filters = self.plugins["sample_filters"]
        self.replay_selectors = self.plugins["replay.selectors"]
        self.queues = {m: FreshQueue(self.plugins["queue_order"][m], config.max_staleness)
                       for m in self.model_ids}
        self.max_skips = min(config.curator_max_skips or len(self.source), MAX_CURATOR_SKIPS)
        self._skip_run = 0  # consecutive prompts the curators rejected (the safety valve's count)
        #: what each RaaS reported in its last heartbeat (``stats``): weight pauses, ...
        self.instance_stats: dict[str, dict] = {}
        #: largest batch each policy's trainers pulled since start: the demand cap's floor
        self.largest_pull: dict[str, int] = dict.fromkeys(self.model_ids, 0)
        self._load_plugin_state()
        self._rebuild_queues()
        self.replay_pools = {m: ReplayPool(config.replay.pool_size, config.replay.max_staleness,
                                           config.replay.max_uses) for m in self.model_ids}
        if config.replay.ratio > 0:
            self._rebuild_replay_pools()
        self.open_train = self.store.count_open_tasks("train")
        # (version, kind, published_at) of every stored version: what weight GC decides on
        self.weight_index: dict[str, list[tuple[int, str, float]]] = {
            m: [(r["version"], decode(bytes(r["manifest"])).kind, r["published_at"])
                for r in self.store.version_rows(m)] for m in self.model_ids}
        self._gc_next = 0.0
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
        out: dict[str, DataPlugin] = {}
        for key in ("curators", "sample_filters", "replay.selectors"):
            for i, plugin in enumerate(self.plugins[key]):
                out[f"{key}[{i}]"] = plugin
        for m, orders in self.plugins["queue_order"].items():
            for i, plugin in enumerate(orders):
                out[f"queue_order.{m}[{i}]"] = plugin
        return out

    @staticmethod
    def _class_path(plugin: DataPlugin) -> str:
        return f"{type(plugin).__module__}.{type(plugin).__qualname__}"

    def _load_plugin_state(self) -> None:
        """Give every plugin its own seeded generator, then restore what the last run saved.

        A plugin's stream is derived from ``seed`` and its place in the config, so adding a
        plugin does not change the draws of the others. Saved state of a different class (the
        config changed between runs) is ignored with a warning: the plugin starts fresh.
        """
        saved = self.store.get_meta("plugin_run_state", {})
        self._skip_run = int(saved.get("skip_run", 0))
        states = self.store.plugin_states()
        for name, plugin in self.named_plugins().items():
            plugin.rng = np.random.default_rng([self.config.seed, zlib.crc32(name.encode())])
            if name not in states:
                continue
            class_path, state = states[name]
            if class_path != self._class_path(plugin):
                log.warning("%s: saved state is of %s, the config now names %s; starting it fresh",
                            name, class_path, self._class_path(plugin))
                continue
            plugin.rng.bit_generator.state = state["rng"]
            plugin.load_state_dict(state["plugin"])
            log.info("%s (%s): state restored", name, type(plugin).__name__)
        self._replay_journal(int(saved.get("journal_seq", 0)))

    def _replay_journal(self, after: int) -> None:
        """Bring the curators from their last snapshot to the moment the service stopped.

        Snapshots are written every ``plugin_state_every_s`` (serialising a curator's per-prompt
        table on every push would cost too much), but every push journals its
        :class:`PromptOutcome` and every publication its version in the same transaction as the
        samples / the version. Replaying the entries after the snapshot, in order, gives the
        curators exactly the state they had at a kill -9. (Random draws a curator made after the
        snapshot are not replayed: its generator continues from the snapshot, still seeded.)
        """
        self._journal_applied = after
        rows = self.store.journal_after(after)
        for row in rows:
            data = json.loads(row["data"])
            if row["kind"] == "outcome":
                outcome = PromptOutcome(**data)
                for curator in self.curators:
                    curator.update(outcome)
            elif row["kind"] == "version":
                for curator in self.curators:
                    curator.on_version(int(data["version"]))
            self._journal_applied = int(row["seq"])
        if rows:
            log.info("curators: %d journal entries after the last snapshot replayed", len(rows))

    def _journal(self, kind: str, data: dict) -> int | None:
        """Inside the caller's transaction: journal a curator event (only when there are
        curators); the caller applies it after the commit and sets ``_journal_applied``."""
        return self.store.journal(kind, data) if self.curators else None

    def _save_plugin_state(self, now: float) -> None:
        """Inside the caller's transaction: persist every plugin's state and generator."""
        for name, plugin in self.named_plugins().items():
            self.store.save_plugin_state(name, self._class_path(plugin),
                                         {"rng": plugin.rng.bit_generator.state,
                                          "plugin": plugin.state_dict()}, now)
        self.store.set_meta("plugin_run_state", {"skip_run": self._skip_run,
                                                 "journal_seq": self._journal_applied})
        self.store.truncate_journal(self._journal_applied)
        self._plugins_saved_at = now

    def _maybe_save_plugin_state(self, now: float) -> None:
        if now - getattr(self, "_plugins_saved_at", 0.0) >= self.config.plugin_state_every_s:
            self._save_plugin_state(now)

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
                    self._save_plugin_state(time.time())
            except Exception:  # never lose the database close over a plugin's state
                log.exception("could not save the data plugins' state at shutdown")
            self.store.close()

    # ------------------------------------------------------------------ helpers

    def _bump(self, model_id: str, name: str, k: int = 1) -> None:
        """Count an event for ``model_id`` in total and at its current version."""
        self.store.bump(model_id, name, k, self.versions[model_id])

    def _model(self, model_id, field: str = "model_id") -> str:
        if model_id not in self.queues:
            raise ServiceError(404, field, f"unknown model_id {model_id!r}; this service serves "
                                           f"{self.model_ids}")
        return model_id

    def _instance(self, instance_id: str):
        row = self.store.instance(instance_id)
        if row is None:
            raise ServiceError(404, "instance_id", f"unknown instance {instance_id!r}; "
                                                   "call register first")
        return row

    def _check_vocab_agreement(self, instance_id: str, limits: dict, now: float) -> None:
        """Under the lock: refuse a registered vocabulary size that disagrees with the config's
        ``vocab_sizes`` or with another live instance's registration for the same model_id."""
        others = [(r["instance_id"], self.instance_limits.get(r["instance_id"], {}))
                  for r in self.store.instances()
                  if r["instance_id"] != instance_id
                  and membership.is_live(r["state"], now - r["last_seen"], self.config.lease_seconds)]
        for m, entry in limits.items():
            vocab = entry.get("vocab_size")
            if vocab is None:
                continue
            field = f"limits.{m}.vocab_size"
            configured = self.config.vocab_sizes.get(m)
            if configured is not None and configured != vocab:
                raise ServiceError(422, field, (
                    f"this instance's engine for {m!r} has a vocabulary of {vocab} tokens, the "
                    f"dataflow's vocab_sizes.{m} says {configured}: the RaaS serves another model "
                    "than the trainer; point the RaaS engine's model_path at the trainer's model "
                    f"(or correct vocab_sizes.{m} in the dataflow config)"))
            clash = membership.vocab_conflict(m, vocab, others)
            if clash is not None:
                raise ServiceError(422, field, (
                    f"this instance's engine for {m!r} has a vocabulary of {vocab} tokens, live "
                    f"instance {clash[0]} registered {clash[1]}: two RaaS serve different models "
                    f"as {m!r}; give both the same model_path (or set vocab_sizes.{m} in the "
                    "dataflow config to the trainer's)"))

    def _pool_limits(self, model_id: str) -> dict:
        """The effective limits of ``model_id`` over the whole pool (the config's vocab_sizes
        wins): ``{vocab_size, max_model_len}``, each None when nobody said."""
        pool = membership.pool_limits(model_id, self.instance_limits.values())
        vocab = self.config.vocab_sizes.get(model_id, pool.get("vocab_size"))
        return {"vocab_size": vocab, "max_model_len": pool.get("max_model_len")}

    def _sample_limits(self, instance_id: str, model_id: str) -> tuple[int, str, int | None, str]:
        """``(vocab, vocab_source, max_len, max_len_source)`` a sample of ``model_id`` pushed by
        ``instance_id`` must respect. The vocabulary: ``vocab_sizes`` of the config, else what
        the pushing instance registered, else what another instance registered, else
        :data:`MAX_VOCAB_SIZE` (nothing known: only ids no tokenizer has are refused). The
        length: the pushing instance's registered ``max_model_len``, else the pool's largest,
        else None (unchecked: the body limit ``max_body_bytes`` still bounds it)."""
        own = self.instance_limits.get(instance_id, {}).get(model_id, {})
        pool = membership.pool_limits(model_id, self.instance_limits.values())
        if model_id in self.config.vocab_sizes:
            vocab, vsrc = self.config.vocab_sizes[model_id], f"vocab_sizes.{model_id}"
        elif "vocab_size" in own:
            vocab, vsrc = own["vocab_size"], f"the vocab_size instance {instance_id} registered"
        elif "vocab_size" in pool:
            vocab, vsrc = pool["vocab_size"], "the vocab_size a RaaS registered"
        else:
            vocab, vsrc = MAX_VOCAB_SIZE, "MAX_VOCAB_SIZE (no vocabulary known: set vocab_sizes)"
        if "max_model_len" in own:
            max_len, lsrc = own["max_model_len"], (f"the max_model_len instance {instance_id} "
                                                   "registered")
        elif "max_model_len" in pool:
            max_len, lsrc = pool["max_model_len"], "the largest max_model_len a RaaS registered"
        else:
            max_len, lsrc = None, ""
        return int(vocab), vsrc, max_len, lsrc

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
                "limits": {m: self._pool_limits(m) for m in self.model_ids},
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
        them (:meth:`_sample_limits`). A vocabulary size that disagrees with ``vocab_sizes`` of
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
            self._check_vocab_agreement(instance_id, limits, now)
            with self.store.tx():
                known = self.store.instance(instance_id) is not None
                self.store.upsert_instance(instance_id, list(model_ids), capacity, meta, now,
                                           float(capacity_units), self.config.lease_seconds,
                                           limits=limits)
            self.instance_limits[instance_id] = limits
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
            inst = self._instance(instance_id)
            with self.store.tx():
                self.store.touch_instance(instance_id, time.time() if now is None else now)
                if in_flight is not None:
                    self.store.set_reported_in_flight(instance_id, int(in_flight))
            if stats:
                self.instance_stats[instance_id] = dict(stats)
            return {"instance_id": instance_id, "lease_seconds": self.config.lease_seconds,
                    "versions": dict(self.versions),
                    "drain": inst["state"] in (membership.DRAINING, membership.LEFT)}

    def drain(self, instance_id: str, now: float | None = None) -> dict:
        """Stop giving ``instance_id`` tasks; its heartbeat replies ``drain=True`` so it finishes
        or returns what it holds and deregisters. A deregistered instance stays ``left``."""
        now = time.time() if now is None else now
        with self.lock:
            inst = self._instance(instance_id)
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
            self._instance(instance_id)
            with self.store.tx():
                n = self._return(instance_id, task_ids, now)
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
            self._instance(instance_id)
            with self.store.tx():
                n = self._return(instance_id, None, now)
                self.store.touch_instance(instance_id, now)
                self.store.set_instance_state(instance_id, membership.LEFT, now)
        log.info("instance %s deregistered (%d task(s) returned)", instance_id, n)
        return {"returned": n}

    def _return(self, instance_id: str, task_ids: list[str] | None, now: float) -> int:
        """Inside the caller's transaction: return tasks (see :meth:`Store.return_tasks`) and
        count them per instance and per policy."""
        ids = self.store.return_tasks(instance_id, task_ids, now)
        if ids:
            self.store.instance_returned(instance_id, len(ids))
            for tid in ids:
                for m in json.loads(self.store.task(tid)["model_ids"]):
                    if m in self.queues:
                        self._bump(m, "tasks_returned")
        return len(ids)

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
            inst = self._instance(instance_id)
            served = set(json.loads(inst["model_ids"]))
            now = time.time() if now is None else now
            max_tasks = self._allowance(inst, max_tasks, now)
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
                            out.append(self._issue(row, instance_id, deadline, now))
                created = 0
                while (len(out) < max_tasks and set(self.model_ids) <= served
                       and self._may_create_train_task(self.open_train + created, demands)):
                    row = self._create_train_task(now)
                    created += 1
                    out.append(self._issue(row, instance_id, deadline, now))
                self.store.touch_instance(instance_id, now, leased=len(out))
                if created:
                    self._maybe_save_plugin_state(now)
            self.open_train += created
            return out

    def _allowance(self, inst, requested: int, now: float) -> int:
        """How many of ``requested`` tasks the instance may lease now (see
        :func:`membership.lease_allowance`); the pool median is over the live instances."""
        if requested == 0 or inst["state"] != membership.ACTIVE:
            return 0
        cfg = self.config
        held = self.store.held_leases(now, inst["instance_id"])[inst["instance_id"]]
        median = None
        if inst["tasks_timed"] >= membership.MIN_TIMED_TASKS:  # only then can it be slow
            median = membership.pool_median(
                (membership.mean_task_s(r["busy_s"], r["tasks_timed"]), r["tasks_timed"])
                for r in self.store.instances()
                if membership.is_live(r["state"], now - r["last_seen"], cfg.lease_seconds)
                or r["instance_id"] == inst["instance_id"])
        return membership.lease_allowance(
            requested, capacity=inst["capacity"], held=held, state=inst["state"],
            fail_streak=inst["fail_streak"],
            mean_s=membership.mean_task_s(inst["busy_s"], inst["tasks_timed"]),
            tasks_timed=inst["tasks_timed"], median_s=median,
            suspect_failures=cfg.suspect_failures, slow_factor=cfg.slow_factor)

    def _may_create_train_task(self, open_train: int,
                               demands: dict[str, demand.Demand] | None = None) -> bool:
        """Whether one more train task may be created with ``open_train`` already open: under
        ``max_inflight_tasks``, and some policy whose queue plus expected samples is under both
        ``max_buffered_samples`` and its demand cap (``demands``: :meth:`lease_demand`)."""
        cfg = self.config
        if open_train >= cfg.max_inflight_tasks:
            return False
        if cfg.mode == "sync":
            return self._round_needs_tasks()
        expected = open_train * cfg.group_size
        demands = demands or {}
        return any(len(q) + expected < cfg.max_buffered_samples
                   and (m not in demands
                        or demands[m].wants_task(len(q), open_train, cfg.group_size))
                   for m, q in self.queues.items())

    def lease_demand(self) -> dict[str, demand.Demand]:
        """Per policy, what its trainers consume and the most outstanding samples (queued plus
        expected from open train tasks) worth generating for it (:mod:`astralight.dataflow.demand`):
        ``lease_demand_versions`` (null: ``max_staleness + 1``; 0, the default: none) versions
        of its measured consumption, never below its largest pull. Call with the lock held."""
        cfg = self.config
        versions = cfg.demand_versions() if cfg.mode == "async" else 0.0
        out = {}
        for m in self.model_ids:
            current = self.versions[m]
            counters = self.store.version_counters(m, since=max(0, current - demand.WINDOW))
            out[m] = demand.policy_demand(counters, current, versions,
                                          cfg.trainer_samples_per_version.get(m),
                                          self.largest_pull[m])
        return out

    def _round(self) -> int | None:
        """Sync mode: the current round (the version every policy has published), or None while
        some trainer is still training the previous round."""
        versions = set(self.versions.values())
        return versions.pop() if len(versions) == 1 else None

    def _round_needs_tasks(self) -> bool:
        """Sync mode: does some policy still lack samples of this round, counting what the
        round's open tasks will deliver?"""
        rnd = self._round()
        if rnd is None:
            return False
        open_round = sum(1 for r in self.store.open_task_payloads("train")  # incl. this call's
                         if decode(bytes(r["payload"])).min_versions.get(self.primary) == rnd)
        expected = open_round * self.config.group_size
        for m in self.model_ids:  # samples_accepted at version rnd: this round's (older: dropped)
            accepted = self.store.version_counters(m, since=rnd).get(rnd, {}).get(
                "samples_accepted", 0)
            if accepted + expected < self.config.sync_batch_size:
                return True
        return False

    def _create_train_task(self, now: float):
        """Draw the next prompt the curators accept and store it as a train task.

        Every rejected prompt is counted (``prompts_skipped``) and the source moves on; after
        ``curator_max_skips`` consecutive rejections the next prompt goes through anyway
        (``prompts_forced``), so a curator that rejects everything slows the stream, never stops it.
        """
        cursor = int(self.store.get_meta("source_cursor", 0))
        version = self.versions[self.primary]
        while True:
            prompt = self.source.get(cursor % len(self.source))
            if all(c.should_submit(prompt, version) for c in self.curators):
                break
            if self._skip_run >= self.max_skips:
                log.warning("curators rejected %d prompts in a row; submitting %s anyway "
                            "(curator_max_skips)", self._skip_run, prompt.prompt_id)
                for m in self.model_ids:
                    self._bump(m, "prompts_forced")
                break
            self._skip_run += 1
            cursor += 1
            for m in self.model_ids:
                self._bump(m, "prompts_skipped")
        self._skip_run = 0
        task = Task(task_id=f"train:{cursor}", prompt=prompt.prompt, n=self.config.group_size,
                    model_ids=list(self.model_ids), workflow=self.config.workflow, kind="train",
                    metadata=dict(prompt.metadata))
        if self.config.mode == "sync":
            task.min_versions = dict(self.versions)
        self.store.insert_task(task.task_id, "train", task.model_ids, encode(task), now,
                               prompt_index=cursor)
        self.store.set_meta("source_cursor", cursor + 1)
        for m in self.model_ids:
            self._bump(m, "prompts_submitted")
        return self.store.task(task.task_id)

    def _issue(self, row, instance_id: str, deadline: float, now: float) -> Task:
        task: Task = decode(bytes(row["payload"]))
        task.lease_deadline = deadline
        expired = row["state"] == "leased"  # leasable and leased: its deadline passed
        if expired and row["instance_id"]:  # before mark_leased overwrites the holder
            self.store.instance_failed(row["instance_id"])
        self.store.mark_leased(row["task_id"], instance_id, deadline, now)
        prefix = "eval_" if row["kind"] == "eval" else ""
        name = "tasks_reissued" if row["lease_count"] > 0 else "tasks_issued"
        for m in json.loads(row["model_ids"]):
            self._bump(m, prefix + name)
        if row["lease_count"] > 0:
            log.info("re-issued %s to %s (%s)", row["task_id"], instance_id,
                     f"lease {row['lease_count']} of {row['instance_id']} expired" if expired
                     else f"returned by {row['instance_id']}")
        return task

    def push(self, instance_id: str, task_id: str, samples: list[Sample],
             now: float | None = None) -> dict:
        """Accept a task's samples once; later pushes of the same task are ignored (duplicate).

        The first push is a task done by the pusher (its fail streak reset); when the pusher held
        the lease, its lease->push seconds count as its busy time and, for an eval task, as eval
        time of the policies at their current versions (``eval_task_ms``, the balance report)."""
        with self.lock:
            self._instance(instance_id)
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
            self._validate_samples(row, model_ids, samples, instance_id)
            _group_stats(samples)
            entries: list[QueueEntry] = []
            outcome = None
            with self.store.tx():
                if row["kind"] == "eval":  # scored, never queued for training
                    self._record_eval(row, samples, now)
                else:
                    kept, outcome = self._filter_groups(row, samples)
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
                    journal_seq = self._journal("outcome", asdict(outcome))
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
                self._maybe_save_plugin_state(now)
            # committed: only now does the in-memory state follow
            if row["kind"] == "train":
                self.open_train -= 1
            for e in entries:
                self.queues[e.sample.model_id].push(e)
            if outcome is not None:
                for curator in self.curators:
                    curator.update(outcome)
                if journal_seq is not None:
                    self._journal_applied = journal_seq
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

    def _filter_groups(self, row, samples: list[Sample]) -> tuple[set[int], PromptOutcome]:
        """Run the sample filters over each policy's group; returns the ids (``id()``) of the
        kept samples and the outcome the curators learn from (rewards before filtering)."""
        groups: dict[str, list[Sample]] = defaultdict(list)
        for s in samples:
            groups[s.model_id].append(s)
        kept: set[int] = set()
        kept_groups: dict[str, bool] = {}
        for m, group in groups.items():
            survivors = group
            for f in self.sample_filters:
                if survivors and f.applies_to(m):
                    survivors = f.select(survivors)
            kept.update(id(s) for s in survivors)
            kept_groups[m] = bool(survivors)
        index = int(row["prompt_index"]) % len(self.source)
        outcome = PromptOutcome(prompt_id=self.source.get(index).prompt_id, prompt_index=index,
                                version=self.versions[self.primary],
                                rewards={m: [float(s.reward) for s in g] for m, g in groups.items()},
                                kept=kept_groups)
        return kept, outcome

    def _validate_samples(self, row, model_ids: list[str], samples: list[Sample],
                          instance_id: str = "") -> None:
        """Refuse (422 naming ``samples[i].<field>``) a push whose samples the trainer could
        not train on correctly; one bad sample refuses the whole push (the task stays open and
        the RaaS hands it back as failed). Per sample, besides its task, model_id and index:

        * token ids in ``[0, vocab)`` and at most ``max_model_len`` tokens
          (:meth:`_sample_limits`: the config's ``vocab_sizes``, else what the RaaS engines
          registered; ids below ``MAX_VOCAB_SIZE`` when no vocabulary is known);
        * no token of a version newer than the policy's current one -- on *any* token, masked
          or not (a sample claiming a future version would never go stale);
        * at least one loss-masked token: a sample with none has nothing to train on, and its
          staleness could not be measured. Such a sample is **refused**, not dropped (a workflow
          should not emit it);
        * behaviour log-probs >= ``LOGPROB_FLOOR`` (no engine samples a less likely token);
        * metadata the trainer reads (:func:`astralight.protocol.check_sample_metadata`): on a
          train task a sampling temperature that matches ``temperatures`` of the config.
        """
        limit = decode(bytes(row["payload"])).n * len(model_ids) * self.config.max_samples_per_rollout
        if not samples:
            raise ServiceError(422, "samples", "must hold at least one sample")
        if len(samples) > limit:
            raise ServiceError(422, "samples", f"{len(samples)} samples for one task exceeds "
                                               f"n * len(model_ids) * max_samples_per_rollout = {limit}")
        seen = set()
        limits: dict[str, tuple] = {}
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise ServiceError(422, f"samples[{i}]", "expected a Sample")
            if s.task_id != row["task_id"]:
                raise ServiceError(422, f"samples[{i}].task_id",
                                   f"{s.task_id!r} does not match the pushed task {row['task_id']!r}")
            if s.model_id not in model_ids:
                raise ServiceError(422, f"samples[{i}].model_id",
                                   f"unknown model_id {s.model_id!r}; task serves {model_ids}")
            key = (s.model_id, s.sample_index)
            if key in seen:
                raise ServiceError(422, f"samples[{i}].sample_index",
                                   f"sample_index {s.sample_index} of {s.model_id!r} repeats")
            seen.add(key)
            if s.model_id not in limits:  # once per policy and push, not per sample
                limits[s.model_id] = self._sample_limits(instance_id, s.model_id)
            self._validate_sample(i, s, limits[s.model_id], train=row["kind"] == "train")

    def _validate_sample(self, i: int, s: Sample, limits: tuple, train: bool) -> None:
        """One sample's checks (see :meth:`_validate_samples`); ``limits``: its policy's
        :meth:`_sample_limits` for the pushing instance."""
        at = f"samples[{i}]"
        vocab, vsrc, max_len, lsrc = limits
        ids = s.token_ids
        if max_len is not None and ids.size > max_len:
            raise ServiceError(422, f"{at}.token_ids", (
                f"{ids.size} tokens exceed max_model_len={max_len} of {s.model_id!r} ({lsrc}); "
                "no engine of this policy can produce it: trim the sample in the workflow, or "
                "register the engine's real max_model_len"))
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ServiceError(422, f"{at}.token_ids", (
                f"token ids must lie in [0, {vocab}) of {s.model_id!r} ({vsrc}); got "
                f"{int(ids.min())}..{int(ids.max())}: the sample was tokenized for another model"))
        current = self.versions[s.model_id]
        if s.versions.size and int(s.versions.max()) > current:
            raise ServiceError(422, f"{at}.versions", (
                f"version {int(s.versions.max())} is newer than the published version {current} "
                f"of {s.model_id!r}; every token's version must be a published one (or -1 for "
                "prompt and environment tokens)"))
        mask = s.loss_mask.astype(bool)
        if not mask.any():
            raise ServiceError(422, f"{at}.loss_mask", (
                "has no trained token (all 0): the sample carries nothing to learn and no "
                "version to measure its staleness by; do not push samples without generated "
                "tokens (e.g. an empty completion)"))
        if s.logprobs.size and float(s.logprobs.min()) < LOGPROB_FLOOR:
            raise ServiceError(422, f"{at}.logprobs", (
                f"log-prob {float(s.logprobs.min()):g} is below LOGPROB_FLOOR={LOGPROB_FLOOR:g}: "
                "no engine samples a token that unlikely; send the engine's behaviour log-prob "
                "of each generated token (0 on prompt and environment tokens)"))
        try:
            check_sample_metadata(s.metadata, at, self.config.temperatures.get(s.model_id),
                                  trained=train)
        except ProtocolError as exc:
            raise ServiceError(422, exc.field, exc.message) from None

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
            replay_stale = pool.drop_stale(version)
            n_replay = min(int(size * self.config.replay.ratio), len(pool))
            chosen, dropped = queue.take(size - n_replay, version)
            replayed: list[ReplayEntry] = []
            exhausted: list[ReplayEntry] = []
            if chosen is not None and n_replay:
                replayed, more_stale, exhausted = pool.draw(n_replay, version, self.replay_selectors)
                replay_stale += more_stale
                if len(replayed) < n_replay:  # a selector narrowed too far: fresh fills the rest
                    queue_more, dropped_more = queue.take(n_replay - len(replayed), version)
                    dropped += dropped_more
                    if queue_more is None:
                        for e in chosen:
                            queue.push(e)
                        chosen = None
                    else:
                        chosen += queue_more
            if chosen is None and not dropped and not replay_stale:
                return None
            batch_id = uuid.uuid4().hex
            try:
                with self.store.tx():
                    self._record_stale(model_id, dropped)
                    self._bump(model_id, "replay_stale_dropped", len(replay_stale))
                    if chosen is not None:
                        self.store.insert_batch(batch_id, model_id, trainer_id, version, size,
                                                time.time())
                        self.store.set_sample_state([e.sample_id for e in chosen], "served",
                                                    batch_id)
                        self.store.insert_replays(batch_id, [e.sample_id for e in replayed])
                        self._bump(model_id, "samples_served", len(chosen))
                        self._bump(model_id, "replay_served", len(replayed))
                        self._bump(model_id, "replay_exhausted", len(exhausted))
                        self._bump(model_id, "batches_served")
            except BaseException:
                for e in (chosen or []) + dropped:  # the store was not changed: neither is the queue
                    queue.push(e)
                for e in replayed:  # nor the replay pool (uses back to what they were)
                    e.uses -= 1
                    if any(e is x for x in exhausted):
                        pool.add(e)
                raise
            if chosen is None:
                return None
            return Batch(batch_id=batch_id, model_id=model_id, policy_version=version,
                         samples=[e.sample for e in chosen] + [e.sample for e in replayed])

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
                out.update(late=True, taken_back=sum(r["state"] == "queued" for r in rows),
                           trained_twice=twice)
                if twice:
                    out["warning"] = (
                        f"batch {batch_id} was acked after batch_ack_timeout_s="
                        f"{self.config.batch_ack_timeout_s:g} s had re-queued it, and {twice} of "
                        f"its {row['n']} samples had meanwhile been served again in another batch:"
                        " they are trained twice (counted as samples_trained_twice). Was the "
                        "trainer frozen? Its keep-alive extends a batch while the trainer lives.")
                    log.warning("late ack of batch %s of %s (trainer %s): %d of its %d samples had "
                                "been served again in another batch and are trained twice",
                                batch_id, mid, row["trainer_id"], twice, row["n"])
                else:
                    log.warning("late ack of re-queued batch %s of %s (trainer %s): its %d "
                                "samples were still queued and are taken back", batch_id, mid,
                                row["trainer_id"], len(ids))
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
        pool, version = self.replay_pools[model_id], self.versions[model_id]
        evicted: list[ReplayEntry] = []
        added = 0
        for r in rows:
            if version - r["min_version"] > self.config.replay.max_staleness:
                continue  # could never be replayed: not worth a place in the pool
            evicted += pool.add(ReplayEntry(r["id"], r["min_version"], decode(bytes(r["blob"])),
                                            added_version=version))
            added += 1
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
        self._check_version_jump(model_id, version, "version")

    def _check_version_jump(self, model_id: str, version: int, field: str) -> None:
        """422 naming ``field`` when ``version`` is more than ``max_version_jump`` above the
        current version of ``model_id``: one such publication would make every queued sample
        stale and every later publication of the trainer 409, for as long as the trainer
        needs to count up to it."""
        current, jump = self.versions[model_id], self.config.max_version_jump
        if version > current + jump:
            raise ServiceError(422, field, (
                f"version {version} of {model_id!r} is {version - current} above the current "
                f"version {current}, more than max_version_jump={jump}; publish versions "
                f"{current + 1}..{current + jump} (a WeightPublisher numbers them optimizer_steps "
                "// every_n_steps), or raise max_version_jump in the dataflow config for a "
                "trainer resumed from a checkpoint far ahead of this state folder"))

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
        by at most ``max_version_jump`` at a time (:meth:`_check_version_jump`)."""
        mid = self._model(manifest.model_id, "manifest.model_id")
        with self.lock:
            current = self.versions[mid]
            if manifest.version <= current:
                raise ServiceError(409, "manifest.version",
                                   f"version {manifest.version} of {mid!r} is not newer than the "
                                   f"current version {current}; versions only move forward")
            self._check_version_jump(mid, manifest.version, "manifest.version")
            if manifest.kind == "delta" and manifest.base_version > current:
                raise ServiceError(422, "manifest.base_version",
                                   f"base version {manifest.base_version} is not published "
                                   f"(current {current})")
            stored = {v for v, _, _ in self.weight_index[mid]}
            if manifest.kind == "delta" and manifest.base_version > 0 and \
                    manifest.base_version not in stored:
                raise ServiceError(422, "manifest.base_version",
                                   f"base version {manifest.base_version} is not stored (never "
                                   "published, or garbage-collected); publish a full version")
            if not manifest.files:
                raise ServiceError(422, "manifest.files", "must list at least one file")
            for name, info in manifest.files.items():
                field = f"manifest.files[{name[:80]}]"
                check_file_name(name, field)
                got = self.weights.sha256(mid, manifest.version, name, field)
                if got is None:
                    raise ServiceError(422, field, f"was not uploaded; PUT it to /v1/weights/{mid}/"
                                                   f"{manifest.version}/{name} first")
                if got[0] != info["sha256"]:
                    raise ServiceError(422, f"{field}.sha256",
                                       f"uploaded file has sha256 {got[0]}, manifest says {info['sha256']}")
                if info.get("bytes") is not None and info["bytes"] != got[1]:
                    raise ServiceError(422, f"{field}.bytes",
                                       f"uploaded file has {got[1]} bytes, manifest says {info['bytes']}")
            now = time.time()
            manifest.created = manifest.created or now
            journal_seq = None
            with self.store.tx():
                self.store.insert_version(mid, manifest.version, encode(manifest), now)
                n_evals = self._maybe_schedule_eval(mid, manifest.version, now, previous=current)
                if mid == self.primary:
                    journal_seq = self._journal("version", {"version": manifest.version})
            self.versions[mid] = manifest.version
            self.weight_index[mid].append((manifest.version, manifest.kind, now))
            dropped = self.queues[mid].drop_stale(manifest.version)
            replay_stale = self.replay_pools[mid].drop_stale(manifest.version)
            if mid == self.primary:
                for curator in self.curators:
                    curator.on_version(manifest.version)
                if journal_seq is not None:
                    self._journal_applied = journal_seq
            with self.store.tx():
                self._record_stale(mid, dropped)
                self._bump(mid, "replay_stale_dropped", len(replay_stale))
                if mid == self.primary:
                    self._save_plugin_state(now)
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

    def _keep_from(self, model_id: str, now: float) -> int | None:
        """Oldest version to keep: the newest full version published at least weights_keep_s
        ago. Every sync that started within the grace period planned a chain at or above it (the
        latest full version at that time, or a delta chain onto a version it held above it)."""
        cutoff = now - self.config.weights_keep_s
        fulls = [v for v, kind, t in self.weight_index[model_id] if kind == "full" and t <= cutoff]
        return max(fulls) if fulls else None

    def _collect_weights(self, now: float) -> list[Path]:
        """Under the lock: forget old versions (one transaction), detach their folders and
        those of uploads that can no longer be published; return the folders to purge."""
        if not self.config.weights_gc:
            return []
        trash: list[Path] = []
        for mid in self.model_ids:
            index = self.weight_index[mid]
            keep_from = self._keep_from(mid, now)
            old = [v for v, _, _ in index if keep_from is not None and v < keep_from]
            if old:
                with self.store.tx():
                    self.store.delete_versions(mid, old)
                    self._bump(mid, "weight_versions_removed", len(old))
                self.weight_index[mid] = [e for e in index if e[0] >= keep_from]
                log.info("weight GC: removed %s versions %d..%d (keeping %d.. since a full version)",
                         mid, old[0], old[-1], keep_from)
            listed = {v for v, _, _ in self.weight_index[mid]}
            # a folder of an unpublished version <= current can never be published (409)
            orphans = [v for v in self.weights.stored_versions(mid)
                       if v not in listed and v <= self.versions[mid]]
            for v in old + orphans:
                path = self.weights.detach(mid, v)
                if path is not None:
                    trash.append(path)
        self._gc_next = self._next_collection(now)
        return trash

    def _next_collection(self, now: float) -> float:
        """When a full version's grace period ends with older versions still stored."""
        due = float("inf")
        for index in self.weight_index.values():
            if not index:
                continue
            oldest = index[0][0]
            for v, kind, t in index:
                if kind == "full" and v > oldest and t + self.config.weights_keep_s > now:
                    due = min(due, t + self.config.weights_keep_s)
        return due

    def gc_due(self, now: float | None = None) -> bool:
        """Cheap check for the service's sweeper: would :meth:`gc_weights` remove something?"""
        return self.config.weights_gc and (time.time() if now is None else now) >= self._gc_next

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
            index = self.weight_index[model_id]
            if blob is None and version is not None and index and version < index[0][0]:
                fulls = [v for v, kind, _ in index if kind == "full"]
                raise ServiceError(404, "version", (
                    f"version {version} of {model_id!r} was garbage-collected; the store keeps "
                    f"versions {index[0][0]}..{index[-1][0]} (latest full: "
                    f"{fulls[-1] if fulls else 'none'}): start from GET /v1/manifest/{model_id}/latest"))
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

    def instance_status(self, idle_s: float, state: str = membership.ACTIVE,
                        fail_streak: int = 0) -> str:
        """:func:`membership.status` with this service's lease period and failure threshold."""
        return membership.status(state, idle_s, fail_streak, self.config.lease_seconds,
                                 self.config.suspect_failures)

    def _instance_table(self, now: float) -> list[dict]:
        """Registered RaaS instances (:func:`membership.instance_table`): capacity, state and
        status, held leases, task and sample counts, share of the samples pushed."""
        table = membership.instance_table(self.store.instances(), now,
                                          self.store.held_leases(now), self.config.lease_seconds,
                                          self.config.suspect_failures)
        for row in table:
            row["reported"] = dict(self.instance_stats.get(row["instance_id"], {}))
        return table

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
            table = self._instance_table(now)
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
                index = self.weight_index[m]
                fulls = [v for v, kind, _ in index if kind == "full"]
                c.update(queue_depth=len(self.queues[m]), replay_pool=len(self.replay_pools[m]),
                         current_version=self.versions[m],
                         batches_outstanding=outstanding.get(m, 0),
                         weight_versions_stored=len(index),
                         weight_oldest_version=index[0][0] if index else None,
                         weight_latest_full=fulls[-1] if fulls else None)
                models[m] = c
            for m, d in self.lease_demand().items():
                models[m]["lease_demand"] = asdict(d)
            instances = self._instance_table(now)
            plugins = {name: {"class": type(p).__name__, "metrics": p.metrics()}
                       for name, p in self.named_plugins().items()}
            return {"time": now, "models": models, "instances": instances, "plugins": plugins,
                    "durability": self.store.durability.counters(),
                    "tasks": {"open_train": self.open_train,
                              "open_eval": self.store.count_open_tasks("eval"),
                              "source_cursor": int(self.store.get_meta("source_cursor", 0))}}


def _group_stats(samples: list[Sample]) -> None:
    """Group-normalised advantages per (model_id, role) within one task: (r - mean) / (std + eps).

    One policy may play several roles in a workflow (a self-verifying solver); its answers and
    its verdicts are rewarded on different scales, so each role is its own group.
    """
    groups: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.model_id, s.role].append(s)
    for group in groups.values():
        rewards = np.array([s.reward for s in group], dtype=np.float64)
        mean, std = float(rewards.mean()), float(rewards.std())
        for s in group:
            s.group_mean, s.group_std = mean, std
            s.advantage = (s.reward - mean) / (std + ADV_EPS)


