"""Wake-ups of long polls: ``POST /v1/pull`` waits on its model_id's event, which pushes,
re-queued batches and shutdown set; ``POST /v1/lease`` with ``wait_s`` waits on the room event,
which everything that may let a lease grant tasks sets (a pull served, a push accepted, tasks
returned, a batch acked, a version published, an instance gone).

Events are set on the service's event loop only (the routes call :meth:`notify` and
:meth:`notify_room` after their threadpool work returns). A waiter takes its event *before* it
tries, so a wake-up between its try and its wait is not missed; it re-checks at least every second
anyway (a lease may also expire, which nothing announces).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request


class Wakeups:
    """Wakes long-polling pulls of a model_id when samples arrive (one event per generation),
    and long-polling leases when room may have opened."""

    def __init__(self, model_ids: list[str]):
        self._events = {m: asyncio.Event() for m in model_ids}
        self._room = asyncio.Event()
        self.stopping = False  # set from the SIGTERM path; waiters re-check it every second

    def event(self, model_id: str) -> asyncio.Event:
        return self._events[model_id]

    def room(self) -> asyncio.Event:
        """The event the next :meth:`notify_room` sets."""
        return self._room

    def notify(self, model_ids) -> None:
        """Samples of ``model_ids`` arrived (or were re-queued)."""
        for m in model_ids:
            if m in self._events:
                ev, self._events[m] = self._events[m], asyncio.Event()
                ev.set()

    def notify_room(self, *_: object) -> None:
        """A lease may now grant tasks. (Extra arguments are ignored, so it can follow any
        route's result.)"""
        ev, self._room = self._room, asyncio.Event()
        ev.set()

    async def long_poll(self, request: Request, event: Callable[[], asyncio.Event],
                        attempt: Callable[[], Any], done: Callable[[Any], bool],
                        wait_s: float) -> Any:
        """``attempt()`` (in the thread pool) until ``done(result)``, ``wait_s`` has passed, the
        service stops or the caller went away; between two attempts wait for ``event()`` (taken
        before each attempt, so a wake-up during it is not missed) or one second. Returns the
        last result."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            ev = event()
            result = await run_in_threadpool(attempt)
            remaining = deadline - loop.time()
            if (done(result) or remaining <= 0 or self.stopping
                    or await request.is_disconnected()):
                return result
            try:
                await asyncio.wait_for(ev.wait(), timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass
