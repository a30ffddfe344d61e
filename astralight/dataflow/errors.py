"""The error types of the dataflow core: a refused request, and a state folder it cannot serve.

:class:`ServiceError` is what the core raises for a request it refuses; the HTTP layer turns it
into ``status`` with a JSON body ``{"error", "field"}`` so a client sees which field was wrong
and what to do about it; nothing else is special-cased. :class:`StateDirError` is what opening
the state raises when the service must not start on it (damaged, lost commits, full or
unwritable): a ``ValueError``, so ``astralight dataflow serve`` prints it as its one error line
and exits with status 2, like any other configuration problem.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses: ``status`` (4xx; 503 when the state cannot be made
    durable; 507 when the state folder or the weight store cannot store it), the offending
    ``field`` and why. ``logged``: the service already logged the cause (a storage fault is
    logged once per episode, :mod:`astralight.dataflow.storage_faults`), so the HTTP layer does
    not log each refusal again."""

    def __init__(self, status: int, field: str, message: str, logged: bool = False):
        super().__init__(f"{field}: {message}")
        self.status = status
        self.field = field
        self.message = message
        self.logged = logged


class StateDirError(ValueError):
    """The state folder cannot be served: its database is damaged, lost committed transactions,
    or cannot be written. The message is one line naming ``state_dir`` and what to do."""
