"""The start-up integrity check of the dataflow's SQLite state: ``PRAGMA quick_check``, bounded
in time and reported.

Why: damaged pages (a flipped disk block, a bad copy) used to go unnoticed -- in one drill the
service started on a database with 64 overwritten pages and answered 200 -- until a query hit
them mid-run, or never, while the state silently said something else than what was committed.
``quick_check`` walks every b-tree page (structure, cell bounds, free list, overflow chains;
not index-vs-table consistency, which the slower ``integrity_check`` adds) before the service
reads anything else.

It reads the whole database, so its time grows with it (roughly the time to read the file):
:func:`quick_check` stops it after ``limit_s`` seconds (the service's ``integrity_check_s``, 0:
skip) and says so -- a partial check found nothing in the part it read. Two mechanisms stop it,
because SQLite before 3.43 calls no progress handler while it walks the b-trees (one VM step,
most of the time): a timer thread that interrupts the connection at the deadline
(``sqlite3_interrupt``, which that walk does check), and a progress handler that looks at the
clock between the row checks that follow. Each start logs one line with the size, the time
taken and the outcome; a damaged database is a :class:`StateDirError` naming ``state_dir`` and
what to do.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from astralight.dataflow.errors import StateDirError
from astralight.dataflow.storage_faults import is_damaged

log = logging.getLogger("astralight.dataflow")

#: SQLite virtual-machine steps between two looks at the clock (well under a millisecond)
PROGRESS_STEPS = 1_000
#: problems quoted in the error line (quick_check lists up to 100)
QUOTE = 3


@dataclass
class CheckResult:
    """What one check found: ``problems`` (quick_check's lines; empty: none), ``complete``
    (false: stopped at the time limit), ``seconds`` taken and ``bytes`` checked."""

    problems: list[str]
    complete: bool
    seconds: float
    bytes: int

    def line(self, db_path: Path) -> str:
        size = f"{self.bytes / 2 ** 20:.1f} MiB"
        if self.problems:
            return f"quick_check of {db_path} ({size}) found damage in {self.seconds:.2f} s"
        if not self.complete:
            return (f"quick_check of {db_path} ({size}) stopped after {self.seconds:.1f} s "
                    "(integrity_check_s) before the end; nothing wrong in the part it read "
                    "(raise integrity_check_s to check all of it)")
        return f"quick_check of {db_path} ({size}): ok in {self.seconds:.2f} s"


def quick_check(conn: sqlite3.Connection, limit_s: float,
                clock: Callable[[], float] = time.monotonic) -> CheckResult:
    """Run ``PRAGMA quick_check`` on ``conn``, stopped after ``limit_s`` seconds (``clock``: what
    the progress handler reads; the timer thread keeps real time)."""
    started = clock()
    deadline = started + limit_s
    size = _db_bytes(conn)
    running, guard = [True], threading.Lock()

    def interrupt() -> None:  # never once the check is over: it would hit a later statement
        with guard:
            if running[0]:
                conn.interrupt()

    timer = threading.Timer(limit_s, interrupt)
    timer.daemon = True
    conn.set_progress_handler(lambda: int(clock() > deadline), PROGRESS_STEPS)
    timer.start()
    try:
        rows = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
        complete = True
    except sqlite3.DatabaseError as exc:
        if "interrupt" in str(exc).lower():
            rows, complete = ["ok"], False  # stopped at the deadline: nothing found so far
        elif is_damaged(exc):  # a page so damaged that the check itself gave up on it
            rows, complete = [str(exc)], True
        else:
            raise
    finally:
        with guard:
            running[0] = False
        timer.cancel()
        conn.set_progress_handler(None, 0)
    problems = [] if rows == ["ok"] else rows
    return CheckResult(problems, complete, clock() - started, size)


def _db_bytes(conn: sqlite3.Connection) -> int:
    page = conn.execute("PRAGMA page_size").fetchone()[0]
    return int(page) * int(conn.execute("PRAGMA page_count").fetchone()[0])


def check_integrity(state_dir: Path, db_path: Path, conn: sqlite3.Connection,
                    limit_s: float) -> CheckResult | None:
    """The start-up check (``limit_s`` <= 0: skipped, None); logs its one line and raises
    :class:`StateDirError` for a damaged database."""
    if limit_s <= 0:
        return None
    result = quick_check(conn, limit_s)
    if result.problems:
        # (one line: quick_check's own lines may hold newlines, "*** in database main ***\n...")
        quoted = "; ".join(" ".join(p.split())[:160] for p in result.problems[:QUOTE])
        more = len(result.problems) - QUOTE
        quoted += f" (and {more} more)" if more > 0 else ""
        raise StateDirError(
            f"state_dir: {result.line(db_path)}: {quoted}; the dataflow will not start on it. Restore state_dir {state_dir} from a backup, "
            "or start with a fresh state_dir (the run's trained weights are in the trainer's "
            "checkpoints)")
    (log.info if result.complete else log.warning)("state_dir: %s", result.line(db_path))
    return result
