"""The dataflow's HTTP connections, served by uvicorn exactly as the service configures it
(:func:`astralight.dataflow.service.uvicorn_config`) in a thread of this process (issue 41):

* item 6: after a 500 the keep-alive client is told ``Connection: close`` (it used to be closed
  silently, and the client's next request on it was reset);
* item 3: a connection that has not sent its complete request head within ``header_timeout_s``
  is closed (a 408 when it sent part of one), also on a kept-alive connection after a response;
  at ``max_connections`` the connection waiting longest for a head makes room for a new one,
  and connections busy with a request (long polls) are never closed for it; each episode is
  logged once, with counts.

No assertion is on wall-clock speed: waits are bounded generously (:data:`BOUND_S`, many times
the configured timeout) only so that a regression fails instead of hanging.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import threading
from contextlib import contextmanager

import pytest

from astralight.dataflow.app import create_app
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.service import _Server, listen_socket, uvicorn_config
from astralight.protocol import encode
from tests.proc_helpers import still_open, wait_for

#: the longest any wait below may take before the test fails (the timeouts are 0.5 s to 3 s)
BOUND_S = 30.0
#: an episode ends after this long without a closed connection (short here: its summary line
#: is the one that holds the episode's total counts)
QUIET_S = 3.0
HALF_LINE = b"GET /v1/inf"  # half a request line, never finished


@contextmanager
def served(tmp_path, **overrides):
    """The service's app (no token, loopback) under uvicorn in a thread: yields
    ``(port, app, guard)``; episodes end after :data:`QUIET_S`."""
    config = DataflowConfig(state_dir=str(tmp_path / "state"), **overrides)
    app = create_app(config, token="")
    sock = listen_socket("127.0.0.1", 0)
    uv_config = uvicorn_config(app, config)
    uv_config.http.guard.episodes.quiet_s = QUIET_S
    server = _Server(uv_config, app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, "the server to start", BOUND_S)
        yield sock.getsockname()[1], app, uv_config.http.guard
    finally:
        server.should_exit = True
        thread.join(BOUND_S)
        sock.close()


def half_sent(port: int, data: bytes = HALF_LINE) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    if data:
        sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (fails after BOUND_S)."""
    sock.settimeout(BOUND_S)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def get(port: int, path: str = "/v1/info") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=BOUND_S)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def episode_lines(caplog) -> tuple[list[str], list[str]]:
    """The warnings that start an episode and the summaries that end one."""
    lines = [r.getMessage() for r in caplog.records
             if r.name == "astralight.dataflow" and "slow or excess connections" in r.getMessage()]
    ends = [line for line in lines if "connections stopped after" in line]
    return [line for line in lines if line not in ends], ends


def total(lines: list[str], pattern: str) -> int:
    """The sum over ``lines`` of the count that ``pattern``'s group captures."""
    return sum(int(n) for line in lines for n in re.findall(pattern, line))


def wait_for_summary(caplog) -> tuple[list[str], list[str]]:
    wait_for(lambda: episode_lines(caplog)[1], "the episode's summary", BOUND_S)
    return episode_lines(caplog)


def test_a_500_tells_the_keep_alive_client_to_reconnect(tmp_path):
    with served(tmp_path) as (port, app, _guard):
        def boom():
            raise RuntimeError("disk on fire")

        app.state.dataflow.stats = boom
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=BOUND_S)
        conn.request("GET", "/v1/stats")
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 500 and "disk on fire" in body["error"]
        # the server closes this connection after a 500: it must say so
        assert resp.getheader("Connection") == "close"
        # ... so the same client's next request goes out on a new connection and is answered
        conn.request("GET", "/v1/info")
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())
        conn.close()


@pytest.fixture(params=["httptools", "h11"])
def http_impl(request, monkeypatch):
    """Run a test over each HTTP protocol uvicorn may pick (httptools when it is installed)."""
    import uvicorn.protocols.http.auto as auto

    if request.param == "httptools":
        pytest.importorskip("httptools")
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    monkeypatch.setattr(auto, "AutoHTTPProtocol", base)
    return request.param


def test_an_unfinished_request_head_is_closed_after_header_timeout_s(tmp_path, caplog, http_impl):
    caplog.set_level(logging.WARNING, logger="astralight.dataflow")
    with served(tmp_path, header_timeout_s=1.0) as (port, _app, _guard):
        halves = [half_sent(port) for _ in range(20)]
        silent = half_sent(port, b"")  # connected, sent nothing
        assert get(port) == 200  # a client that sends its request is served meanwhile
        # a kept-alive connection that starts its next request and stalls: uvicorn's keep-alive
        # timer stops at its first byte, the head deadline does not
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=BOUND_S)
        kept.request("GET", "/v1/info")
        assert kept.getresponse().read()
        kept.sock.sendall(b"GE")
        for sock in halves + [kept.sock]:
            answer = read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 408 ") and b"header_timeout_s" in answer
        assert read_until_closed(silent) == b""  # closed without an answer
        starts, ends = wait_for_summary(caplog)
    # a warning when it starts and a summary when it stops, not a line per connection
    assert 1 <= len(starts) == len(ends) <= 2, starts + ends
    assert "header_timeout_s=1 s" in starts[0] and "ulimit -n" in starts[0]
    assert total(ends, r"closed (\d+) connection\(s\) that sent no complete request head") == 22
    assert total(ends, r"127\.0\.0\.1 \((\d+)\)") == 22


def test_a_long_poll_outlives_header_timeout_s(tmp_path):
    """The deadline is on the request head only: a pull waiting 4x header_timeout_s is answered."""
    with served(tmp_path, header_timeout_s=0.5) as (port, _app, _guard):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=BOUND_S)
        conn.request("POST", "/v1/pull", body=encode({"model_id": "policy", "size": 1,
                                                      "timeout_s": 2.0}),
                     headers={"Content-Type": "application/msgpack"})
        assert conn.getresponse().status == 200
        conn.close()


def test_at_max_connections_the_longest_waiting_connection_makes_room(tmp_path, caplog,
                                                                      http_impl):
    caplog.set_level(logging.WARNING, logger="astralight.dataflow")
    with served(tmp_path, header_timeout_s=60, max_connections=8) as (port, _app, guard):
        halves = []
        for _ in range(20):  # one at a time, so that the server sees them in this order
            halves.append(half_sent(port))
            wait_for(lambda: len(guard.open) + guard.episodes.counts["evicted"] == len(halves),
                     "the server to take the connection", BOUND_S)
        assert get(port) == 200  # a valid client is served, not refused
        for sock in halves[:13]:  # the 12 oldest made room for the newer ones, the 13th for it
            assert read_until_closed(sock) == b""
        assert all(still_open(sock) for sock in halves[13:])
        starts, ends = wait_for_summary(caplog)
        for sock in halves:
            sock.close()
    assert 1 <= len(starts) == len(ends) <= 2 and "max_connections=8" in starts[0]
    assert total(ends, r"closed (\d+) connection\(s\) waiting for a request head") == 13


def test_connections_busy_with_requests_are_kept_and_a_new_one_is_refused(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="astralight.dataflow")
    with served(tmp_path, header_timeout_s=60, max_connections=2) as (port, _app, guard):
        statuses: list[int] = []

        def long_poll():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=BOUND_S)
            conn.request("POST", "/v1/pull", body=encode({"model_id": "policy", "size": 1,
                                                          "timeout_s": 3.0}),
                         headers={"Content-Type": "application/msgpack"})
            statuses.append(conn.getresponse().status)
            conn.close()

        polls = [threading.Thread(target=long_poll) for _ in range(2)]
        for t in polls:
            t.start()
        wait_for(lambda: len(guard.open) == 2 and not guard.waiting, "two busy long polls",
                 BOUND_S)
        refused = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
        try:
            refused.sendall(b"GET /v1/info HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        except OSError:  # already refused
            pass
        assert read_until_closed(refused) == b""  # closed at once, no answer
        for t in polls:
            t.join(BOUND_S)
        assert statuses == [200, 200]  # neither long poll was cut for it
        starts, ends = wait_for_summary(caplog)
    assert "max_connections=2" in starts[0]
    assert total(ends, r"refused (\d+) new connection\(s\)") == 1


def test_header_timeout_s_and_max_connections_must_be_positive(tmp_path):
    for key in ("header_timeout_s", "max_connections"):
        with pytest.raises(ValueError, match=f"^{key}: must be > 0"):
            DataflowConfig(state_dir=str(tmp_path / "s"), **{key: 0})


def test_max_connections_fits_the_file_descriptor_limit(caplog, monkeypatch):
    """Past ``ulimit -n`` the OS refuses every connection before the guard can make room: the
    soft limit is raised toward the hard one, else the guard holds what fits, with a warning."""
    import resource

    from astralight.dataflow.http_connections import FD_MARGIN, fit_fd_limit

    set_to: list = []
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (256, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda _which, limits: set_to.append(limits))
    with caplog.at_level(logging.WARNING, logger="astralight.dataflow"):
        assert fit_fd_limit(512) == 512  # raised: nothing to warn about
    assert set_to == [(512 + FD_MARGIN, 4096)] and not caplog.text

    def refuse(_which, _limits):
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "getrlimit", lambda _which: (256, 256))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    with caplog.at_level(logging.WARNING, logger="astralight.dataflow"):
        assert fit_fd_limit(512) == 256 - FD_MARGIN
    assert "max_connections=512" in caplog.text and "ulimit -n" in caplog.text
