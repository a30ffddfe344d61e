"""Stalled connections against the real dataflow service process (issue 41, item 3): 300
connections that sent half a request line used to be held for good, nothing logged, and the
service's valid clients were blocked. Now, with a token configured as on a public bind:

* a request that carries the token is answered while the stalled connections are still open
  (the oldest of them made room at ``max_connections``);
* every stalled connection is closed -- evicted, or after ``header_timeout_s`` with a 408 naming
  it -- and the episode is logged once, naming both settings.

Waits are bounded generously (:data:`BOUND_S`) so that a regression fails instead of hanging;
nothing asserts a speed.
"""

from __future__ import annotations

import select
import socket
import time
from urllib.parse import urlsplit

import httpx

from tests.proc_helpers import still_open

TOKEN = "slow-clients-token-0123456789abcdef"
#: the stalled connections, more than MAX_CONNECTIONS so that both mechanisms act
STALLED = 300
MAX_CONNECTIONS = 128
HEADER_TIMEOUT_S = 6.0
#: the longest a wait may take before the test fails (several times HEADER_TIMEOUT_S)
BOUND_S = 60.0


def _stall(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` connections, each sending half a request line and nothing more."""
    out = []
    for _ in range(n):
        sock = socket.create_connection((host, port), timeout=BOUND_S)
        try:
            sock.sendall(b"GET /v1/info HT")
        except OSError:  # already closed to make room: counted below as closed
            pass
        out.append(sock)
    return out


def _closed_and_answers(socks: list[socket.socket]) -> list[bytes | None]:
    """Wait (up to BOUND_S) until the server has closed every socket; what each received
    (None: still open at the bound)."""
    got: dict[socket.socket, bytes] = {s: b"" for s in socks}
    open_ = set(socks)
    deadline = time.monotonic() + BOUND_S
    while open_ and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_), [], [], 1.0)
        for sock in ready:
            try:
                chunk = sock.recv(65536)
            except OSError:
                chunk = b""
            if chunk:
                got[sock] += chunk
            else:
                open_.discard(sock)
    return [None if s in open_ else got[s] for s in socks]


def test_stalled_connections_are_closed_and_valid_clients_served(tmp_path, dataflow_service):
    url, _proc, config_path = dataflow_service(
        tmp_path, token=TOKEN, header_timeout_s=HEADER_TIMEOUT_S, max_connections=MAX_CONNECTIONS)
    parts = urlsplit(url)
    stalled = _stall(parts.hostname, parts.port, STALLED)
    try:
        r = httpx.get(f"{url}/v1/info", headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=BOUND_S)
        assert r.status_code == 200 and r.json()
        # answered while the newest stalled connections are still held, not after they went
        assert still_open(stalled[-1])
        answers = _closed_and_answers(stalled)
    finally:
        for sock in stalled:
            sock.close()
    assert None not in answers  # every stalled connection was closed
    timed_out = [a for a in answers if a]
    # the connections still waiting when the valid one came were timed out with a 408
    assert timed_out and all(a.startswith(b"HTTP/1.1 408 ") and b"header_timeout_s" in a
                             for a in timed_out)
    assert len(timed_out) < MAX_CONNECTIONS  # the rest were evicted to make room
    log = config_path.with_suffix(".log").read_text(errors="replace")
    lines = [ln for ln in log.splitlines() if "slow or excess connections:" in ln]
    assert len(lines) == 1, lines  # one warning for the episode, not one per connection
    assert f"max_connections={MAX_CONNECTIONS}" in lines[0] and "127.0.0.1" in lines[0]
