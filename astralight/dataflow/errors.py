"""The one error type the dataflow core raises for a bad request.

The HTTP layer turns it into ``status`` with a JSON body ``{"error", "field"}`` so a client
sees which field was wrong and what to do about it; nothing else is special-cased.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses: ``status`` (4xx; 503 when the state cannot be made
    durable), the offending ``field`` and why."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.status = status
        self.field = field
        self.message = message
