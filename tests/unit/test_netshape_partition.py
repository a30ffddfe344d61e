"""astralight.netshape fault injection: a partition resets (``refuse``) or holds (``drop``) the
link until healed, and the link forwards exactly again afterwards."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from astralight.netshape import ShapedProxy


class EchoServer:
    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

    def close(self):
        self.sock.close()


@pytest.fixture
def proxy():
    server = EchoServer()
    with ShapedProxy(("127.0.0.1", server.port), mbit=1000, max_lifetime_s=60) as p:
        yield p
    server.close()


def roundtrip(address, payload=b"ping", timeout=5.0) -> bytes:
    with socket.create_connection(address, timeout=timeout) as c:
        c.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = c.recv(65536)
            if not chunk:
                raise ConnectionError("closed by the proxy")
            got += chunk
        return got


def test_refuse_resets_open_and_new_connections_until_healed(proxy):
    held = socket.create_connection(proxy.address, timeout=5)
    held.sendall(b"a")
    assert held.recv(1) == b"a"
    proxy.partition(mode="refuse")
    assert proxy.partitioned
    with pytest.raises(OSError):  # the open connection was reset
        for _ in range(50):
            held.sendall(b"b")
            if not held.recv(1):
                raise ConnectionError("closed")
            time.sleep(0.05)
    held.close()
    with pytest.raises(OSError):
        roundtrip(proxy.address)
    proxy.heal()
    assert not proxy.partitioned
    assert roundtrip(proxy.address, b"x" * 100_000) == b"x" * 100_000
    assert proxy.stats.partitions == 1 and proxy.stats.connections_reset >= 2


def test_partition_for_seconds_heals_by_itself(proxy):
    proxy.partition(0.3, mode="refuse")
    with pytest.raises(OSError):
        roundtrip(proxy.address)
    deadline = time.monotonic() + 5
    while proxy.partitioned and time.monotonic() < deadline:
        time.sleep(0.05)
    assert roundtrip(proxy.address) == b"ping"


def test_drop_holds_bytes_then_delivers_them_after_heal(proxy):
    conn = socket.create_connection(proxy.address, timeout=5)
    proxy.partition(mode="drop")
    conn.sendall(b"held")
    conn.settimeout(0.5)
    with pytest.raises(socket.timeout):  # nothing crosses a dropping link
        conn.recv(4)
    proxy.heal()
    conn.settimeout(5)
    got = b""
    while len(got) < 4:
        got += conn.recv(4)
    assert got == b"held"
    conn.close()


def test_bad_partition_arguments_name_the_field(proxy):
    with pytest.raises(ValueError, match="mode"):
        proxy.partition(1.0, mode="flaky")
    with pytest.raises(ValueError, match="seconds"):
        proxy.partition(0)
