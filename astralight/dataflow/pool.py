"""The RaaS pool as the service holds it: the registered instances in the store, what each
registered as its limits and reported in its heartbeat, and what each may lease.

The pure membership rules (states, liveness, health, lease allowances, the instance table) are
in :mod:`astralight.dataflow.membership`; :class:`Pool` applies them to the stored instances.
Call its methods with the service's lock held; those that write do so inside the caller's
transaction.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from astralight.dataflow import membership
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.store import Store


class Pool:
    """The instances of ``store`` under the lease rules of ``config``."""

    def __init__(self, store: Store, config: DataflowConfig):
        self.store = store
        self.config = config
        #: what each instance's engines registered per model_id (``limits``; mirrors SQLite)
        self.instance_limits: dict[str, dict] = {
            r["instance_id"]: membership.stored_limits(r) for r in store.instances()}
        #: what each RaaS reported in its last heartbeat (``stats``): weight pauses, ...
        self.instance_stats: dict[str, dict] = {}

    def instance(self, instance_id: str):
        """The stored row of ``instance_id``; 404 when it never registered."""
        row = self.store.instance(instance_id)
        if row is None:
            raise ServiceError(404, "instance_id", f"unknown instance {instance_id!r}; "
                                                   "call register first")
        return row

    def check_vocab_agreement(self, instance_id: str, limits: dict, now: float) -> None:
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

    def limits(self, model_id: str) -> dict:
        """The effective limits of ``model_id`` over the whole pool (the config's vocab_sizes
        wins): ``{vocab_size, max_model_len}``, each None when nobody said."""
        pool = membership.pool_limits(model_id, self.instance_limits.values())
        vocab = self.config.vocab_sizes.get(model_id, pool.get("vocab_size"))
        return {"vocab_size": vocab, "max_model_len": pool.get("max_model_len")}

    def return_tasks(self, instance_id: str, task_ids: list[str] | None, now: float,
                     bump: Callable[[str, str], None]) -> int:
        """Inside the caller's transaction: return tasks (see :meth:`Store.return_tasks`) and
        count them per instance and, with ``bump``, per policy."""
        ids = self.store.return_tasks(instance_id, task_ids, now)
        if ids:
            self.store.instance_returned(instance_id, len(ids))
            for tid in ids:
                for m in json.loads(self.store.task(tid)["model_ids"]):
                    if m in self.config.model_ids:
                        bump(m, "tasks_returned")
        return len(ids)

    def allowance(self, inst, requested: int, now: float) -> int:
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

    def table(self, now: float) -> list[dict]:
        """Registered RaaS instances (:func:`membership.instance_table`): capacity, state and
        status, held leases, task and sample counts, share of the samples pushed."""
        table = membership.instance_table(self.store.instances(), now,
                                          self.store.held_leases(now), self.config.lease_seconds,
                                          self.config.suspect_failures)
        for row in table:
            row["reported"] = dict(self.instance_stats.get(row["instance_id"], {}))
        return table
