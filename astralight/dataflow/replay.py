"""Replay: the serving hook that mixes already-trained samples back into batches.

Samples that were served once go into a per-policy ``ReplayPool`` (bounded by ``capacity``, with
the oldest evicted first) and a ``replay_ratio`` share of each batch is drawn from it. Replay
reuses rollouts, which are the expensive part, but a replayed sample is off-policy, so the pool
enforces its own staleness bound and, optionally, a per-sample use limit. Which entries are
drawn is decided by a chain of ``ReplaySelector`` plugins. The pool is in memory; the service
persists the entries in SQLite and rebuilds the pool after a restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from astralight.dataflow.plugins import DataPlugin, check_range
from astralight.protocol import Sample


@dataclass
class ReplayEntry:
    sample_id: int
    min_version: int  # oldest policy version behind the sample's tokens (the staleness key)
    sample: Sample
    added_version: int  # policy version when it entered the pool
    uses: int = 0  # times served from the pool


class ReplaySelector(DataPlugin):
    """Base of replay selectors.

    ``select`` gets the candidates in preference order and returns them narrowed and/or
    reordered; it must not invent entries. Selectors chain (``out = sel.select(out, k,
    version)``) and the pool takes the first ``k`` of the last one's output.
    """

    def select(self, candidates: list[ReplayEntry], k: int, version: int) -> list[ReplayEntry]:
        return list(candidates)


class Latest(ReplaySelector):
    """Newest first: the least off-policy samples."""

    def select(self, candidates, k, version):
        return sorted(candidates, key=lambda e: e.sample_id, reverse=True)


class Uniform(ReplaySelector):
    """A seeded uniform permutation (``self.rng``): classic experience replay."""

    def select(self, candidates, k, version):
        return [candidates[i] for i in self.rng.permutation(len(candidates))]


class HighVariance(ReplaySelector):
    """Prefer samples from groups with the largest reward spread.

    Such groups carry the largest advantages, hence the most gradient signal per replayed token.
    Order: ``group_std`` descending, then ``|advantage|`` descending, then newest; keeps the first
    ``max(k, ceil(top_fraction * n))`` so a later selector (e.g. ``uniform``) can sample within
    the top share.
    """

    def __init__(self, top_fraction: float = 1.0):
        super().__init__()
        self.top_fraction = check_range("top_fraction", top_fraction, 0.0, 1.0, lo_open=True)

    def select(self, candidates, k, version):
        ranked = sorted(candidates, key=lambda e: (-e.sample.group_std, -abs(e.sample.advantage),
                                                   -e.sample_id))
        return ranked[:max(k, math.ceil(self.top_fraction * len(ranked)))]


class ReplayPool:
    """One policy's replay pool. ``max_uses=0`` means an entry may be replayed without limit."""

    def __init__(self, capacity: int, max_staleness: int, max_uses: int = 0):
        for name, value in (("capacity", capacity), ("max_staleness", max_staleness),
                            ("max_uses", max_uses)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.max_uses = max_uses
        self._entries: dict[int, ReplayEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[ReplayEntry]:
        """All entries, oldest ``sample_id`` first (diagnostics and tests)."""
        return [self._entries[i] for i in sorted(self._entries)]

    def add(self, entry: ReplayEntry) -> list[ReplayEntry]:
        """Add an entry; return the entries evicted (oldest ``sample_id`` first) beyond capacity."""
        if entry.sample_id in self._entries:
            raise ValueError(f"sample_id {entry.sample_id} is already in the replay pool")
        self._entries[entry.sample_id] = entry
        evicted = []
        while len(self._entries) > self.capacity:
            evicted.append(self._entries.pop(min(self._entries)))
        return evicted

    def evictions(self, n: int) -> int:
        """How many entries :meth:`add` of ``n`` new entries would evict, in all."""
        return max(0, len(self._entries) + n - self.capacity)

    def drop_stale(self, version: int) -> list[ReplayEntry]:
        """Remove and return (oldest first) the entries with
        ``version - min_version > max_staleness``."""
        stale = [e for e in self.entries() if version - e.min_version > self.max_staleness]
        for e in stale:
            del self._entries[e.sample_id]
        return stale

    def draw(self, k: int, version: int, selectors: list[ReplaySelector]
             ) -> tuple[list[ReplayEntry], list[ReplayEntry], list[ReplayEntry]]:
        """Draw up to ``k`` entries for policy version ``version``.

        Returns ``(chosen, stale_dropped, exhausted)``: stale entries are dropped first, so a
        chosen entry is never beyond ``max_staleness``; the selector chain then runs over the
        rest (oldest first); chosen entries get ``uses += 1`` and those reaching ``max_uses``
        leave the pool and are also returned as exhausted.
        """
        stale = self.drop_stale(version)
        if k <= 0 or not self._entries:
            return [], stale, []
        candidates = self.entries()
        allowed = {id(e) for e in candidates}
        out = candidates
        for sel in selectors:
            out = list(sel.select(out, k, version))
            seen = set()
            for e in out:
                if id(e) not in allowed or id(e) in seen:
                    raise ValueError(f"replay selector {type(sel).__name__} returned an entry that "
                                     f"is not a candidate or is repeated (sample_id "
                                     f"{getattr(e, 'sample_id', e)!r}); selectors may only narrow "
                                     f"or reorder their input")
                seen.add(id(e))
            allowed = seen
        chosen = out[:k]
        exhausted = []
        for e in chosen:
            e.uses += 1
            if self.max_uses and e.uses >= self.max_uses:
                del self._entries[e.sample_id]
                exhausted.append(e)
        return chosen, stale, exhausted
