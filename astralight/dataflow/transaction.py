"""What one SQLite transaction of the dataflow changes in memory, and when.

SQLite is the truth; the service's in-memory structures (fresh queues, replay pools, current
versions, the curators, the instance limits, counts of open tasks) are caches of it. They may
follow a transaction only once it committed: a request that fails half-way, or whose commit
fails, must leave them as they were. :class:`Transaction` makes that structural. Code running
inside :meth:`Store.tx <astralight.dataflow.store.Store.tx>` does not mutate them; it registers
the change with :meth:`Transaction.after_commit`, and the store runs the registered actions, in
order, only after ``COMMIT`` succeeded (a rollback drops them).

A few decisions need the in-memory change while the transaction is open: a pull takes its batch
out of the queue to record it, a publication drops the samples the new version made stale. Such
a change registers its inverse with :meth:`Transaction.on_rollback`, which the store runs, newest
first, when the transaction rolls back, its commit included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Action = tuple[Callable[..., Any], tuple[Any, ...]]


class Transaction:
    """The actions one open transaction registered; the store runs them (:meth:`committed`
    after ``COMMIT``, :meth:`rolled_back` after ``ROLLBACK``)."""

    def __init__(self):
        self._after: list[Action] = []
        self._undo: list[Action] = []
        self.done = False

    def after_commit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` once this transaction committed (never if it rolls back)."""
        if self.done:
            raise RuntimeError("the transaction is over: change the in-memory state directly")
        self._after.append((fn, args))

    def on_rollback(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` if this transaction rolls back: the inverse of an in-memory change
        made while it was open."""
        if self.done:
            raise RuntimeError("the transaction is over: nothing can roll it back")
        self._undo.append((fn, args))

    def committed(self) -> None:
        """The commit succeeded: run the after-commit actions in the order registered."""
        self.done = True
        actions, self._after, self._undo = self._after, [], []
        for fn, args in actions:
            fn(*args)

    def rolled_back(self) -> None:
        """The transaction rolled back: drop the after-commit actions, undo newest first."""
        self.done = True
        undo, self._after, self._undo = self._undo, [], []
        for fn, args in reversed(undo):
            fn(*args)
