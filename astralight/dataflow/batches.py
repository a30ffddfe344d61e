"""Batch serving: how a batch is drawn from a policy's fresh queue and replay pool, undone when
its transaction fails, acked, kept alive, re-queued when its ack is overdue, and what a late ack
answers.

The drawing and undoing are plain functions over the in-memory queue and pool;
:class:`BatchServing` records each step in the store, in one transaction, counts it, and changes
the queues and pools only through the transaction (:mod:`astralight.dataflow.transaction`).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from astralight.dataflow.errors import ServiceError
from astralight.dataflow.parts import Part, Shared
from astralight.dataflow.plugins import DataPlugin
from astralight.dataflow.queues import FreshQueue, QueueEntry
from astralight.dataflow.replay import ReplayEntry, ReplayPool
from astralight.dataflow.rows import BatchRow, SampleRow
from astralight.dataflow.transaction import Transaction
from astralight.protocol import Batch

log = logging.getLogger("astralight.dataflow")


@dataclass
class Draw:
    """What one pull took: ``chosen`` fresh entries (None: the queue could not fill the batch),
    fresh entries found stale (``dropped``), replayed ones, replay entries found stale, and
    replayed ones used up (``exhausted``: they left the pool)."""

    chosen: list[QueueEntry] | None
    dropped: list[QueueEntry]
    replayed: list[ReplayEntry] = field(default_factory=list)
    replay_stale: list[ReplayEntry] = field(default_factory=list)
    exhausted: list[ReplayEntry] = field(default_factory=list)


def draw(queue: FreshQueue, pool: ReplayPool, size: int, ratio: float, version: int,
         selectors: list[DataPlugin]) -> Draw:
    """Take ``size`` samples: ``floor(size * ratio)`` from the replay pool (as many as it holds
    that are fresh enough), the rest from the fresh queue; when the selectors leave the replay
    share short, fresh samples fill the rest. Nothing is chosen unless the fresh queue can
    fill its share (the entries it took go back)."""
    replay_stale = pool.drop_stale(version)
    n_replay = min(int(size * ratio), len(pool))
    chosen, dropped = queue.take(size - n_replay, version)
    out = Draw(chosen, dropped, replay_stale=replay_stale)
    if chosen is not None and n_replay:
        out.replayed, more_stale, out.exhausted = pool.draw(n_replay, version, selectors)
        out.replay_stale += more_stale
        if len(out.replayed) < n_replay:  # a selector narrowed too far: fresh fills the rest
            queue_more, dropped_more = queue.take(n_replay - len(out.replayed), version)
            out.dropped += dropped_more
            if queue_more is None:
                for e in chosen:
                    queue.push(e)
                out.chosen = None
            else:
                out.chosen = chosen + queue_more
    return out


def undo(queue: FreshQueue, pool: ReplayPool, taken: Draw) -> None:
    """The store was not changed: put the queue and the pool back as they were."""
    for e in (taken.chosen or []) + taken.dropped:
        queue.push(e)
    for e in taken.replayed:  # uses back to what they were
        e.uses -= 1
        if any(e is x for x in taken.exhausted):
            pool.add(e)


def replayable(rows: list[SampleRow], version: int, max_staleness: int) -> list[ReplayEntry]:
    """The replay entries of the trained fresh samples of an acked batch (its sample ``rows``),
    without those that could never be replayed at ``version``."""
    return [ReplayEntry(r.id, r.min_version, r.sample(), added_version=version)
            for r in rows if version - r.min_version <= max_staleness]


def add_all(pool: ReplayPool, entries: list[ReplayEntry]) -> None:
    for e in entries:
        pool.add(e)


def push_all(queue: FreshQueue, entries: list[QueueEntry]) -> None:
    for e in entries:
        queue.push(e)


def late_ack_report(row: BatchRow, rows: list[SampleRow], twice: int, acked: int,
                    timeout_s: float) -> dict:
    """What the answer to a late ack adds (the batch ``row`` was re-queued; ``rows``: its
    samples still served or queued, ``twice``: those served again meanwhile), logged too."""
    batch_id, mid = row.batch_id, row.model_id
    out = {"late": True, "taken_back": sum(r.state == "queued" for r in rows),
           "trained_twice": twice}
    if twice:
        out["warning"] = (
            f"batch {batch_id} was acked after batch_ack_timeout_s="
            f"{timeout_s:g} s had re-queued it, and {twice} of "
            f"its {row.n} samples had meanwhile been served again in another batch:"
            " they are trained twice (counted as samples_trained_twice). Was the "
            "trainer frozen? Its keep-alive extends a batch while the trainer lives.")
        log.warning("late ack of batch %s of %s (trainer %s): %d of its %d samples had "
                    "been served again in another batch and are trained twice",
                    batch_id, mid, row.trainer_id, twice, row.n)
    else:
        log.warning("late ack of re-queued batch %s of %s (trainer %s): its %d "
                    "samples were still queued and are taken back", batch_id, mid,
                    row.trainer_id, acked)
    return out


class BatchServing(Part):
    """The trainer side of the service: pulls (the replay ``selectors`` choosing what is
    replayed; ``largest_pull``, the service's own, recording the sizes), acks, keep-alives,
    rollbacks after a trainer's restart and the re-queueing of overdue batches. The queues and
    pools change only through each transaction. Call every method with the service's lock
    held; each writes in its own transaction."""

    def __init__(self, shared: Shared, selectors: list[DataPlugin],
                 largest_pull: dict[str, int]):
        super().__init__(shared)
        self.selectors = selectors
        self.largest_pull = largest_pull

    def restore(self) -> None:
        """At start: refill the fresh queues with the queued samples and, with replay on, each
        replay pool with the newest trained samples still replayable."""
        for row in self.store.queued_samples():
            queue = self.queues.get(row.model_id)
            if queue is None:
                log.warning("queued sample %d of model_id %r not in this config's model_ids; left in "
                            "the store", row.id, row.model_id)
                continue
            queue.push(QueueEntry(row.id, row.min_version, row.sample()))
        rp = self.config.replay
        if rp.ratio <= 0:
            return
        for m, pool in self.replay_pools.items():
            rows = self.store.replay_candidates(m, self.versions[m] - rp.max_staleness, rp.pool_size)
            for r in reversed(rows):  # oldest first, as they entered the pool
                if rp.max_uses and r.uses >= rp.max_uses:
                    continue
                pool.add(ReplayEntry(r.id, r.min_version, r.sample(),
                                     added_version=self.versions[m], uses=int(r.uses)))
            if len(pool):
                log.info("replay pool of %s: %d samples restored", m, len(pool))

    def pull(self, model_id: str, size: int, trainer_id: str | None) -> Batch | None:
        """Serve exactly ``size`` samples as a recorded batch, or None (:meth:`Dataflow.pull`);
        what the draw took goes back if the transaction fails."""
        self.largest_pull[model_id] = max(self.largest_pull[model_id], size)
        version = self.versions[model_id]
        queue, pool = self.queues[model_id], self.replay_pools[model_id]
        tx = Transaction()
        taken = draw(queue, pool, size, self.config.replay.ratio, version, self.selectors)
        chosen = taken.chosen
        if chosen is None and not taken.dropped and not taken.replay_stale:
            return None  # nothing was taken
        tx.on_rollback(undo, queue, pool, taken)  # the store was not changed: neither are they
        batch_id = uuid.uuid4().hex
        with self.store.tx(tx):
            self.record_stale(model_id, taken.dropped)
            self.bump(model_id, "replay_stale_dropped", len(taken.replay_stale))
            if chosen is not None:
                self.store.insert_batch(batch_id, model_id, trainer_id, version, size,
                                        time.time())
                self.store.set_sample_state([e.sample_id for e in chosen], "served", batch_id)
                self.store.insert_replays(batch_id, [e.sample_id for e in taken.replayed])
                self.bump(model_id, "samples_served", len(chosen))
                self.bump(model_id, "replay_served", len(taken.replayed))
                self.bump(model_id, "replay_exhausted", len(taken.exhausted))
                self.bump(model_id, "batches_served")
        if chosen is None:
            return None
        return Batch(batch_id=batch_id, model_id=model_id, policy_version=version,
                     samples=[e.sample for e in chosen] + [e.sample for e in taken.replayed])

    def record_stale(self, model_id: str, dropped: list[QueueEntry]) -> None:
        """Inside the caller's transaction: mark and count fresh samples dropped as stale."""
        if dropped:
            self.store.set_sample_state([e.sample_id for e in dropped], "stale")
            self.bump(model_id, "stale_dropped", len(dropped))
            log.info("dropped %d stale samples of %s (current version %d, max_staleness %d)",
                     len(dropped), model_id, self.versions[model_id], self.config.max_staleness)

    def ack(self, batch_id: str, wait_s: float | None, step_s: float | None,
            step: int | None) -> dict:
        """Mark a batch trained (:meth:`Dataflow.ack`): its samples acked, counted, replayable;
        a late ack takes back what is still queued and reports what was trained twice."""
        row = self.store.batch(batch_id)
        if row is None:
            raise ServiceError(404, "batch_id", f"unknown batch {batch_id!r}")
        if row.state == "acked":
            return {"acked": True, "already": True}
        mid = row.model_id
        late = row.state == "requeued"
        rows = self.store.batch_samples(batch_id, ("served", "queued"))
        ids = [r.id for r in rows]
        # a re-serve is the only way a sample leaves this batch's id (stale drops keep it)
        twice = max(0, row.n - self.store.batch_member_count(batch_id)
                    - self.store.replay_count(batch_id)) if late else 0
        with self.store.tx() as tx:
            self.store.set_sample_state(ids, "acked")
            self.store.set_batch_state(batch_id, "acked", time.time())
            if step is not None:
                self.store.set_acked_step(batch_id, step)
            n_replayed = self.store.set_replay_state(batch_id, "acked")
            self.bump(mid, "samples_acked", len(ids))
            self.bump(mid, "samples_trained", len(ids) + n_replayed)
            self.bump(mid, "batches_acked")
            if late:
                self.bump(mid, "late_acks")
            if twice:
                self.bump(mid, "late_acks_after_reserve")
                self.bump(mid, "samples_trained_twice", twice)
            if wait_s is not None and step_s is not None and mid in self.queues:
                self.bump(mid, "trainer_wait_ms", round(1000 * wait_s))
                self.bump(mid, "trainer_step_ms", round(1000 * step_s))
                self.bump(mid, "trainer_steps_timed")
            evicted = 0
            if mid in self.queues:
                evicted = self._make_replayable(tx, mid, rows)
                tx.after_commit(self.queues[mid].remove,
                                [r.id for r in rows if r.state == "queued"])
        out = {"acked": True, "already": False, "samples": len(ids) + n_replayed,
               "replay_evicted": evicted}
        if late:
            out.update(late_ack_report(row, rows, twice, len(ids),
                                       self.config.batch_ack_timeout_s))
        return out

    def _make_replayable(self, tx: Transaction, model_id: str, rows: list[SampleRow]) -> int:
        """Inside the ack's transaction: trained fresh samples become replayable (counted; in
        the pool after the commit); the pool evicts its oldest beyond ``replay.pool_size``
        (counted). Returns how many it evicts."""
        if self.config.replay.ratio <= 0:
            return 0
        pool = self.replay_pools[model_id]
        entries = replayable(rows, self.versions[model_id], self.config.replay.max_staleness)
        evicted = pool.evictions(len(entries))
        self.bump(model_id, "replay_added", len(entries))
        self.bump(model_id, "replay_evicted", evicted)
        tx.after_commit(add_all, pool, entries)
        return evicted

    def trainer_resumed(self, model_id: str, step: int, now: float) -> dict:
        """Mark the batches ``model_id`` acked after optimizer step ``step`` rolled back
        (:meth:`Dataflow.trainer_resumed`)."""
        with self.store.tx():
            rows = self.store.roll_back_batches(model_id, step, now)
            samples = sum(int(r.n) for r in rows)
            if rows:
                self.bump(model_id, "batches_rolled_back", len(rows))
                self.bump(model_id, "samples_rolled_back", samples)
        if rows:
            log.warning("%s resumed at step %d: %d batches (%d samples) acked after that step were "
                        "trained into weights the restart discarded (counted as rolled back): %s",
                        model_id, step, len(rows), samples, [r.batch_id for r in rows][:8])
        return {"model_id": model_id, "step": step, "batches_rolled_back": len(rows),
                "samples_rolled_back": samples}

    def extend(self, batch_id: str, now: float) -> dict:
        """Keep-alive of a served batch (:meth:`Dataflow.extend_batch`); 404 unknown, 409 acked
        or re-queued."""
        timeout = self.config.batch_ack_timeout_s
        row = self.store.batch(batch_id)
        if row is None:
            raise ServiceError(404, "batch_id", f"unknown batch {batch_id!r}")
        if row.state == "acked":
            raise ServiceError(409, "batch_id", f"batch {batch_id} is already acknowledged; "
                                                "there is nothing to keep alive")
        if row.state != "served":
            raise ServiceError(409, "batch_id", (
                f"batch {batch_id} was re-queued: it was neither acked nor extended within "
                f"batch_ack_timeout_s={timeout:g} s (was the trainer frozen?), so its samples "
                "may be served again; it can no longer be extended. Ack it once trained "
                "(the ack reports samples trained twice)"))
        with self.store.tx():
            self.store.renew_batch(batch_id, now)
            self.bump(row.model_id, "batches_extended")
        return {"batch_id": batch_id, "extended": True, "deadline_s": timeout,
                "batch_ack_timeout_s": timeout}

    def requeue_expired(self, now: float) -> set[str]:
        """Put the samples of batches not acked within ``batch_ack_timeout_s`` back in their
        queues, one transaction per batch (:meth:`Dataflow.requeue_expired_batches`); returns
        the model_ids that got samples."""
        woken: set[str] = set()
        for batch in self.store.batches_served_before(now - self.config.batch_ack_timeout_s):
            mid = batch.model_id
            rows = self.store.batch_samples(batch.batch_id, ("served",))
            with self.store.tx() as tx:
                self.store.set_sample_state([r.id for r in rows], "queued")
                self.store.set_batch_state(batch.batch_id, "requeued")
                self.store.set_replay_state(batch.batch_id, "requeued")
                self.bump(mid, "batches_requeued")
                self.bump(mid, "samples_requeued", len(rows))
                if mid in self.queues:
                    tx.after_commit(push_all, self.queues[mid],
                                    [QueueEntry(r.id, r.min_version, r.sample()) for r in rows])
            if mid in self.queues:
                woken.add(mid)
            log.warning("batch %s of %s not acked within %.0f s: %d samples re-queued",
                        batch.batch_id, mid, self.config.batch_ack_timeout_s, len(rows))
        return woken
