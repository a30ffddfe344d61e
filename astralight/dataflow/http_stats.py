"""Who calls the dataflow service and how often they fail: requests and 4xx/5xx answers per
client address and per ``instance_id`` named in a body, shown under ``clients`` /
``client_instances`` in ``/v1/stats``; a client's 1st, 10th, 100th... failure is logged.

:class:`ClientStats` (the outermost ASGI middleware) records every answer's status; handlers
add what they learned about the request -- the instance it names, the field it failed on --
with :func:`note_request`.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections import OrderedDict

log = logging.getLogger("astralight.dataflow")

#: per request: what the handlers learned about the caller (instance_id, failing field)
_REQUEST: contextvars.ContextVar[dict | None] = contextvars.ContextVar("astralight_request",
                                                                        default=None)


def note_request(**kw) -> None:
    """Tell :class:`ClientStats` about the current request (works from the thread pool too:
    the context is copied, the dict it holds is shared)."""
    info = _REQUEST.get()
    if info is not None:
        info.update(kw)


_LOG_AT = frozenset(10 ** k for k in range(13))  # log a client's 1st, 10th, 100th... failure


class _ClientEntry:
    """Counters of one client (an address or an instance_id)."""

    __slots__ = ("requests", "failures_4xx", "failures_5xx", "auth_failures", "first_seen",
                 "last_seen", "last_failure", "_buckets", "_stamps")

    def __init__(self, now: float):
        self.requests = self.failures_4xx = self.failures_5xx = self.auth_failures = 0
        self.first_seen = self.last_seen = now
        self.last_failure: dict | None = None
        self._buckets = [0] * 60  # failures per second over the last minute (a ring)
        self._stamps = [0] * 60

    def fail(self, now: float) -> None:
        sec = int(now)
        i = sec % 60
        if self._stamps[i] != sec:
            self._stamps[i], self._buckets[i] = sec, 0
        self._buckets[i] += 1

    def as_dict(self, now: float) -> dict:
        sec = int(now)
        recent = sum(b for b, t in zip(self._buckets, self._stamps) if sec - t < 60)
        return {"requests": self.requests, "failures_4xx": self.failures_4xx,
                "failures_5xx": self.failures_5xx, "auth_failures": self.auth_failures,
                "failures_last_60s": recent, "first_seen": self.first_seen,
                "last_seen": self.last_seen, "last_failure": self.last_failure}


class ClientTracker:
    """Requests and failures per client address and per ``instance_id``, bounded in memory.

    At most ``max_entries`` of each are kept; the least recently seen is forgotten first (counted
    in ``evicted``), so a flood of made-up instance ids cannot grow the table.
    """

    def __init__(self, max_entries: int = 1024):
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._tables: dict[str, OrderedDict[str, _ClientEntry]] = {
            "address": OrderedDict(), "instance": OrderedDict()}
        self.evicted = 0

    def _entry(self, kind: str, key: str, now: float) -> _ClientEntry:
        table = self._tables[kind]
        entry = table.get(key)
        if entry is None:
            entry = table[key] = _ClientEntry(now)
            while len(table) > self.max_entries:
                table.popitem(last=False)
                self.evicted += 1
        else:
            table.move_to_end(key)
        return entry

    def record(self, address: str, instance_id: str | None, status: int, method: str, path: str,
               field_name: str | None, now: float | None = None, quiet: bool = False) -> None:
        """Count one answer; ``quiet``: a failure the service already logged (a storage fault,
        logged once per episode), counted but not logged as the client's."""
        now = time.time() if now is None else now
        failed = status >= 400
        with self._lock:
            keys = [("address", address)] + ([("instance", instance_id)] if instance_id else [])
            for kind, key in keys:
                e = self._entry(kind, key, now)
                e.requests += 1
                e.last_seen = now
                if not failed:
                    continue
                if status >= 500:
                    e.failures_5xx += 1
                else:
                    e.failures_4xx += 1
                if status in (401, 403):
                    e.auth_failures += 1
                e.fail(now)
                e.last_failure = {"time": now, "status": status, "method": method,
                                  "path": path[:200], "field": field_name}
                n = e.failures_4xx + e.failures_5xx
                if n in _LOG_AT and not quiet:
                    log.warning("client %s (%s): %d failed request(s), last %d %s %s (field %s)",
                                key, kind, n, status, method, path[:200], field_name)

    def snapshot(self, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        with self._lock:
            return {kind: {k: e.as_dict(now) for k, e in table.items()}
                    for kind, table in self._tables.items()} | {"evicted": self.evicted}


class ClientStats:
    """ASGI middleware (outermost): records every HTTP answer's status per client in a
    :class:`ClientTracker`, including the refusals of
    :class:`~astralight.dataflow.auth.AccessGuard` and unhandled errors."""

    def __init__(self, app, tracker: ClientTracker):
        self.app = app
        self.tracker = tracker

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        info: dict = {}
        status: list[int] = []

        async def send_status(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        reset = _REQUEST.set(info)
        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status.append(500)
            raise
        finally:
            _REQUEST.reset(reset)
            if status:  # none: the client went away before an answer
                client = scope.get("client")
                address = client[0] if client else "unknown"
                instance_id = info.get("instance_id")
                self.tracker.record(address, instance_id if isinstance(instance_id, str) else None,
                                    status[0], scope.get("method", ""), scope.get("path", ""),
                                    info.get("field"), quiet=bool(info.get("quiet")))
