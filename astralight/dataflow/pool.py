"""The RaaS pool as the service holds it: the registered instances in the store, what each
registered as its limits and reported in its heartbeat, and what each may lease; registering,
heartbeats, drains, returned tasks and leaving.

The pure membership rules (states, liveness, health, lease allowances, the instance table) are
in :mod:`astralight.dataflow.membership`; :class:`Pool` applies them to the stored instances.
Call its methods with the service's lock held; those that write do so in their own transaction
(and change the in-memory limits and stats only through it), or inside the caller's where they
say so.
"""

from __future__ import annotations

import logging
import uuid

from astralight.dataflow import membership
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.rows import InstanceRow
from astralight.dataflow.parts import Part, Shared

log = logging.getLogger("astralight.dataflow")


class Pool(Part):
    """The stored instances under the lease rules of the config."""

    def __init__(self, shared: Shared):
        super().__init__(shared)
        store = shared.store
        #: what each instance's engines registered per model_id (``limits``; mirrors SQLite)
        self.instance_limits: dict[str, dict] = {r.instance_id: r.limits
                                                 for r in store.instances()}
        #: what each RaaS reported in its last heartbeat (``stats``): weight pauses, ...
        self.instance_stats: dict[str, dict] = {}

    def instance(self, instance_id: str) -> InstanceRow:
        """The stored row of ``instance_id``; 404 when it never registered."""
        row = self.store.instance(instance_id)
        if row is None:
            raise ServiceError(404, "instance_id", f"unknown instance {instance_id!r}; "
                                                   "call register first")
        return row

    def check_vocab_agreement(self, instance_id: str, limits: dict, now: float) -> None:
        """Under the lock: refuse a registered vocabulary size that disagrees with the config's
        ``vocab_sizes`` or with another live instance's registration for the same model_id."""
        others = [(r.instance_id, self.instance_limits.get(r.instance_id, {}))
                  for r in self.store.instances()
                  if r.instance_id != instance_id
                  and membership.is_live(r.state, now - r.last_seen, self.config.lease_seconds)]
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

    def limits(self, model_id: str) -> dict:
        """The effective limits of ``model_id`` over the whole pool (the config's vocab_sizes
        wins): ``{vocab_size, max_model_len}``, each None when nobody said."""
        pool = membership.pool_limits(model_id, self.instance_limits.values())
        vocab = self.config.vocab_sizes.get(model_id, pool.get("vocab_size"))
        return {"vocab_size": vocab, "max_model_len": pool.get("max_model_len")}

    def register(self, model_ids: list[str], capacity: int, instance_id: str | None,
                 meta: dict, capacity_units: float, now: float, limits: dict | None) -> str:
        """Add an instance to the pool, or make a known one ``active`` again (after a restart of
        either side, a drain or a deregister) keeping its counters; returns its id.

        ``limits``: what the instance's engines can produce per model_id (``vocab_size``,
        ``max_model_len``; :func:`membership.check_limits`); pushed samples are checked against
        them (:func:`astralight.dataflow.ingest.sample_limits`). A vocabulary size that
        disagrees with ``vocab_sizes`` of the config, or with what another live instance
        registered for the same model_id, is refused (422 naming
        ``limits.<model_id>.vocab_size``): that RaaS serves another model.
        """
        if capacity < 0:
            raise ServiceError(422, "capacity", "must be >= 0")
        if not (isinstance(capacity_units, (int, float)) and 0 < capacity_units < 1e6):
            raise ServiceError(422, "capacity_units", f"must be > 0 (GPUs or CPU slots), got "
                                                      f"{capacity_units!r}")
        limits = membership.check_limits(limits, model_ids)
        instance_id = instance_id or f"raas-{uuid.uuid4().hex[:12]}"
        self.check_vocab_agreement(instance_id, limits, now)
        with self.store.tx() as tx:
            known = self.store.instance(instance_id) is not None
            self.store.upsert_instance(instance_id, model_ids, capacity, meta, now,
                                       float(capacity_units), self.config.lease_seconds,
                                       limits=limits)
            tx.after_commit(self.instance_limits.__setitem__, instance_id, limits)
        log.info("instance %s %s for %s (capacity %d, %g capacity units%s)", instance_id,
                 "registered again" if known else "registered", model_ids, capacity,
                 capacity_units, f", limits {limits}" if limits else "")
        return instance_id

    def heartbeat(self, instance_id: str, in_flight: int | None, now: float,
                  stats: dict | None) -> str:
        """Renew an instance (``in_flight``: the tasks it says it runs; ``stats``: its own
        figures, kept in memory after the commit); returns its state."""
        if in_flight is not None and in_flight < 0:
            raise ServiceError(422, "in_flight", f"must be >= 0 tasks, got {in_flight}")
        inst = self.instance(instance_id)
        with self.store.tx() as tx:
            self.store.touch_instance(instance_id, now)
            if in_flight is not None:
                self.store.set_reported_in_flight(instance_id, int(in_flight))
            if stats:
                tx.after_commit(self.instance_stats.__setitem__, instance_id, dict(stats))
        return inst.state

    def drain(self, instance_id: str, now: float) -> dict:
        """An ``active`` instance becomes ``draining`` (others keep their state); returns the
        state and the leases it still holds."""
        state = self.instance(instance_id).state
        if state == membership.ACTIVE:
            with self.store.tx():
                self.store.set_instance_state(instance_id, membership.DRAINING)
            state = membership.DRAINING
            log.info("instance %s draining", instance_id)
        held = self.store.held_leases(now, instance_id)[instance_id]
        return {"instance_id": instance_id, "state": state, "in_flight": held}

    def hand_back(self, instance_id: str, task_ids: list[str] | None, now: float,
                  failed: bool = False, leave: bool = False) -> int:
        """Tasks ``instance_id`` leased and did not push (all of them with ``task_ids=None``)
        become leasable at once; ``failed`` counts them against its health, ``leave`` makes it
        ``left``. Returns how many it handed back."""
        self.instance(instance_id)
        with self.store.tx():
            n = self._return_tasks(instance_id, task_ids, now)
            if failed and n:
                self.store.instance_failed(instance_id, n)
            self.store.touch_instance(instance_id, now)
            if leave:
                self.store.set_instance_state(instance_id, membership.LEFT, now)
        return n

    def _return_tasks(self, instance_id: str, task_ids: list[str] | None, now: float) -> int:
        """Inside the caller's transaction: return tasks (see :meth:`Store.return_tasks`) and
        count them per instance and per policy."""
        ids = self.store.return_tasks(instance_id, task_ids, now)
        if ids:
            self.store.instance_returned(instance_id, len(ids))
            for tid in ids:
                for m in self.store.task(tid).model_ids:
                    if m in self.config.model_ids:
                        self.bump(m, "tasks_returned")
        return len(ids)

    def allowance(self, inst: InstanceRow, requested: int, now: float) -> int:
        """How many of ``requested`` tasks the instance may lease now (see
        :func:`membership.lease_allowance`); the pool median is over the live instances."""
        if requested == 0 or inst.state != membership.ACTIVE:
            return 0
        cfg = self.config
        held = self.store.held_leases(now, inst.instance_id)[inst.instance_id]
        median = None
        if inst.tasks_timed >= membership.MIN_TIMED_TASKS:  # only then can it be slow
            median = membership.pool_median(
                (membership.mean_task_s(r.busy_s, r.tasks_timed), r.tasks_timed)
                for r in self.store.instances()
                if membership.is_live(r.state, now - r.last_seen, cfg.lease_seconds)
                or r.instance_id == inst.instance_id)
        return membership.lease_allowance(
            requested, capacity=inst.capacity, held=held, state=inst.state,
            fail_streak=inst.fail_streak,
            mean_s=membership.mean_task_s(inst.busy_s, inst.tasks_timed),
            tasks_timed=inst.tasks_timed, median_s=median,
            suspect_failures=cfg.suspect_failures, slow_factor=cfg.slow_factor)

    def table(self, now: float) -> list[dict]:
        """Registered RaaS instances (:func:`membership.instance_table`): capacity, state and
        status, held leases, task and sample counts, share of the samples pushed."""
        table = membership.instance_table(self.store.instances(), now,
                                          self.store.held_leases(now), self.config.lease_seconds,
                                          self.config.suspect_failures)
        for entry in table:
            entry["reported"] = dict(self.instance_stats.get(entry["instance_id"], {}))
        return table
