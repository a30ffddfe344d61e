"""What the parts of the dataflow service share, and the base they are built on.

The :class:`~astralight.dataflow.core.Dataflow` facade owns one :class:`Shared`: the store, the
config, and per policy its current version, fresh queue and replay pool, plus the counter. Each
part (the pool, task leasing, ingest, batch serving, evals, publication) is a :class:`Part` over
it: it reads those structures and changes them only through a transaction
(:mod:`astralight.dataflow.transaction`), so no part holds a copy that could drift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.queues import FreshQueue
from astralight.dataflow.replay import ReplayPool
from astralight.dataflow.store import Store


@dataclass
class Shared:
    """The service's own structures (never replaced, only changed in place); ``bump`` counts
    an event for a model_id (:meth:`Dataflow._bump`)."""

    store: Store
    config: DataflowConfig
    versions: dict[str, int]
    queues: dict[str, FreshQueue]
    replay_pools: dict[str, ReplayPool]
    bump: Callable[..., None]


class Part:
    """A part of the service over ``shared``; the first model_id is the primary policy (the
    one the curators follow)."""

    def __init__(self, shared: Shared):
        self.store = shared.store
        self.config = shared.config
        self.versions = shared.versions
        self.queues = shared.queues
        self.replay_pools = shared.replay_pools
        self.bump = shared.bump
        self.model_ids = list(shared.config.model_ids)
        self.primary = self.model_ids[0]
