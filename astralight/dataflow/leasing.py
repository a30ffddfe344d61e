"""Task creation and leasing: which train tasks to create, and handing tasks out.

New train tasks are drawn from the prompt source only while the fresh queues and open tasks
leave room (``max_inflight_tasks``, ``max_buffered_samples``, each policy's demand cap, and in
sync mode the round's sample count) and the curators accept the prompt; :meth:`TaskLeasing.issue`
leases a stored task to an instance and :meth:`TaskLeasing.lease` answers one lease request.
Call every method with the service's lock held; those that write do so inside the caller's
transaction, or in their own where they say so.
"""

from __future__ import annotations

import logging

from astralight.dataflow import demand
from astralight.dataflow.parts import Part, Shared
from astralight.dataflow.plugin_state import PluginState
from astralight.dataflow.rows import InstanceRow, TaskRow
from astralight.dataflow.transaction import Transaction
from astralight.protocol import Task, encode
from astralight.tasks.base import PromptSource

log = logging.getLogger("astralight.dataflow")

#: the generic curator safety valve never scans more than this many prompts for one task
MAX_CURATOR_SKIPS = 10_000


class TaskLeasing(Part):
    """Creates train tasks from ``source`` and leases stored tasks; ``largest_pull`` is the
    service's own (read, never replaced)."""

    def __init__(self, shared: Shared, source: PromptSource, plugin_state: PluginState,
                 largest_pull: dict[str, int]):
        super().__init__(shared)
        self.source = source
        self.plugin_state = plugin_state
        self.largest_pull = largest_pull
        self.max_skips = min(self.config.curator_max_skips or len(source), MAX_CURATOR_SKIPS)
        #: train tasks created and not done yet (mirrors SQLite)
        self.open_train = self.store.count_open_tasks("train")

    def count_open(self, delta: int) -> None:
        """After a commit that created (``delta > 0``) or finished (``< 0``) train tasks."""
        self.open_train += delta

    def lease(self, inst: InstanceRow, max_tasks: int, now: float) -> list[Task]:
        """In its own transaction: lease ``inst`` up to ``max_tasks`` (its allowance):
        returned, expired or pending eval tasks, then train tasks, then new ones while
        :meth:`may_create` allows."""
        served = set(inst.model_ids)
        deadline = now + self.config.lease_seconds
        out: list[Task] = []
        demands = self.demands() if max_tasks else {}
        with self.store.tx() as tx:
            for kind in ("eval", "train"):
                if len(out) >= max_tasks:
                    break
                for row in self.store.leasable_tasks(kind, now):
                    if len(out) >= max_tasks:
                        break
                    if set(row.model_ids) <= served:
                        out.append(self.issue(row, inst.instance_id, deadline, now))
            created = 0
            while (len(out) < max_tasks and set(self.model_ids) <= served
                   and self.may_create(self.open_train + created, demands)):
                # a run of rejections ends with each task created (in memory: at the commit)
                row = self.create_train_task(tx, now, skip_run=0 if created else None)
                created += 1
                out.append(self.issue(row, inst.instance_id, deadline, now))
            self.store.touch_instance(inst.instance_id, now, leased=len(out))
            if created:
                self.plugin_state.maybe_save(tx, now)
                tx.after_commit(self.count_open, created)
        return out

    def may_create(self, open_train: int,
                   demands: dict[str, demand.Demand] | None = None) -> bool:
        """Whether one more train task may be created with ``open_train`` already open: under
        ``max_inflight_tasks``, and some policy whose queue plus expected samples is under both
        ``max_buffered_samples`` and its demand cap (``demands``: :meth:`demands`)."""
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

    def demands(self) -> dict[str, demand.Demand]:
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
        open_round = sum(1 for t in self.store.open_tasks("train")  # incl. this call's
                         if t.min_versions.get(self.primary) == rnd)
        expected = open_round * self.config.group_size
        for m in self.model_ids:  # samples_accepted at version rnd: this round's (older: dropped)
            accepted = self.store.version_counters(m, since=rnd).get(rnd, {}).get(
                "samples_accepted", 0)
            if accepted + expected < self.config.sync_batch_size:
                return True
        return False

    def create_train_task(self, tx: Transaction, now: float,
                          skip_run: int | None = None) -> TaskRow:
        """Inside the caller's transaction ``tx``: draw the next prompt the curators accept and
        store it as a train task.

        Every rejected prompt is counted (``prompts_skipped``) and the source moves on; after
        ``curator_max_skips`` consecutive rejections the next prompt goes through anyway
        (``prompts_forced``), so a curator that rejects everything slows the stream, never stops it.
        The run of rejections continues from ``skip_run`` (None: the one stored with the
        plugin state) and ends, ``skip_run`` back to 0, with the commit.
        """
        cursor = int(self.store.get_meta("source_cursor", 0))
        version = self.versions[self.primary]
        skip_run = self.plugin_state.skip_run if skip_run is None else skip_run
        while True:
            prompt = self.source.get(cursor % len(self.source))
            if all(c.should_submit(prompt, version) for c in self.plugin_state.curators):
                break
            if skip_run >= self.max_skips:
                log.warning("curators rejected %d prompts in a row; submitting %s anyway "
                            "(curator_max_skips)", skip_run, prompt.prompt_id)
                for m in self.model_ids:
                    self.bump(m, "prompts_forced")
                break
            skip_run += 1
            cursor += 1
            for m in self.model_ids:
                self.bump(m, "prompts_skipped")
        tx.after_commit(self.plugin_state.reset_skip_run)
        task = Task(task_id=f"train:{cursor}", prompt=prompt.prompt, n=self.config.group_size,
                    model_ids=list(self.model_ids), workflow=self.config.workflow, kind="train",
                    metadata=dict(prompt.metadata))
        if self.config.mode == "sync":
            task.min_versions = dict(self.versions)
        self.store.insert_task(task.task_id, "train", task.model_ids, encode(task), now,
                               prompt_index=cursor)
        self.store.set_meta("source_cursor", cursor + 1)
        for m in self.model_ids:
            self.bump(m, "prompts_submitted")
        return self.store.task(task.task_id)

    def issue(self, row: TaskRow, instance_id: str, deadline: float, now: float) -> Task:
        """Inside the caller's transaction: lease the task of ``row`` to ``instance_id`` until
        ``deadline``; an expired lease counts as a failure of the instance that held it."""
        task = row.task()
        task.lease_deadline = deadline
        expired = row.state == "leased"  # leasable and leased: its deadline passed
        if expired and row.instance_id:  # before mark_leased overwrites the holder
            self.store.instance_failed(row.instance_id)
        self.store.mark_leased(row.task_id, instance_id, deadline, now)
        prefix = "eval_" if row.kind == "eval" else ""
        name = "tasks_reissued" if row.lease_count > 0 else "tasks_issued"
        for m in row.model_ids:
            self.bump(m, prefix + name)
        if row.lease_count > 0:
            log.info("re-issued %s to %s (%s)", row.task_id, instance_id,
                     f"lease {row.lease_count} of {row.instance_id} expired" if expired
                     else f"returned by {row.instance_id}")
        return task
