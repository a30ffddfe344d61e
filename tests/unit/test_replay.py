"""Replay pool and selectors: staleness never exceeded, capacity and use limits honoured, every
entry accounted for, selector chains only narrow/reorder. Hand-worked cases plus hypothesis."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astralight.dataflow.replay import (HighVariance, Latest, ReplayEntry, ReplayPool,
                                        ReplaySelector, Uniform)
from astralight.protocol import Sample


def entry(sid: int, min_version: int = 0, std: float = 0.0, adv: float = 0.0,
          added: int | None = None) -> ReplayEntry:
    s = Sample(task_id=f"t{sid}", sample_index=0, model_id="policy",
               token_ids=np.array([5, 6], np.int32), logprobs=np.array([0, -1], np.float32),
               loss_mask=np.array([0, 1], np.uint8), versions=np.array([-1, min_version], np.int32),
               reward=0.0, advantage=adv, group_std=std)
    assert s.min_version == min_version
    return ReplayEntry(sid, min_version, s, min_version if added is None else added)


def ids(entries) -> list[int]:
    return [e.sample_id for e in entries]


# -- pool, hand-worked ---------------------------------------------------------------------------

def test_add_evicts_oldest_sample_id_beyond_capacity():
    pool = ReplayPool(capacity=3, max_staleness=10)
    assert [pool.add(entry(i)) for i in (4, 2, 7)] == [[], [], []]
    assert ids(pool.add(entry(9))) == [2]
    assert ids(pool.entries()) == [4, 7, 9] and len(pool) == 3
    assert ids(pool.add(entry(1))) == [1]  # an older newcomer is itself the oldest
    with pytest.raises(ValueError, match="sample_id 4"):
        pool.add(entry(4))


def test_drop_stale_bound_is_inclusive():
    pool = ReplayPool(capacity=10, max_staleness=2)
    for sid, v in [(1, 0), (2, 1), (3, 2), (4, 3)]:
        pool.add(entry(sid, v))
    assert ids(pool.drop_stale(3)) == [1]  # 3-0 > 2; 3-1 == 2 stays
    chosen, stale, exhausted = pool.draw(10, 4, [])
    assert ids(stale) == [2] and ids(chosen) == [3, 4] and exhausted == []


def test_max_uses_exhausts_entries_and_returns_them_in_chosen_too():
    pool = ReplayPool(capacity=10, max_staleness=10, max_uses=2)
    for i in range(3):
        pool.add(entry(i))
    c1, _, x1 = pool.draw(2, 0, [])  # oldest first without selectors
    assert ids(c1) == [0, 1] and x1 == [] and [e.uses for e in pool.entries()] == [1, 1, 0]
    c2, _, x2 = pool.draw(2, 0, [])
    assert ids(c2) == [0, 1] and ids(x2) == [0, 1] and ids(pool.entries()) == [2]
    assert all(e.uses == 2 for e in x2)


def test_unlimited_uses_and_empty_draws():
    pool = ReplayPool(capacity=2, max_staleness=0)
    pool.add(entry(1))
    for _ in range(5):
        assert ids(pool.draw(1, 0, [Uniform()])[0]) == [1]
    assert pool.entries()[0].uses == 5
    assert pool.draw(0, 0, [Latest()]) == ([], [], [])
    chosen, stale, _ = pool.draw(3, 1, [Latest()])
    assert chosen == [] and ids(stale) == [1] and len(pool) == 0


def test_a_selector_that_invents_or_repeats_entries_is_an_error():
    class Inventor(ReplaySelector):
        def select(self, candidates, k, version):
            return candidates + [entry(99)]

    class Repeater(ReplaySelector):
        def select(self, candidates, k, version):
            return candidates[:1] * 2

    pool = ReplayPool(capacity=4, max_staleness=4)
    pool.add(entry(1))
    pool.add(entry(2))
    for bad in (Inventor(), Repeater()):
        with pytest.raises(ValueError, match=type(bad).__name__):
            pool.draw(2, 0, [bad])
    with pytest.raises(ValueError, match="Inventor"):  # a later selector can't resurrect either
        pool.draw(2, 0, [Latest(), HighVariance(top_fraction=0.5), Inventor()])


@pytest.mark.parametrize("kwargs,field", [({"capacity": -1, "max_staleness": 0}, "capacity"),
                                          ({"capacity": 1, "max_staleness": -1}, "max_staleness"),
                                          ({"capacity": 1, "max_staleness": 0, "max_uses": 1.5},
                                           "max_uses")])
def test_pool_rejects_bad_args(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ReplayPool(**kwargs)


# -- selectors, hand-worked ------------------------------------------------------------------------

def test_latest_is_newest_first():
    cands = [entry(i) for i in (1, 5, 3)]
    assert ids(Latest().select(cands, 2, 0)) == [5, 3, 1]


def test_high_variance_orders_by_std_then_advantage_then_newest_and_keeps_the_top_share():
    cands = [entry(1, std=0.5, adv=0.1), entry(2, std=0.9, adv=0.2), entry(3, std=0.5, adv=-0.8),
             entry(4, std=0.5, adv=0.1), entry(5, std=0.0)]
    assert ids(HighVariance().select(cands, 1, 0)) == [2, 3, 4, 1, 5]
    assert ids(HighVariance(top_fraction=0.5).select(cands, 1, 0)) == [2, 3, 4]  # ceil(2.5)
    assert ids(HighVariance(top_fraction=0.2).select(cands, 2, 0)) == [2, 3]  # at least k
    with pytest.raises(ValueError, match="top_fraction"):
        HighVariance(top_fraction=0.0)


def test_uniform_is_a_seeded_permutation():
    cands = [entry(i) for i in range(20)]
    a, b = Uniform(), Uniform()
    a.rng, b.rng = np.random.default_rng(4), np.random.default_rng(4)
    pa, pb = a.select(cands, 5, 0), b.select(cands, 5, 0)
    assert ids(pa) == ids(pb) and sorted(ids(pa)) == list(range(20)) and ids(pa) != list(range(20))


# -- properties ------------------------------------------------------------------------------------

selector_st = st.one_of(st.just("latest"), st.just("uniform"),
                        st.floats(0.05, 1.0).map(lambda f: ("high_variance", f)))


def build(spec, seed: int) -> ReplaySelector:
    if spec == "latest":
        return Latest()
    if spec == "uniform":
        sel = Uniform()
        sel.rng = np.random.default_rng(seed)
        return sel
    return HighVariance(top_fraction=spec[1])


op_st = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 4), st.floats(0, 1), st.floats(-2, 2)),
    st.tuples(st.just("draw"), st.integers(0, 6)),
    st.tuples(st.just("version"), st.integers(1, 3)),
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(0, 6), max_staleness=st.integers(0, 3), max_uses=st.integers(0, 3),
       chain=st.lists(selector_st, max_size=3), ops=st.lists(op_st, max_size=60),
       seed=st.integers(0, 2**16))
def test_pool_invariants_under_random_operations(capacity, max_staleness, max_uses, chain, ops,
                                                 seed):
    pool = ReplayPool(capacity, max_staleness, max_uses)
    selectors = [build(s, seed) for s in chain]
    version, next_id = 0, 0
    added, gone = set(), set()
    for op in ops:
        if op[0] == "version":
            version += op[1]
        elif op[0] == "add":
            # a sample generated up to 4 versions before it entered the pool
            e = entry(next_id, max(0, version - op[1]), std=op[2], adv=op[3], added=version)
            next_id += 1
            added.add(e.sample_id)
            evicted = pool.add(e)
            assert ids(evicted) == sorted(ids(evicted))
            gone |= set(ids(evicted))
        else:
            k = op[1]
            before = {e.sample_id: e.uses for e in pool.entries()}
            chosen, stale, exhausted = pool.draw(k, version, selectors)
            assert len(chosen) <= k and len(set(ids(chosen))) == len(chosen)
            assert set(ids(chosen)) <= set(before) and set(ids(stale)) <= set(before)
            for e in chosen:
                assert version - e.min_version <= max_staleness  # never serve a stale entry
                assert e.uses == before[e.sample_id] + 1
            for e in stale:
                assert version - e.min_version > max_staleness
            assert not set(ids(chosen)) & set(ids(stale))
            assert set(ids(exhausted)) <= set(ids(chosen))
            if k and len(before) - len(stale) >= k:
                assert len(chosen) == k  # a full draw whenever enough fresh entries exist
            gone |= set(ids(stale)) | set(ids(exhausted))
        assert len(pool) <= capacity
        assert all(e.uses < max_uses for e in pool.entries()) if max_uses else True
        # nothing lost silently: every entry is either in the pool or returned exactly once
        assert set(ids(pool.entries())) | gone == added
        assert not set(ids(pool.entries())) & gone


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 30), k=st.integers(0, 10), chain=st.lists(selector_st, min_size=1,
       max_size=4), seed=st.integers(0, 2**16), data=st.data())
def test_selector_chains_only_narrow_or_reorder(n, k, chain, seed, data):
    cands = [entry(i, std=data.draw(st.floats(0, 1)), adv=data.draw(st.floats(-3, 3)))
             for i in range(n)]
    out = cands
    for spec in chain:
        out = build(spec, seed).select(out, k, 0)
        assert len({id(e) for e in out}) == len(out)
        assert {id(e) for e in out} <= {id(e) for e in cands}
        assert len(out) >= min(k, n)  # never narrows below what the pool needs
