"""astralight.netshape: a shaped TCP proxy on loopback forwards bytes exactly, and never faster
than its link allows (lower bounds only: a loaded machine can make it slower, never faster)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from astralight.netshape import ShapedProxy, TokenBucket, parse_hostport


class BlobServer:
    """Answers each connection: read a 4-byte length n, send n pseudo-random bytes, then echo."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    @staticmethod
    def _handle(conn):
        with conn:
            n = int.from_bytes(_recv_exact(conn, 4), "big")
            conn.sendall(_blob(n))
            while data := conn.recv(65536):
                conn.sendall(data)

    def close(self):
        self.sock.close()


def _blob(n: int) -> bytes:
    out, seed = bytearray(), b"x"
    while len(out) < n:
        seed = hashlib.sha256(seed).digest()
        out += seed
    return bytes(out[:n])


def _recv_exact(conn, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


@pytest.fixture
def server():
    s = BlobServer()
    yield s
    s.close()


def test_bytes_cross_exactly_and_no_faster_than_the_link(server):
    n = 1_000_000  # 8 Mbit at 16 Mbit/s: at least 0.5 s
    with ShapedProxy(("127.0.0.1", server.port), mbit=16, rtt_ms=0, max_lifetime_s=60) as proxy:
        with socket.create_connection(proxy.address) as c:
            start = time.perf_counter()
            c.sendall(n.to_bytes(4, "big"))
            got = _recv_exact(c, n)
            elapsed = time.perf_counter() - start
            c.sendall(b"ping")
            assert _recv_exact(c, 4) == b"ping"
        assert got == _blob(n)
        burst = max(16 << 10, int(16e6 / 8 * 0.005))
        assert elapsed >= (n - burst) * 8 / 16e6 * 0.98
    assert proxy.stats.bytes_down == n + 4 and proxy.stats.bytes_up == 8
    assert proxy.stats.connections == 1


def test_round_trip_time_is_added(server):
    with ShapedProxy(("127.0.0.1", server.port), mbit=1000, rtt_ms=80, max_lifetime_s=60) as proxy:
        with socket.create_connection(proxy.address) as c:
            c.sendall((0).to_bytes(4, "big"))
            times = []
            for _ in range(3):
                start = time.perf_counter()
                c.sendall(b"x")
                assert _recv_exact(c, 1) == b"x"
                times.append(time.perf_counter() - start)
    assert min(times) >= 0.080 * 0.98


def test_connections_share_one_link(server):
    """Two downloads at once through a 16 Mbit/s link take at least as long as their sum."""
    n = 400_000
    results = []
    with ShapedProxy(("127.0.0.1", server.port), mbit=16, max_lifetime_s=60) as proxy:
        def fetch():
            with socket.create_connection(proxy.address) as c:
                c.sendall(n.to_bytes(4, "big"))
                results.append(_recv_exact(c, n))

        start = time.perf_counter()
        threads = [threading.Thread(target=fetch) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        elapsed = time.perf_counter() - start
    assert results == [_blob(n)] * 2
    burst = max(16 << 10, int(16e6 / 8 * 0.005))
    assert elapsed >= (2 * n - 2 * burst) * 8 / 16e6 * 0.98


def test_an_unreachable_target_closes_the_client_connection():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # nothing listens once closed
    with ShapedProxy(("127.0.0.1", dead_port), mbit=10, max_lifetime_s=30) as proxy:
        with socket.create_connection(proxy.address) as c:
            c.settimeout(10)
            assert c.recv(1) == b""
        for _ in range(100):
            if proxy.stats.errors:
                break
            time.sleep(0.02)
        assert proxy.stats.errors and "connect" in proxy.stats.errors[0]


def test_max_lifetime_stops_the_proxy(server):
    proxy = ShapedProxy(("127.0.0.1", server.port), mbit=10, max_lifetime_s=0.3).start_in_thread()
    proxy._thread.join(timeout=10)
    assert not proxy._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(proxy.address, timeout=2).close()


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="target"):
        ShapedProxy("localhost", mbit=1)
    with pytest.raises(ValueError, match="mbit"):
        ShapedProxy("127.0.0.1:1", mbit=0)
    with pytest.raises(ValueError, match="rtt_ms"):
        ShapedProxy("127.0.0.1:1", mbit=1, rtt_ms=-1)
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(0, 10)
    assert parse_hostport("127.0.0.1:8400") == ("127.0.0.1", 8400)


def test_command_line_proxy_forwards_and_stops_on_sigterm(server):
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "astralight.netshape", "--listen", "127.0.0.1:0",
                             "--target", f"127.0.0.1:{server.port}", "--mbit", "50",
                             "--rtt-ms", "10", "--duration-s", "60"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        line = proc.stdout.readline()
        assert line.startswith("netshape listening on 127.0.0.1:"), line
        port = int(line.split()[3].rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall((1000).to_bytes(4, "big"))
            assert _recv_exact(c, 1000) == _blob(1000)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0
        assert '"bytes_down": 1000' in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
