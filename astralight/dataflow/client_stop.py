"""Stop waiting for the dataflow: the process-wide flag every client's retry loop polls, and the
SIGTERM handler that sets it.

A process asked to stop (SIGTERM) while a :class:`~astralight.dataflow.client.DataflowClient`
call retries an unreachable service must not sleep out ``retry_s``: :func:`wake_on_sigterm`
installs a handler that sets :data:`STOP_WAITING`, and the retry loop then raises
:class:`~astralight.dataflow.client_errors.DataflowStopped` at once.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class StopWaiting:
    """A process-wide "stop waiting" flag: once set, no :class:`DataflowClient` in the process
    retries an unreachable service any more (each call still makes its first attempt, so a
    reachable dataflow is still told goodbye); a call already retrying raises
    :class:`DataflowStopped` within :data:`~astralight.dataflow.client.STOP_POLL_S`.

    A plain attribute, not a ``threading.Event``: it is set from a signal handler, which runs
    between two bytecodes of the main thread, possibly inside ``Event.wait``'s own lock (setting
    an Event there can deadlock); the retry loop polls it instead."""

    def __init__(self):
        self.reason: str | None = None

    def set(self, reason: str = "stop requested") -> None:
        self.reason = reason

    def clear(self) -> None:
        self.reason = None

    def is_set(self) -> bool:
        return self.reason is not None


#: set by :func:`wake_on_sigterm`'s handler (or by hand); read by every client's retry loop
STOP_WAITING = StopWaiting()
#: what SIGTERM did before :func:`wake_on_sigterm` replaced it
_PREVIOUS_SIGTERM: dict[int, Any] = {}


def _on_sigterm(signum, frame) -> None:
    """SIGTERM handler of :func:`wake_on_sigterm`: stop every retry loop, then let the signal do
    what it did before. Called through another handler that chained this one (Lightning's, during
    ``fit``: it stops the fit at the next step), only the flag is set: that handler acts on the
    signal. Installed alone, the previous action follows: the previous handler, or the default
    action (the process ends) when there was none."""
    STOP_WAITING.set(f"{signal.Signals(signum).name} received")
    if signal.getsignal(signum) is not _on_sigterm:
        return  # a handler that chained this one is handling the signal
    previous = _PREVIOUS_SIGTERM.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous in (signal.SIG_DFL, None):  # (None: a handler not set from Python)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def wake_on_sigterm() -> bool:
    """Make SIGTERM wake every retrying dataflow call of this process (:data:`STOP_WAITING`),
    keeping what SIGTERM did before (see :func:`_on_sigterm`). ``astralight fit`` calls it at
    start-up; Lightning's own SIGTERM handler, installed when ``fit`` begins, chains it. Only the
    main thread can install signal handlers: elsewhere this does nothing and returns False."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return True
    _PREVIOUS_SIGTERM[signal.SIGTERM] = current
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True
