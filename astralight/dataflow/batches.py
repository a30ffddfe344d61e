"""Batch serving: how a batch is drawn from a policy's fresh queue and replay pool, undone when
its transaction fails, and what a late ack answers.

Plain functions over the in-memory queue and pool; the :class:`~astralight.dataflow.core.Dataflow`
facade records the result in the store (in one transaction) and counts it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from astralight.dataflow.plugins import DataPlugin
from astralight.dataflow.queues import FreshQueue, QueueEntry
from astralight.dataflow.replay import ReplayEntry, ReplayPool
from astralight.protocol import decode

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


def make_replayable(pool: ReplayPool, rows, version: int, max_staleness: int
                    ) -> tuple[int, list[ReplayEntry]]:
    """Add the trained fresh samples of an acked batch (its sample ``rows``) to the replay
    pool, skipping those that could never be replayed at ``version``; returns how many were
    added and what the pool evicted beyond its size."""
    evicted: list[ReplayEntry] = []
    added = 0
    for r in rows:
        if version - r["min_version"] > max_staleness:
            continue  # could never be replayed: not worth a place in the pool
        evicted += pool.add(ReplayEntry(r["id"], r["min_version"], decode(bytes(r["blob"])),
                                        added_version=version))
        added += 1
    return added, evicted


def late_ack_report(row, rows, twice: int, acked: int, timeout_s: float) -> dict:
    """What the answer to a late ack adds (the batch ``row`` was re-queued; ``rows``: its
    samples still served or queued, ``twice``: those served again meanwhile), logged too."""
    batch_id, mid = row["batch_id"], row["model_id"]
    out = {"late": True, "taken_back": sum(r["state"] == "queued" for r in rows),
           "trained_twice": twice}
    if twice:
        out["warning"] = (
            f"batch {batch_id} was acked after batch_ack_timeout_s="
            f"{timeout_s:g} s had re-queued it, and {twice} of "
            f"its {row['n']} samples had meanwhile been served again in another batch:"
            " they are trained twice (counted as samples_trained_twice). Was the "
            "trainer frozen? Its keep-alive extends a batch while the trainer lives.")
        log.warning("late ack of batch %s of %s (trainer %s): %d of its %d samples had "
                    "been served again in another batch and are trained twice",
                    batch_id, mid, row["trainer_id"], twice, row["n"])
    else:
        log.warning("late ack of re-queued batch %s of %s (trainer %s): its %d "
                    "samples were still queued and are taken back", batch_id, mid,
                    row["trainer_id"], acked)
    return out
