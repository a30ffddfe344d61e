"""A count of the dataflow's committed transactions kept twice: in SQLite and outside it.

Why: SQLite's WAL holds every transaction committed since the last checkpoint. If the ``-wal``
file is deleted or damaged (a copy without it, a cleanup script, a bad disk), SQLite opens the
database without those transactions and says nothing: in one drill 18 acknowledged pushes and 7
acks vanished and the audit still balanced, because it compared two ledgers that lost the same
transactions. A counter that lives outside SQLite does not go back with it.

* In SQLite: ``meta['commits']``, incremented inside every :meth:`Store.tx
  <astralight.dataflow.store.Store.tx>` transaction that changed something (an empty one writes
  nothing, so it is not counted).
* Outside: the file ``state_dir/dataflow.commits`` (:class:`CommitCounter`), rewritten with the
  count of the newest durable commit each time commits become durable
  (:class:`~astralight.dataflow.durability.GroupSync`: after each fsync of the WAL, which covers
  many commits; without group commit, after every commit), before any request waiting for them
  is answered. So the file never runs ahead of what is on disk, and every answered write is
  counted in it.

The database may be ahead of the file (a crash between a commit and its fsync, or between the
fsync and the file's rename), never behind it: behind means committed transactions are gone.
:func:`check_commits` refuses to start on such a state (unless ``allow_lost_commits``), and
:func:`astralight.dataflow.audit.audit` reports it as a mismatch.

Cost and durability of the file: one ``pwrite`` of a 42-byte record in place (the count twice,
:class:`CommitCounter`), a few microseconds -- once per fsync group, next to an fsync of
milliseconds. It is not fsynced: that would double the fsyncs per group, and a file that a power
cut rolls back is merely behind (a weaker check for that one crash, no false alarm); the losses
it exists for -- a WAL deleted, truncated or damaged while the machine runs -- leave it intact.
A missing, torn or unreadable file disables the check until the next write.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

from astralight.dataflow.errors import StateDirError

log = logging.getLogger("astralight.dataflow")

#: meta keys: the database's own count of committed transactions, and the commits found lost
#: (and accepted with ``allow_lost_commits``) at earlier starts
DB_KEY = "commits"
LOST_KEY = "commits_lost"


def counter_path(db_path: Path) -> Path:
    """Where the count outside SQLite lives: beside the database, ``dataflow.commits``."""
    return Path(db_path).with_suffix(".commits")


#: digits of each of the two copies of the count in the file (fixed width: every write
#: overwrites the same bytes)
WIDTH = 20
#: how often :meth:`CommitCounter.read` tries again when the two copies differ (a write seen
#: half-way by a concurrent reader)
READ_TRIES = 5


def record(count: int) -> bytes:
    """The file's content for ``count``: the count twice, fixed width, one line."""
    return b"%0*d %0*d\n" % (WIDTH, count, WIDTH, count)


def parse(data: bytes) -> int | None:
    """The count of a :func:`record`, or None when its two copies differ or it is no record."""
    parts = data.split(b"\n", 1)[0].split()
    if len(parts) != 2 or parts[0] != parts[1] or not parts[0].isdigit():
        return None
    return int(parts[0])


class CommitCounter:
    """The file holding the count of the newest durable commit.

    It is overwritten in place with one ``pwrite`` of a fixed-width record through a descriptor
    kept open (a few microseconds), not replaced by a rename: on ext4 a rename over an existing
    file starts writeback of the new one (``auto_da_alloc``), about 1.4 ms on a loaded disk --
    as much as a quarter of the fsync it follows (``tests/benchmarks/bench_commit_counter.py``).
    A record that a reader sees half-written, or that a crash tore, has two copies that differ:
    it reads as unknown (the check is off until the next write), never as a wrong count.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.written: int | None = None  # the last count written by this process
        self._fd: int | None = None
        self._failing = False

    def read(self) -> int | None:
        """The count in the file; None when there is none or it cannot be read (logged)."""
        data = b""
        for _ in range(READ_TRIES):
            try:
                data = self.path.read_bytes()
            except FileNotFoundError:
                return None
            except OSError as exc:
                log.warning("state_dir: cannot read %s (%s); the lost-commit check is off until "
                            "the service rewrites it", self.path, exc)
                return None
            count = parse(data)
            if count is not None:
                return count
        log.warning("state_dir: %s does not hold a commit count (%r); the lost-commit check is "
                    "off until the service rewrites it", self.path, data[:48])
        return None

    def write(self, count: int) -> None:
        """Overwrite the file with ``count`` (in place, no fsync: see the class and the module).
        A failure (the disk is full) leaves the file behind, which is safe; it is logged once
        per run of failures and never raised: the commits it counts are durable already."""
        if count == self.written:
            return
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            os.pwrite(self._fd, record(count), 0)
        except OSError as exc:
            if not self._failing:
                log.warning("state_dir: cannot update %s (%s); it stays behind the database "
                            "until a later write succeeds", self.path, exc)
            self._failing = True
            return
        if self._failing:
            log.info("state_dir: %s is updated again", self.path)
        self._failing = False
        self.written = count

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def db_count(conn: sqlite3.Connection, key: str = DB_KEY) -> int:
    """The database's count under ``key`` (0 for a state written before it existed, or a
    database with no tables yet)."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'"
                    ).fetchone() is None:
        return 0
    row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
    return int(row[0]) if row is not None else 0


def set_db_count(conn: sqlite3.Connection, value: int, key: str = DB_KEY) -> None:
    """Store ``value`` under ``key`` (inside the caller's transaction)."""
    conn.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET "
                 "value=excluded.value", (key, str(int(value))))


def lost_message(state_dir: Path, in_db: int, in_file: int, file: Path) -> str:
    """What the database's count behind the file's means, and the three ways on."""
    return (f"state_dir: the database in {state_dir} holds {in_db} committed transactions but "
            f"{file.name} counted {in_file} durable ones: {in_file - in_db} committed "
            "transactions are lost (the dataflow.db-wal file was deleted, truncated or damaged, "
            "or dataflow.db was replaced by an older copy). Restore the whole state_dir from a "
            "backup, or start with a fresh state_dir, or set allow_lost_commits: true in the "
            "dataflow config to go on from what is left (the audit keeps reporting the loss)")


def check_commits(state_dir: Path, conn: sqlite3.Connection, counter: CommitCounter,
                  allow_lost: bool) -> int:
    """At start, before anything is written: the commits lost since the file was last written
    (0 if none, or if there is no file to compare with). Raises :class:`StateDirError` when some
    are lost and ``allow_lost`` is false; else logs a warning, and the caller records them."""
    in_file, in_db = counter.read(), db_count(conn)
    if in_file is None or in_file <= in_db:
        counter.written = None if in_file is None else in_file
        return 0
    message = lost_message(state_dir, in_db, in_file, counter.path)
    if not allow_lost:
        raise StateDirError(message)
    log.warning("%s -- starting anyway (allow_lost_commits: true); the loss is recorded and the "
                "audit reports it", message.split(". Restore", 1)[0])
    return in_file - in_db
