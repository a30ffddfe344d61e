"""Process helpers shared by the unit and integration tests that watch real processes die:
:func:`gone`, :func:`wait_for` and :func:`kill_quietly`; and :func:`still_open`, for tests that
watch a server close (or keep) raw connections.

Shared here so that tests never import from one another (no test module imports from a
``test_*`` module; ``tests/unit/test_no_cross_test_imports.py`` checks it).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def gone(pid: int) -> bool:
    """No such process, or a zombie (exited, waiting for whoever adopted it to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def still_open(sock: socket.socket) -> bool:
    """True when the server has neither closed ``sock`` nor sent anything on it."""
    sock.setblocking(False)
    try:
        return not sock.recv(1)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)
