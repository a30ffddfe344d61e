"""A dataflow port in use fails before the state folder is written, naming ``port`` and the fix
(it used to print uvicorn's bare message after the SQLite state was created and evals were
scheduled)."""

from __future__ import annotations

import socket

import pytest

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.service import listen_socket, main, serve


def test_a_port_in_use_is_refused_before_the_state_is_opened(tmp_path, caplog):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        state = tmp_path / "state"
        with pytest.raises(ValueError, match=rf"port: 127.0.0.1:{port} is already in use.*--port 0"):
            serve(DataflowConfig(state_dir=str(state), port=port))
        assert not state.exists()  # nothing written
        assert main(["--state_dir", str(state), "--port", str(port)]) == 2
        assert "--port 0" in caplog.text and not state.exists()  # (logged: the exit-2 line)
    finally:
        taken.close()


def test_the_listening_socket_takes_port_0_and_a_free_port():
    sock = listen_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()
