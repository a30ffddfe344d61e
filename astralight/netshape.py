"""A slow link on loopback: a TCP proxy shaped to a bandwidth and a round-trip time.

    python -m astralight.netshape --listen 127.0.0.1:9400 --target 127.0.0.1:8400 --mbit 50 --rtt-ms 40
    astralight raas serve --dataflow http://127.0.0.1:9400 ...   # this RaaS now sits "far away"

Why: a RaaS in another region pulls weights over a link of tens of Mbit/s with tens of ms of
latency. Running it through this proxy shows, on one machine, what that does to weight refreshes
(full versus delta), to its sample throughput and to the trainer (which must not notice).

Model of the link, per direction (client -> target is "up", target -> client is "down"): a token
bucket refilled at the link rate (``burst_bytes`` deep) serialises the bytes, shared by every
connection through the proxy like one physical link, then each piece is delivered ``rtt_ms / 2``
later (one-way propagation delay). Data waiting to be delivered is bounded (about one
bandwidth-delay product plus a few pieces); beyond it the proxy stops reading, so TCP flow
control pushes back on the sender as a real link would. No packet loss, no reordering.

The proxy runs on an asyncio loop: either in its own process (``main``), or in a daemon thread of
the caller (``with ShapedProxy(...) as proxy:``, for tests and benchmarks). ``max_lifetime_s``
stops it on its own, so a test that hangs cannot leave it running.

Fault injection: :meth:`ShapedProxy.partition` cuts the link for a while (a network partition
between a RaaS and the dataflow), in one of two ways a client sees differently:

* ``refuse``: open connections are reset and new ones are reset as soon as they are accepted
  (what a client sees when the far side is down or a firewall rejects): calls fail at once and
  are retried;
* ``drop``: every byte in either direction is held back (a link that drops every packet: TCP
  keeps retransmitting, the client waits on its own timeout); new connections are accepted but
  forward nothing. On :meth:`ShapedProxy.heal` the held bytes flow again, as TCP would deliver
  them once the link returns before either side gave up.

``--partition-at S --partition-s D [--partition-mode refuse|drop]`` does the same from the
command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

#: most bytes read from a socket at once
READ_BYTES = 64 << 10


def parse_hostport(text: str, field_name: str = "address") -> tuple[str, int]:
    """``"127.0.0.1:8400"`` -> ``("127.0.0.1", 8400)``; a clear error naming the field otherwise."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{field_name}: expected HOST:PORT such as 127.0.0.1:8400, got {text!r}")
    return host, int(port)


class TokenBucket:
    """``rate`` bytes per second, at most ``burst`` bytes at once; waiters are served in order."""

    def __init__(self, rate: float, burst: int):
        if rate <= 0:
            raise ValueError(f"rate: must be > 0 bytes/s, got {rate}")
        if burst < 1:
            raise ValueError(f"burst: must be >= 1 byte, got {burst}")
        self.rate = float(rate)
        self.burst = int(burst)
        self.tokens = float(burst)
        self.stamp = time.monotonic()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    async def consume(self, n: int) -> None:
        """Wait until ``n`` (<= burst) bytes may go."""
        if n > self.burst:
            raise ValueError(f"n: {n} bytes exceed the bucket's burst of {self.burst}")
        async with self._lock:
            self._refill()
            while self.tokens < n:
                await asyncio.sleep((n - self.tokens) / self.rate)
                self._refill()
            self.tokens -= n


@dataclass
class LinkStats:
    """Bytes through the proxy and connections seen (cumulative)."""

    bytes_up: int = 0
    bytes_down: int = 0
    connections: int = 0
    open_connections: int = 0
    errors: list[str] = field(default_factory=list)
    partitions: int = 0
    connections_reset: int = 0

    def as_dict(self) -> dict:
        return {"bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "connections": self.connections, "open_connections": self.open_connections,
                "errors": len(self.errors), "partitions": self.partitions,
                "connections_reset": self.connections_reset}


PARTITION_MODES = ("refuse", "drop")


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with a TCP reset (SO_LINGER 0), as a dead peer or a firewall would."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


class ShapedProxy:
    """Forward TCP connections from ``listen`` to ``target`` through a shaped link.

    Args:
        target: ``(host, port)`` or ``"host:port"`` to connect to for every accepted connection.
        mbit: link rate target -> client ("down": what a RaaS downloads), in Mbit/s (10^6 bit/s).
        rtt_ms: round-trip time added by the link; each direction delays by ``rtt_ms / 2``.
        up_mbit: rate client -> target (default: ``mbit``).
        listen: ``(host, port)`` or ``"host:port"``; port 0 picks a free port (see ``address``).
        burst_bytes: token bucket depth (default: 5 ms at the link rate, at least 16 KiB).
        max_lifetime_s: stop by itself after this long (None: run until stopped).
    """

    def __init__(self, target, mbit: float, rtt_ms: float = 0.0, up_mbit: float | None = None,
                 listen=("127.0.0.1", 0), burst_bytes: int | None = None,
                 max_lifetime_s: float | None = None):
        self.target = parse_hostport(target, "target") if isinstance(target, str) else tuple(target)
        self.listen = parse_hostport(listen, "listen") if isinstance(listen, str) else tuple(listen)
        if mbit <= 0 or (up_mbit is not None and up_mbit <= 0):
            raise ValueError(f"mbit: must be > 0, got {mbit} (up_mbit={up_mbit})")
        if rtt_ms < 0:
            raise ValueError(f"rtt_ms: must be >= 0, got {rtt_ms}")
        self.mbit = float(mbit)
        self.up_mbit = float(up_mbit if up_mbit is not None else mbit)
        self.rtt_ms = float(rtt_ms)
        self.one_way_s = self.rtt_ms / 2000.0
        self.burst_bytes = burst_bytes
        self.max_lifetime_s = max_lifetime_s
        self.stats = LinkStats()
        self.address: tuple[str, int] | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        # partition: until when (time.monotonic(); 0 = healed, inf = until heal()) and how
        self._partition_until = 0.0
        self._partition_mode = "refuse"
        self._pairs: set[tuple] = set()  # (client_w, target_w) of connections being forwarded

    # ------------------------------------------------------------------ asyncio API

    def _bucket(self, mbit: float) -> TokenBucket:
        rate = mbit * 1e6 / 8.0
        burst = self.burst_bytes or max(16 << 10, int(rate * 0.005))
        return TokenBucket(rate, burst)

    async def start(self) -> tuple[str, int]:
        """Listen; return the bound ``(host, port)``."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._up, self._down = self._bucket(self.up_mbit), self._bucket(self.mbit)
        self._server = await asyncio.start_server(self._accept, self.listen[0], self.listen[1])
        self.address = self._server.sockets[0].getsockname()[:2]
        if self.max_lifetime_s is not None:
            self._loop.call_later(self.max_lifetime_s, lambda: asyncio.ensure_future(self.stop()))
        return self.address

    async def stop(self) -> None:
        """Stop listening and cut every open connection."""
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._stopped is not None:
            self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.stats.connections += 1
        self.stats.open_connections += 1
        self._writers.add(client_w)
        target_w = None
        pair = None
        try:
            if self.partitioned and self._partition_mode == "refuse":
                self.stats.connections_reset += 1
                _reset(client_w)
                return
            await self._link_up()  # "drop": a new connection forwards nothing until healed
            try:
                target_r, target_w = await asyncio.open_connection(*self.target)
            except OSError as exc:
                self.stats.errors.append(f"connect {self.target}: {exc}")
                return  # the client sees the connection closed, as with a refused connect
            self._writers.add(target_w)
            pair = (client_w, target_w)
            self._pairs.add(pair)
            await asyncio.gather(
                self._pump(client_r, target_w, self._up, "bytes_up", pair, self.transform_up),
                self._pump(target_r, client_w, self._down, "bytes_down", pair, self.transform_down),
            )
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._pairs.discard(pair)
            for w in (client_w, target_w):
                if w is not None:
                    w.close()
                    self._writers.discard(w)
            self.stats.open_connections -= 1
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    bucket: TokenBucket, counter: str, pair: tuple, transform) -> None:
        """Copy one direction: pace through the bucket, deliver one_way_s later, in order.

        If writing fails (that side went away) both sockets of the pair are closed, which ends
        the reads of both directions; the queue keeps being drained so nothing blocks on it.
        """
        loop = asyncio.get_running_loop()
        bdp = bucket.rate * self.one_way_s
        queue: asyncio.Queue = asyncio.Queue(maxsize=8 + int(bdp // bucket.burst))

        async def deliver() -> None:
            broken = False
            while True:
                item = await queue.get()
                if item is None:
                    break
                if broken:
                    continue
                due, data = item
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                try:
                    writer.write(data)
                    await writer.drain()
                except (ConnectionError, OSError):
                    broken = True
                    for w in pair:
                        w.close()
                    continue
                setattr(self.stats, counter, getattr(self.stats, counter) + len(data))
            if not broken and writer.can_write_eof():
                try:
                    writer.write_eof()
                except (ConnectionError, OSError):
                    pass

        deliverer = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(READ_BYTES)
                if not data:
                    break
                data = transform(data)
                await self._link_up()  # "drop" partition: hold the bytes until healed
                for i in range(0, len(data), bucket.burst):
                    piece = data[i:i + bucket.burst]
                    await bucket.consume(len(piece))
                    await queue.put((loop.time() + self.one_way_s, piece))
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            deliverer.cancel()
            raise
        finally:
            if not deliverer.done():
                await queue.put(None)  # the deliverer keeps draining, so this returns
            await asyncio.gather(deliverer, return_exceptions=True)

    # ------------------------------------------------------------------ fault injection

    @property
    def partitioned(self) -> bool:
        """Is the link cut right now (see :meth:`partition`)?"""
        return time.monotonic() < self._partition_until

    async def _link_up(self) -> None:
        """Return when the link is not cut in ``drop`` mode (at once otherwise)."""
        while self.partitioned and self._partition_mode == "drop":
            await asyncio.sleep(min(0.05, max(0.0, self._partition_until - time.monotonic())))

    def partition(self, seconds: float | None = None, mode: str = "refuse") -> None:
        """Cut the link for ``seconds`` (None: until :meth:`heal`); thread-safe.

        ``refuse``: reset every open connection now and every new one until healed; ``drop``:
        forward nothing in either direction until healed (see the module docstring).
        """
        if mode not in PARTITION_MODES:
            raise ValueError(f"mode: must be one of {PARTITION_MODES}, got {mode!r}")
        if seconds is not None and not seconds > 0:
            raise ValueError(f"seconds: must be > 0 (or None: until heal()), got {seconds}")
        self._partition_mode = mode
        self._partition_until = math.inf if seconds is None else time.monotonic() + seconds
        self.stats.partitions += 1
        if mode == "refuse" and self._loop is not None:
            def cut() -> None:
                for pair in list(self._pairs):
                    for w in pair:
                        _reset(w)
                    self.stats.connections_reset += 1
            if self._thread is not None and threading.current_thread() is not self._thread:
                self._loop.call_soon_threadsafe(cut)
            else:
                cut()

    def heal(self) -> None:
        """End a partition now (thread-safe); held bytes flow again, new connections forward."""
        self._partition_until = 0.0

    def transform_up(self, data: bytes) -> bytes:
        """Bytes read from the client, before they cross the link. Identity; a subclass may
        alter them to inject faults (tests)."""
        return data

    def transform_down(self, data: bytes) -> bytes:
        """Bytes read from the target, before they cross the link (see :meth:`transform_up`)."""
        return data

    # ------------------------------------------------------------------ thread API

    def start_in_thread(self, timeout_s: float = 10.0) -> "ShapedProxy":
        """Run the proxy on an event loop in a daemon thread; return once it listens."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            async def main() -> None:
                try:
                    await self.start()
                except BaseException as exc:  # surfaced to the caller below
                    failure.append(exc)
                    ready.set()
                    return
                ready.set()
                await self.wait_stopped()

            asyncio.run(main())

        self._thread = threading.Thread(target=run, name="netshape", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise RuntimeError("netshape: the proxy did not start listening in time")
        if failure:
            raise failure[0]
        return self

    def close(self) -> None:
        """Stop a proxy started with :meth:`start_in_thread` (idempotent)."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self.stop(), self._loop)
            try:
                fut.result(timeout=10)
            except Exception:
                pass
            self._thread.join(timeout=10)

    def __enter__(self) -> "ShapedProxy":
        return self.start_in_thread() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def url(self) -> str:
        """``http://host:port`` of the listening side (for HTTP services such as the dataflow)."""
        if self.address is None:
            raise RuntimeError("netshape: not started")
        return f"http://{self.address[0]}:{self.address[1]}"

    def describe(self) -> str:
        return (f"{self.address[0]}:{self.address[1]} -> {self.target[0]}:{self.target[1]} "
                f"({self.mbit:g} Mbit/s down, {self.up_mbit:g} Mbit/s up, rtt {self.rtt_ms:g} ms)")


def main(argv: list[str] | None = None) -> int:
    """``python -m astralight.netshape``: run one shaped proxy until SIGINT/SIGTERM or --duration-s."""
    p = argparse.ArgumentParser(prog="python -m astralight.netshape",
                                description="TCP proxy that shapes bandwidth and adds latency.")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0: any)")
    p.add_argument("--target", required=True, help="HOST:PORT to forward to")
    p.add_argument("--mbit", type=float, required=True, help="link rate in Mbit/s (download side)")
    p.add_argument("--up-mbit", type=float, default=None, help="upload rate (default: --mbit)")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="added round-trip time in ms")
    p.add_argument("--burst-bytes", type=int, default=None, help="token bucket depth")
    p.add_argument("--duration-s", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--partition-at", type=float, default=None, metavar="S",
                   help="cut the link S seconds after start (fault injection)")
    p.add_argument("--partition-s", type=float, default=10.0, metavar="D",
                   help="how long the cut lasts (default 10)")
    p.add_argument("--partition-mode", choices=PARTITION_MODES, default="refuse",
                   help="refuse: reset connections; drop: forward nothing (default refuse)")
    args = p.parse_args(argv)
    try:
        proxy = ShapedProxy(args.target, mbit=args.mbit, rtt_ms=args.rtt_ms, up_mbit=args.up_mbit,
                            listen=args.listen, burst_bytes=args.burst_bytes,
                            max_lifetime_s=args.duration_s)
    except ValueError as exc:
        print(f"netshape: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        await proxy.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(proxy.stop()))
        if args.partition_at is not None:
            def cut() -> None:
                print(f"netshape: partition ({args.partition_mode}) for {args.partition_s:g}s",
                      flush=True)
                proxy.partition(args.partition_s, args.partition_mode)
            loop.call_later(args.partition_at, cut)
        print(f"netshape listening on {proxy.describe()}", flush=True)
        await proxy.wait_stopped()

    try:
        asyncio.run(run())
    except OSError as exc:
        print(f"netshape: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"netshape": proxy.stats.as_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
