"""Group commit for the dataflow's SQLite state: many commits share one fsync, and no answer
goes out before what it depends on is on disk.

With ``group_commit: true`` (the default) the store runs SQLite in WAL mode with
``synchronous=NORMAL``: a COMMIT appends its frames to the ``-wal`` file with write(2) -- they
are in the OS page cache, so a kill -9 of the service loses nothing -- but does not fsync.
:class:`GroupSync` then makes commits durable in groups: the first request that waits becomes the
leader and fsyncs the WAL once for every commit made so far; commits made during that fsync
gather for the next one; followers whose commit an fsync covered return without one of their own.
:class:`DurableLock` is the service core's lock: its outermost release waits -- after releasing,
so other requests commit meanwhile and join the next fsync -- until every commit made before the
release is durable. A push (single or batched), and every other answer, therefore leaves only
once the state it reports cannot be undone by a crash or a power loss.

Why WAL + NORMAL + an fsync of the WAL is durable: in WAL mode a commit only appends frames to
the WAL; the database file changes only at checkpoints, which (with NORMAL) sync the WAL before
copying and the database after, and the WAL header is synced when the file is reused from its
start. So once the WAL is fsynced, every transaction committed before is on disk, whether it is
still in the WAL or a checkpoint has already moved it into the database.

With ``group_commit: false`` SQLite fsyncs inside every COMMIT (``synchronous=FULL``, under the
core's lock: one fsync per commit, the behaviour before group commit) and the waits here return
at once.

Whenever commits become durable (after the fsync that covers them; without group commit, at each
commit), :class:`GroupSync` writes the store's count of the newest of them to the commit counter
outside SQLite (:class:`~astralight.dataflow.commit_counter.CommitCounter`), before anyone
waiting for them is released: every answered write is counted there, and the count never runs
ahead of the disk (what detects a lost WAL at the next start).
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from astralight.atomic_files import fsync_path
from astralight.dataflow.commit_counter import CommitCounter
from astralight.dataflow.errors import ServiceError

log = logging.getLogger("astralight.dataflow")


class GroupSync:
    """Numbers commits and makes them durable with as few fsyncs of the WAL as possible.

    ``committed()`` is called right after each COMMIT returns (under the core's lock), ``wait(n)``
    by whoever must not answer before commit ``n`` is durable (outside the lock). An fsync
    failure poisons the object: the kernel may have dropped the dirty pages and a later fsync
    could report success without writing them, so no later commit is confirmed either.

    ``counter``: the commit counter outside SQLite, written with the store's count (``seq`` of
    :meth:`committed`) of the newest commit each time commits become durable.
    """

    def __init__(self, wal_path: Path, db_path: Path, enabled: bool,
                 counter: CommitCounter | None = None):
        self.wal_path = Path(wal_path)
        self.db_path = Path(db_path)
        self.enabled = enabled
        self._cond = threading.Condition()
        self._committed = 0  # commits made, numbered from 1
        self._durable = 0  # every commit up to this one is on disk
        self._leader = False  # an fsync is under way
        self._failure: OSError | None = None
        self.fsyncs = 0
        self.counter = counter
        self._seq: int | None = None  # the store's count of the newest commit (None: not told)

    @property
    def last(self) -> int:
        """The number of the newest commit (what a wait for 'everything so far' waits for)."""
        return self._committed

    def committed(self, seq: int | None = None) -> int:
        """Count a COMMIT that just returned; returns its number. ``seq``: the store's count of
        committed transactions it reached (for the commit counter). Without group commit SQLite
        fsynced it already, so it is durable at once."""
        with self._cond:
            self._committed += 1
            if seq is not None:
                self._seq = seq
            if not self.enabled:
                self._durable = self._committed
                self.fsyncs += 1
                self._count(self._seq)
            return self._committed

    def counters(self) -> dict:
        """``commits`` and ``fsyncs`` so far (fewer fsyncs than commits: commits shared them)."""
        with self._cond:
            return {"group_commit": self.enabled, "commits": self._committed,
                    "fsyncs": self.fsyncs, "durable": self._durable}

    def wait(self, upto: int | None = None) -> None:
        """Return once commit ``upto`` (default: every commit made so far) is durable, leading
        an fsync if none is under way, else waiting for the one that is (and maybe the next)."""
        with self._cond:
            target = self._committed if upto is None else upto
            while self._durable < target:
                self._raise_if_failed()
                if self._leader:
                    self._cond.wait()
                else:
                    self._lead()
            self._raise_if_failed(target)

    def _lead(self) -> None:
        """With the condition held: fsync the WAL for every commit made so far, with the
        condition released meanwhile so that new commits (and waiters) gather for the next."""
        self._leader = True
        cover, seq = self._committed, self._seq
        self._cond.release()
        error = None
        try:
            self._fsync()
            self._count(seq)  # before the waiters go: every answered write is counted
        except OSError as exc:
            error = exc
        finally:
            self._cond.acquire()
            self._leader = False
            self._cond.notify_all()
        if error is not None:
            log.critical("fsync of %s failed: %s; no further write can be confirmed, restart the "
                         "dataflow service", self.wal_path, error)
            self._failure = error
            return
        self.fsyncs += 1
        self._durable = max(self._durable, cover)

    def _fsync(self) -> None:
        """fsync the WAL; without one (the last connection closed and SQLite checkpointed it
        into the database and removed it), the database file."""
        try:
            fsync_path(self.wal_path)
        except FileNotFoundError:
            fsync_path(self.db_path)

    def _raise_if_failed(self, target: int | None = None) -> None:
        if self._failure is not None and (target is None or self._durable < target):
            raise ServiceError(503, "state_dir", f"fsync of the SQLite WAL {self.wal_path} failed "
                                                 f"({self._failure}); this write may not be on disk"
                                                 " and no later one can be confirmed: restart the "
                                                 "dataflow service (it recovers what SQLite kept)")

    def mark_durable(self) -> None:
        """Everything committed is on disk by other means (a checkpoint that synced the
        database, at close)."""
        with self._cond:
            self._durable = self._committed
            self._count(self._seq)

    def _count(self, seq: int | None) -> None:
        """Write ``seq`` (the count of the newest durable commit) to the commit counter; never
        raises (:meth:`CommitCounter.write`)."""
        if self.counter is not None and seq is not None:
            self.counter.write(seq)


class DurableLock:
    """The service core's re-entrant lock; its outermost release waits until every commit made
    before the release is durable (see the module docstring).

    The wait happens after the lock is released, so other requests run (and commit) during the
    fsync; that is what lets one fsync cover many requests. Inside :meth:`deferred` the
    releases do not wait: a batched request waits once, at its end, for all of its commits.
    """

    def __init__(self, sync: GroupSync):
        self._lock = threading.RLock()
        self._sync = sync
        self._local = threading.local()

    def _get(self, name: str) -> int:
        return getattr(self._local, name, 0)

    def __enter__(self) -> "DurableLock":
        self._lock.acquire()
        self._local.depth = self._get("depth") + 1
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        depth = self._get("depth") - 1
        self._local.depth = depth
        upto = self._sync.last  # read under the lock: every commit this release could reveal
        self._lock.release()
        if depth == 0 and not self._get("deferred"):
            self._wait(upto, failing=exc is not None)
        return False

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Run several locked steps (each releasing the lock in between) and wait for their
        durability once, when the block ends."""
        self._local.deferred = self._get("deferred") + 1
        failing = False
        try:
            yield
        except BaseException:
            failing = True
            raise
        finally:
            self._local.deferred -= 1
            if not self._local.deferred and not self._get("depth"):
                self._wait(self._sync.last, failing)

    def _wait(self, upto: int, failing: bool) -> None:
        """Wait for durability; while an exception is already on its way out, only log a
        failed wait (the original error is what the caller needs to see)."""
        if not failing:
            self._sync.wait(upto)
            return
        try:
            self._sync.wait(upto)
        except ServiceError:
            log.exception("durability wait failed while handling another error")
