"""Connection hygiene of the dataflow's HTTP server: a header-read timeout and a connection limit
(``header_timeout_s``, ``max_connections`` in the dataflow config), logged once per episode.

Why not uvicorn's own knobs alone (read in uvicorn's ``protocols/http/*_impl.py``):

* uvicorn has **no header-read timeout**. ``timeout_keep_alive`` is armed only after a response
  and any byte from the client cancels it, so a fresh connection, or one that sent half a
  request line, is never timed out: 300 of them blocked the service's valid clients (issue 41,
  item 3) and nothing was logged.
* ``limit_concurrency`` counts every open connection, idle and half-sent ones too, and answers
  503 to the next *complete* request once the count is reached: under a flood of stalled
  connections it refuses exactly the clients that should be served, until the flood stops.

So :func:`guarded_protocol` subclasses the HTTP protocol uvicorn itself would pick (httptools if
installed, else h11) and adds, through one :class:`ConnectionGuard` per server:

* a **head deadline**: a connection must complete its request head (request line and headers)
  within ``header_timeout_s`` of connecting, or of the end of its previous response; else it is
  closed (with a ``408`` naming ``header_timeout_s`` when it had sent part of a head). A request
  whose head has arrived is never timed out here, so long polls (pulls, leases: up to
  ``max_pull_timeout_s``) and slow body uploads are untouched.
* a **connection limit**: at ``max_connections`` a new connection first makes room by closing the
  connection that has waited longest for a request head (stalled, half-sent or idle keep-alive:
  the cheapest to lose, a client reconnects at once); only when every connection is busy with a
  request is the new one refused (closed at once, which :class:`~astralight.dataflow.client.\
DataflowClient` retries with backoff).
* **one log line per episode** (:class:`EpisodeLog`): a warning with the counts and addresses of
  the first second, then one summary when no such event happened for :data:`QUIET_S` seconds.
* a limit that **fits the file descriptors** (:func:`fit_fd_limit`): past ``ulimit -n`` the
  operating system refuses every new connection before any of this can run.

The service also passes ``ws="none"`` to uvicorn: it has no WebSocket routes, and an upgraded
connection would leave this protocol (and its accounting) behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict
from typing import Any

log = logging.getLogger("astralight.dataflow")

#: the first warning of an episode sums up this first stretch of it (a flood arrives in bursts)
REPORT_AFTER_S = 1.0
#: an episode ends when no connection was timed out, evicted or refused for this long
QUIET_S = 30.0
#: distinct client addresses an episode counts one by one (the rest: ``other``)
MAX_ADDRESSES = 256
#: file descriptors the service needs besides its connections (SQLite, weight files, logs)
FD_MARGIN = 128

_KINDS = {
    "timeout": "closed {n} connection(s) that sent no complete request head within "
               "header_timeout_s={timeout:g} s",
    "evicted": "closed {n} connection(s) waiting for a request head to make room for new ones "
               "at max_connections={limit}",
    "refused": "refused {n} new connection(s) because all max_connections={limit} were busy "
               "with requests",
}


class EpisodeLog:
    """Counts timed-out, evicted and refused connections and logs them once per episode: one
    warning :data:`REPORT_AFTER_S` after the first event (the counts so far), one summary when
    none happened for :data:`QUIET_S` seconds. A flood of connections is one episode, not one
    line per connection."""

    def __init__(self, header_timeout_s: float, max_connections: int,
                 report_after_s: float = REPORT_AFTER_S, quiet_s: float = QUIET_S):
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.report_after_s = report_after_s
        self.quiet_s = quiet_s
        self.counts: Counter = Counter()
        self.addresses: Counter = Counter()
        self.started: float | None = None
        self.last = 0.0

    def note(self, kind: str, address: str) -> None:
        """One connection ``kind`` (``timeout``, ``evicted``, ``refused``) from ``address``."""
        now = time.monotonic()
        self.counts[kind] += 1
        if address in self.addresses or len(self.addresses) < MAX_ADDRESSES:
            self.addresses[address] += 1
        else:
            self.addresses["other"] += 1
        self.last = now
        if self.started is None:
            self.started = now
            asyncio.get_running_loop().call_later(self.report_after_s, self._report_start)

    def describe(self) -> str:
        """The episode's counts so far, each naming its setting, and its busiest addresses."""
        parts = [text.format(n=self.counts[kind], timeout=self.header_timeout_s,
                             limit=self.max_connections)
                 for kind, text in _KINDS.items() if self.counts[kind]]
        top = ", ".join(f"{a} ({n})" for a, n in self.addresses.most_common(3))
        return f"{'; '.join(parts)}; from {len(self.addresses)} address(es): {top}"

    def _report_start(self) -> None:
        log.warning(
            "slow or excess connections: %s. Stalled or very slow clients, or a flood of "
            "connections; clients that send their requests are still served. If these are your "
            "own clients, raise header_timeout_s or max_connections in the dataflow config (and "
            "ulimit -n). One summary follows when this stops (%g s without such a connection).",
            self.describe(), self.quiet_s)
        asyncio.get_running_loop().call_later(self.quiet_s, self._check_end)

    def _check_end(self) -> None:
        idle = time.monotonic() - self.last
        if idle < self.quiet_s:
            asyncio.get_running_loop().call_later(self.quiet_s - idle, self._check_end)
            return
        log.warning("slow or excess connections stopped after %.0f s: %s",
                    self.last - (self.started or self.last), self.describe())
        self.counts.clear()
        self.addresses.clear()
        self.started = None


class ConnectionGuard:
    """What every connection of one server shares: the limits, the open connections, those
    waiting for a request head (oldest first, the ones to evict) and the :class:`EpisodeLog`."""

    def __init__(self, header_timeout_s: float, max_connections: int,
                 episodes: EpisodeLog | None = None):
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.episodes = episodes or EpisodeLog(header_timeout_s, max_connections)
        self.open: set = set()
        self.waiting: OrderedDict = OrderedDict()

    def admit(self, conn: "_GuardedConnection") -> bool:
        """Count a new connection; at the limit first close the connection that has waited
        longest for a request head. False (and counted): every connection is busy with a
        request, refuse this one."""
        while len(self.open) >= self.max_connections:
            if not self.waiting:
                self.episodes.note("refused", conn.peer)
                return False
            oldest = next(iter(self.waiting))
            oldest.close_waiting()
            self.episodes.note("evicted", oldest.peer)
        self.open.add(conn)
        return True

    def forget(self, conn: "_GuardedConnection") -> None:
        """``conn`` is closed or closing: it no longer counts (idempotent)."""
        self.open.discard(conn)
        self.waiting.pop(conn, None)


def _timeout_response(header_timeout_s: float) -> bytes:
    """The 408 a connection that sent part of a request head gets before it is closed."""
    body = json.dumps({"error": f"header_timeout_s: the request head (request line and headers) "
                                f"was not complete within {header_timeout_s:g} s",
                       "field": "header_timeout_s"}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body)


class _GuardedConnection:
    """Mixin over uvicorn's HTTP protocol (see the module): a head deadline per connection and
    admission through :attr:`guard`. Relies on what both of uvicorn's HTTP protocols have:
    ``transport``, ``client``, ``loop``, ``cycle`` (a new one once a request head is complete,
    ``response_complete`` once answered) and ``on_response_complete``."""

    guard: ConnectionGuard  # set by guarded_protocol

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_cycle: Any = None
        self._head_bytes = 0
        self.peer = self.client[0] if self.client else "unknown"  # type: ignore[attr-defined]
        if not self.guard.admit(self):
            transport.abort()
            return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        self.guard.forget(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._head_timer is not None:
            self._head_bytes += len(data)
        super().data_received(data)  # type: ignore[misc]
        self._check_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._check_head()  # h11 starts a pipelined request here
        if (self._head_timer is None and self._idle()
                and not self.transport.is_closing()):  # type: ignore[attr-defined]
            self._await_head()

    def _idle(self) -> bool:
        """No request in progress: waiting for the next request head."""
        cycle = self.cycle  # type: ignore[attr-defined]
        return cycle is None or cycle.response_complete

    def _await_head(self) -> None:
        """Start the head deadline and join the connections that may be evicted."""
        self._head_cycle = self.cycle  # type: ignore[attr-defined]
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(  # type: ignore[attr-defined]
            self.guard.header_timeout_s, self._head_timed_out)
        self.guard.waiting[self] = None

    def _check_head(self) -> None:
        """A new request cycle means its head is complete: stop the deadline."""
        cycle = self.cycle  # type: ignore[attr-defined]
        if self._head_timer is not None and cycle is not self._head_cycle:
            self._stop_waiting()

    def _stop_waiting(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self.guard.waiting.pop(self, None)

    def close_waiting(self) -> None:
        """Close this connection, which is waiting for a request head (evicted)."""
        self._stop_waiting()
        self.guard.forget(self)
        self.transport.close()  # type: ignore[attr-defined]

    def _head_timed_out(self) -> None:
        self._head_timer = None
        transport = self.transport  # type: ignore[attr-defined]
        if transport.is_closing() or not self._idle():
            return
        if self._head_bytes:  # a client that sent part of a head learns why
            transport.write(_timeout_response(self.guard.header_timeout_s))
        self.guard.forget(self)
        transport.close()
        self.guard.episodes.note("timeout", self.peer)


def guarded_protocol(guard: ConnectionGuard, base: type | None = None) -> type:
    """An HTTP protocol class for ``uvicorn.Config(http=...)``: ``base`` (default: the one
    uvicorn picks itself, httptools if installed, else h11) with :class:`_GuardedConnection`'s
    head deadline and connection limit, sharing ``guard``."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base
    return type(f"Guarded{base.__name__}", (_GuardedConnection, base), {"guard": guard})


def fit_fd_limit(max_connections: int) -> int:
    """The number of connections this process can really hold, at most ``max_connections``.

    Each connection is a file descriptor, and past the process's limit (``ulimit -n``) the
    operating system refuses every new connection, valid ones too, before the guard sees it
    (so it cannot make room). When the soft limit is below ``max_connections`` plus
    :data:`FD_MARGIN` it is raised toward the hard limit, as servers commonly do; if that is
    not enough, the guard holds fewer connections (what fits), with a warning naming the
    setting and the fix."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # no such limit here (Windows)
        return max_connections
    need = max_connections + FD_MARGIN
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    except (OSError, ValueError):
        pass
    if soft >= need:
        return max_connections
    fit = max(1, soft - FD_MARGIN)
    log.warning("max_connections=%d needs about %d file descriptors, but this process may open "
                "only %d (ulimit -n): holding at most %d connections, so that new connections "
                "are never refused by the operating system. Raise ulimit -n (hard limit) to at "
                "least %d, or set max_connections to %d or less in the dataflow config",
                max_connections, need, soft, fit, need, fit)
    return fit
