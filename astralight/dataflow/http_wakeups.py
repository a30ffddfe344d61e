"""Wake-ups of long-polling pulls: ``POST /v1/pull`` waits on its model_id's event, which
pushes, re-queued batches and shutdown set."""

from __future__ import annotations

import asyncio


class Wakeups:
    """Wakes long-polling pulls of a model_id when samples arrive (one event per generation)."""

    def __init__(self, model_ids: list[str]):
        self._events = {m: asyncio.Event() for m in model_ids}
        self.stopping = False  # set from the SIGTERM path; waiters re-check it every second

    def event(self, model_id: str) -> asyncio.Event:
        return self._events[model_id]

    def notify(self, model_ids) -> None:
        for m in model_ids:
            if m in self._events:
                ev, self._events[m] = self._events[m], asyncio.Event()
                ev.set()
