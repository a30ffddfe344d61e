"""Fresh queues: FIFO and EDF order, composed and custom orders, staleness drops returned for
counting, exactly-size batches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astralight.dataflow.queues import Edf, Fifo, FreshQueue, Freshest, QueueEntry, QueueOrder
from astralight.protocol import Sample


def entry(sample_id: int, version: int) -> QueueEntry:
    s = Sample(task_id=f"t{sample_id}", sample_index=0, model_id="policy",
               token_ids=np.array([5, 6, 7], np.int32), logprobs=np.array([0, -1, -1], np.float32),
               loss_mask=np.array([0, 1, 1], np.uint8),
               versions=np.array([-1, version, version + 1], np.int32), reward=0.0)
    assert s.min_version == version
    return QueueEntry(sample_id, s.min_version, s)


def ids(batch) -> list[int]:
    return [e.sample_id for e in batch]


def test_fifo_serves_in_ingest_order():
    q = FreshQueue("fifo", max_staleness=10)
    for sid, v in [(1, 3), (2, 0), (3, 2), (4, 1)]:
        q.push(entry(sid, v))
    batch, dropped = q.take(2, current_version=3)
    assert ids(batch) == [1, 2] and dropped == []
    batch, _ = q.take(2, current_version=3)
    assert ids(batch) == [3, 4] and len(q) == 0


def test_edf_serves_oldest_behaviour_version_first_ties_by_ingest():
    q = FreshQueue("edf", max_staleness=10)
    for sid, v in [(1, 3), (2, 0), (3, 2), (4, 0), (5, 1)]:
        q.push(entry(sid, v))
    assert q.peek_order() == [2, 4, 5, 3, 1]
    batch, _ = q.take(3, current_version=3)
    assert ids(batch) == [2, 4, 5]


def test_freshest_serves_the_newest_behaviour_version_first_and_lets_the_old_expire():
    q = FreshQueue("freshest", max_staleness=2)
    for sid, v in [(1, 3), (2, 1), (3, 2), (4, 3), (5, 1)]:
        q.push(entry(sid, v))
    assert q.peek_order() == [1, 4, 3, 2, 5]  # ties by ingest order
    batch, dropped = q.take(2, current_version=3)
    assert ids(batch) == [1, 4] and dropped == []
    # two versions on, what was left from version 1 is too stale: dropped and returned
    batch, dropped = q.take(1, current_version=4)
    assert ids(batch) == [3] and ids(dropped) == [2, 5] and len(q) == 0
    assert isinstance(FreshQueue(Freshest()).orders[0], Freshest)


def test_requeued_sample_returns_to_its_place():
    q = FreshQueue("fifo", max_staleness=10)
    for sid in (1, 2, 3):
        q.push(entry(sid, 0))
    batch, _ = q.take(1, 0)
    q.push(batch[0])  # an un-acked batch comes back
    assert q.peek_order() == [1, 2, 3]


def test_staleness_drops_are_returned_for_counting():
    q = FreshQueue("fifo", max_staleness=2)
    for sid, v in [(1, 0), (2, 1), (3, 2), (4, 3)]:
        q.push(entry(sid, v))
    # current 3: 3-0=3 > 2 is stale; 3-1=2 is still fresh (the bound is inclusive)
    batch, dropped = q.take(2, current_version=3)
    assert ids(dropped) == [1]
    assert ids(batch) == [2, 3] and ids(q.take(1, 3)[0]) == [4]


def test_not_enough_fresh_samples_serves_nothing_but_still_drops_stale():
    q = FreshQueue("edf", max_staleness=1)
    for sid, v in [(1, 0), (2, 5), (3, 5)]:
        q.push(entry(sid, v))
    batch, dropped = q.take(3, current_version=5)
    assert batch is None and ids(dropped) == [1]
    assert len(q) == 2  # the fresh ones stay queued, in order
    batch, dropped = q.take(2, current_version=5)
    assert ids(batch) == [2, 3] and dropped == []


@pytest.mark.parametrize("order", ["fifo", "edf", "freshest"])
def test_batches_have_exactly_size_samples(order):
    q = FreshQueue(order, max_staleness=0)
    for sid in range(10):
        q.push(entry(sid, 0))
    sizes = []
    while True:
        batch, _ = q.take(4, current_version=0)
        if batch is None:
            break
        sizes.append(len(batch))
    assert sizes == [4, 4] and len(q) == 2


def test_remove_and_bad_arguments():
    q = FreshQueue("fifo", 1)
    q.push(entry(1, 0))
    q.push(entry(2, 0))
    assert ids(q.remove([2, 99])) == [2] and 2 not in q and 1 in q
    with pytest.raises(ValueError, match="size"):
        q.take(0, 0)
    with pytest.raises(ValueError, match="queue_order"):
        FreshQueue("lifo")
    with pytest.raises(ValueError, match="max_staleness"):
        FreshQueue("fifo", -1)


class NewestFirst(QueueOrder):
    """A custom order: the newest behaviour version first (a plugin a user could write)."""

    def key(self, e: QueueEntry) -> tuple:
        return (-e.min_version,)


def test_orders_compose_lexicographically_and_custom_orders_plug_in():
    q = FreshQueue([NewestFirst(), Fifo()], max_staleness=10)
    for sid, v in [(1, 3), (2, 0), (3, 3), (4, 1)]:
        q.push(entry(sid, v))
    assert q.peek_order() == [1, 3, 4, 2]
    q = FreshQueue([Edf(), NewestFirst()], max_staleness=10)  # first key decides, ties by ingest
    for sid, v in [(1, 3), (2, 0), (3, 3), (4, 0)]:
        q.push(entry(sid, v))
    assert q.peek_order() == [2, 4, 1, 3]
    with pytest.raises(ValueError, match="queue_order"):
        FreshQueue([], max_staleness=1)
    with pytest.raises(ValueError, match="queue_order"):
        FreshQueue("lifo", max_staleness=1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 4)), min_size=1, max_size=40),
       st.integers(0, 3))
def test_edf_never_serves_beyond_max_staleness(ops, max_staleness):
    """Random ingest/version/take sequences: every served entry is within max_staleness."""
    q = FreshQueue("edf", max_staleness=max_staleness)
    version, sid = 0, 0
    for gen_back, size in ops:
        sid += 1
        q.push(entry(sid, max(0, version - gen_back % (max_staleness + 3))))
        if sid % 3 == 0:
            version += 1
        batch, dropped = q.take(size, current_version=version)
        assert all(version - e.min_version > max_staleness for e in dropped)
        for e in batch or []:
            assert version - e.min_version <= max_staleness
        if batch:
            assert [e.min_version for e in batch] == sorted(e.min_version for e in batch)
