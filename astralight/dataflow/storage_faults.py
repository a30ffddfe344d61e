"""The dataflow's SQLite state cannot be written: a full volume under ``state_dir``, or one that
is read-only or failing. What a request sees, and what the log says.

Every write of the service goes through :meth:`Store.tx <astralight.dataflow.store.Store.tx>`;
when SQLite refuses it for lack of space (``SQLITE_FULL``: "database or disk is full") or an
I/O error, the transaction is rolled back and :class:`WriteRefusals` turns the error into a
:class:`ServiceError` 507 Insufficient Storage naming ``state_dir`` (the weight store answers
its own full disk the same way, :func:`astralight.dataflow.weightfiles.fs_error`). Nothing of
the request was stored, so a client may send it again once there is room.

Logging is per episode, not per request: the first refused write logs one error line (the
folder, SQLite's error and the fix), the refusals after it only count, and the first write that
succeeds after a quiet spell (:class:`WriteRefusals`) logs one line with how many were refused
and for how long. Why: a full disk refuses every push, lease and ack, many per second; a
traceback each (what a generic 500 logged) filled 85 MB of log in one drill, on the very disk
that was full. The refusals are still counted per client in ``/v1/stats``.

Opening the state (:func:`opening_error`) turns the same errors, and a database SQLite cannot
read, into a :class:`StateDirError`: one line naming ``state_dir`` and what to do.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path
from typing import Callable

from astralight.dataflow.errors import ServiceError, StateDirError

log = logging.getLogger("astralight.dataflow")

#: SQLite's primary result codes (the low byte of an extended code)
SQLITE_CORRUPT, SQLITE_FULL, SQLITE_NOTADB = 11, 13, 26
SQLITE_IOERR, SQLITE_READONLY, SQLITE_CANTOPEN = 10, 8, 14


def _primary_code(exc: BaseException) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


def fault_kind(exc: BaseException) -> str | None:
    """``"full"`` for a write refused for lack of space, ``"io"`` for a state that cannot be
    written (I/O error, read-only), None for anything else (a bug, a constraint, a busy
    database). By SQLite's result code where the exception carries it, else by its message
    (an error raised by hand, or by an older Python)."""
    if not isinstance(exc, sqlite3.Error):
        return None
    code, text = _primary_code(exc), str(exc).lower()
    if code == SQLITE_FULL or "database or disk is full" in text:
        return "full"
    if code in (SQLITE_IOERR, SQLITE_READONLY) or "disk i/o error" in text \
            or "readonly database" in text:
        return "io"
    return None


def is_damaged(exc: BaseException) -> bool:
    """SQLite found the database unreadable: a bad header ("file is not a database") or
    damaged pages ("database disk image is malformed")."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code, text = _primary_code(exc), str(exc).lower()
    return code in (SQLITE_CORRUPT, SQLITE_NOTADB) or "malformed" in text \
        or "not a database" in text


#: what the operator does, per fault kind
FIX = {"full": "free space on that volume (or move state_dir to a bigger one)",
       "io": "check that volume (permissions, read-only mount, disk errors)"}
#: what happened, per fault kind
WHAT = {"full": "is full", "io": "cannot be written"}


def refusal(state_dir: Path, kind: str, exc: BaseException) -> str:
    """The message of a 507 for a write the state folder refused (worded like the weight
    store's own full disk: what happened, that nothing was stored, the fix)."""
    return (f"state_dir {state_dir} {WHAT[kind]} ({exc}); nothing of this request was stored: "
            f"{FIX[kind]} and retry")


class WriteRefusals:
    """Turns refused writes into 507s and logs each episode of the fault once (module
    docstring). Called under the service core's lock, like every store access.

    An episode ends at the first write that succeeds ``quiet_s`` seconds or more after the last
    refusal, not at the first success: on a full volume some writes still fit (updates, once a
    checkpoint let SQLite reuse its WAL from the start) while inserts fail, and ending the
    episode at each would log two lines per flip. :meth:`close` ends one still open.
    """

    #: seconds without a refusal before a successful write ends the episode
    QUIET_S = 10.0

    def __init__(self, state_dir: Path, quiet_s: float = QUIET_S,
                 clock: Callable[[], float] = time.monotonic):
        self.state_dir = Path(state_dir)
        self.quiet_s = quiet_s
        self.clock = clock
        self.refused = 0  # writes refused in the current episode (0: none under way)
        self.total = 0  # writes refused since start
        self._since = self._last = 0.0

    def refuse(self, exc: BaseException) -> ServiceError | None:
        """The 507 for ``exc`` if it is a storage fault (:func:`fault_kind`), else None; the
        first refusal of an episode logs its one line."""
        kind = fault_kind(exc)
        if kind is None:
            return None
        now = self.clock()
        if not self.refused:
            self._since = now
            log.error("state_dir %s %s (%s): every write is refused with 507 and nothing of it "
                      "is stored until %s; refusals are counted, not logged one by one",
                      self.state_dir, WHAT[kind], exc, FIX[kind])
        self.refused += 1
        self.total += 1
        self._last = now
        return ServiceError(507, "state_dir", refusal(self.state_dir, kind, exc), logged=True)

    def succeeded(self) -> None:
        """A write committed: ends an episode under way once no write was refused for
        ``quiet_s``, with its one line."""
        if self.refused and self.clock() - self._last >= self.quiet_s:
            self._end("writes succeed again")

    def close(self) -> None:
        """The store closes: ends an episode still open with its line."""
        if self.refused:
            self._end("closing")

    def _end(self, why: str) -> None:
        log.warning("state_dir %s: %s; %d write(s) were refused with 507 over %.0f s",
                    self.state_dir, why, self.refused, self._last - self._since)
        self.refused = 0


def opening_error(state_dir: Path, db_path: Path, exc: BaseException) -> StateDirError:
    """The one-line :class:`StateDirError` for an SQLite error while opening the state."""
    if is_damaged(exc):
        return StateDirError(
            f"state_dir: {db_path} is damaged ({exc}); the dataflow will not start on it. Restore "
            f"state_dir {state_dir} from a backup, or start with a fresh state_dir (the run's "
            "trained weights are in the trainer's checkpoints)")
    kind = fault_kind(exc)
    if kind is not None:
        return StateDirError(f"state_dir: {state_dir} {WHAT[kind]} ({exc}); the dataflow cannot "
                             f"open its state there: {FIX[kind]} and start it again")
    return StateDirError(f"state_dir: cannot open the dataflow database {db_path} ({exc}); check "
                         f"that state_dir {state_dir} is a writable folder on a local file "
                         "system, or start with a fresh state_dir")
