"""The WeightPublisher's encoder process ignores SIGTERM and ends with its trainer (issue 40).

Slurm's scancel and time limit send SIGTERM to every process of the trainer's job step at once;
the encoder process died of it (``the encoder process exited (rc=-15)``) while the trainer, which
stops gracefully on the same signal, still had its last version to publish through it. The
trainer ends the encoder itself: a stop op, or end of input when the trainer exits.
"""

from __future__ import annotations

import os
import signal
import time

from astralight.weights.publish_worker import _Encoder
from astralight.weights.slots import new_slot_fd


def _ignores_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return bool(ignored & (1 << (signal.SIGTERM - 1)))


def test_encoder_survives_sigterm_and_ends_at_end_of_input():
    fds = [new_slot_fd(16), new_slot_fd(16)]
    try:
        enc = _Encoder(["--url", "http://127.0.0.1:9", "--model-id", "policy"], fds, token=None)
        deadline = time.monotonic() + 120  # bound on start-up (imports), not a timing assertion
        while not _ignores_sigterm(enc.proc.pid):
            assert enc.proc.poll() is None, "the encoder exited during start-up"
            assert time.monotonic() < deadline, "the encoder never set SIGTERM to ignored"
            time.sleep(0.05)
        os.kill(enc.proc.pid, signal.SIGTERM)  # pending at once: delivered before it reads EOF
        enc.proc.stdin.close()                 # what the trainer's exit does
        assert enc.proc.wait(timeout=120) == 0  # ended by end of input, not killed (-15)
        enc.proc.stdout.close()
    finally:
        for fd in fds:
            os.close(fd)
