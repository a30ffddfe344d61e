"""Durable state of the dataflow service: one SQLite file in WAL mode.

Everything that must survive ``kill -9`` lives here: tasks and their leases, accepted samples (the
msgpack-encoded :class:`Sample`), served batches until acknowledged (with their last keep-alive,
``renewed_at``), published versions and their manifests and publication times, eval reports,
counters, the prompt-source cursor, registered instances (their capacity, state and health
counters, and the limits their engines registered), the data plugins' state snapshots and the
curator journal (what the curators learned since the last snapshot). The in-memory fresh queues
are a cache rebuilt from the ``samples`` table on start. Queries return the typed rows of
:mod:`astralight.dataflow.rows` (JSON columns decoded there, once), never ``sqlite3.Row``.

Durability: with ``group_commit`` (what the service uses by default) SQLite runs with
``synchronous=NORMAL`` and :class:`~astralight.dataflow.durability.GroupSync` fsyncs the WAL for
many commits at once; every :meth:`Store.tx` commit is numbered there, and the service core's
lock waits for it before a request is answered (see :mod:`astralight.dataflow.durability`).
Without it, ``synchronous=FULL`` makes every commit fsync the WAL itself. Either way a push is
answered only once its samples are on disk. The store is not thread-safe on its own: the service
core serialises all access with one lock (SQLite serialises writers anyway) and wraps each
request in one :meth:`Store.tx`.

Faults of the state itself:

* Opening runs ``PRAGMA quick_check``, bounded by ``integrity_check_s``
  (:mod:`astralight.dataflow.integrity`), and compares the database's count of committed
  transactions with the count kept outside SQLite (:mod:`astralight.dataflow.commit_counter`):
  a damaged database, or one that lost committed transactions (a deleted or damaged WAL), is a
  :class:`StateDirError` -- one line naming ``state_dir`` and what to do -- never a traceback.
* A write SQLite refuses for lack of space or an I/O error is a 507 naming ``state_dir``, logged
  once per episode (:mod:`astralight.dataflow.storage_faults`).
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from astralight.atomic_files import fsync_path
from astralight.dataflow import commit_counter
from astralight.dataflow.durability import GroupSync
from astralight.dataflow.errors import StateDirError
from astralight.dataflow.integrity import check_integrity
from astralight.dataflow.storage_faults import WriteRefusals, opening_error
from astralight.dataflow.schema import MIGRATIONS, SCHEMA
from astralight.dataflow.rows import (BatchRow, EvalReportRow, EvalRunRow, InstanceRow,
                                      JournalEntry, SampleRow, TaskRow, VersionRow)
from astralight.dataflow.transaction import Transaction
from astralight.protocol import Task, decode

class Store:
    """A SQLite database under ``state_dir``; see the module docstring for what it holds."""

    def __init__(self, path: str | Path, group_commit: bool = False,
                 integrity_check_s: float = 60.0, allow_lost_commits: bool = False):
        """Open (or create) the database; ``group_commit``: see the module docstring (off: every
        commit fsyncs, for tools and tests that use a Store directly). ``integrity_check_s``:
        bound of the start-up ``quick_check`` (0: skip); ``allow_lost_commits``: open a state
        that lost committed transactions (recorded, and reported by the audit) instead of
        refusing. Raises :class:`StateDirError` for a state it must not open."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        #: writes refused for lack of space or an I/O error (507s, logged once per episode)
        self.refusals = WriteRefusals(self.path.parent)
        self.counter = commit_counter.CommitCounter(commit_counter.counter_path(self.path))
        self.conn: sqlite3.Connection | None = None
        try:
            lost = self._open(group_commit, integrity_check_s, allow_lost_commits)
        except BaseException as exc:
            if self.conn is not None:
                self.conn.close()
            if isinstance(exc, sqlite3.Error):  # one line naming state_dir, not a traceback
                raise opening_error(self.path.parent, self.path, exc) from None
            raise
        self.durability = GroupSync(Path(f"{self.path}-wal"), self.path, enabled=group_commit,
                                    counter=self.counter)
        if lost:  # accepted (allow_lost_commits): recorded, so the audit keeps reporting it
            with self.tx():
                commit_counter.set_db_count(self.conn, lost + commit_counter.db_count(
                    self.conn, commit_counter.LOST_KEY), commit_counter.LOST_KEY)
        if group_commit:  # the schema on disk, and the files' names in their folder
            self.durability.wait(self.durability.committed())
            fsync_path(self.path.parent)

    def _open(self, group_commit: bool, integrity_check_s: float, allow_lost: bool) -> int:
        """Connect, check the state (integrity, lost commits) and bring its schema up to date;
        returns the commits found lost (0 unless ``allow_lost``)."""
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per request.
        self.conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.conn.row_factory = sqlite3.Row
        mode = self.conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise StateDirError(f"state_dir: SQLite at {self.path} refused WAL mode (got {mode}); "
                                "put state_dir on a local file system")
        self.conn.execute(f"PRAGMA synchronous={'NORMAL' if group_commit else 'FULL'}")
        self.conn.execute("PRAGMA busy_timeout=10000")
        # the checks come before the schema and migrations write anything: a state refused is
        # left as it was found (for a backup, a forensic copy, or allow_lost_commits)
        #: the start-up quick_check's result (None: skipped)
        self.integrity = check_integrity(self.path.parent, self.path, self.conn,
                                         integrity_check_s)
        lost = commit_counter.check_commits(self.path.parent, self.conn, self.counter, allow_lost)
        self.conn.executescript(SCHEMA)
        self._migrate()
        #: the count of committed transactions (meta ``commits``; see :meth:`tx`)
        self.commit_seq = commit_counter.db_count(self.conn)
        return lost

    def _migrate(self) -> None:
        """Columns added after a state folder may have been created (additive only)."""
        for table, columns in MIGRATIONS.items():
            have = {r["name"] for r in self.conn.execute(f"PRAGMA table_info({table})")}
            for name, decl in columns:
                if name not in have:
                    self.conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
        # publication times of versions published before version_times existed (those weight
        # GC has not removed yet); the balance report's wall time needs them
        self.conn.execute("INSERT OR IGNORE INTO version_times(model_id, version, published_at)"
                          " SELECT model_id, version, published_at FROM versions")

    # ------------------------------------------------------------------ plumbing

    @contextmanager
    def tx(self, tx: Transaction | None = None) -> Iterator[Transaction]:
        """One write transaction; committed on exit (numbered in :attr:`durability`; fsynced
        there, or here without group commit), rolled back on error or when the commit fails.
        Yields the :class:`Transaction` (``tx``, or a new one) whose after-commit actions run
        once ``COMMIT`` succeeded and whose undo actions run on a rollback, a failed ``BEGIN``
        included (see :mod:`astralight.dataflow.transaction`)."""
        tx = Transaction() if tx is None else tx
        seq = self.commit_seq
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            changes = self.conn.total_changes
            yield tx
            if self.conn.total_changes != changes:  # it wrote: count it (commit_counter)
                seq += 1
                commit_counter.set_db_count(self.conn, seq)
            self.conn.execute("COMMIT")
        except BaseException as exc:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            tx.rolled_back()
            refused = self.refusals.refuse(exc)  # a full or failing volume: 507, logged once
            if refused is not None:
                raise refused from None
            raise
        if seq != self.commit_seq:
            self.commit_seq = seq
            self.refusals.succeeded()
        self.durability.committed(seq)
        tx.committed()

    def close(self) -> None:
        """Make every commit durable, checkpoint the WAL into the database and close."""
        try:
            self.durability.wait()
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.durability.mark_durable()
        finally:
            self.conn.close()
            self.counter.close()
            self.refusals.close()

    # ------------------------------------------------------------------ meta and counters

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return json.loads(row["value"]) if row else default

    def set_meta(self, key: str, value: Any) -> None:
        self.conn.execute("INSERT INTO meta(key, value) VALUES(?, ?) "
                          "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                          (key, json.dumps(value)))

    def bump(self, model_id: str, name: str, k: int = 1, version: int | None = None) -> None:
        """Add ``k`` to counter ``name`` of ``model_id`` (inside the caller's transaction); with
        ``version``, also to that counter of the policy version current at the event."""
        if k:
            self.conn.execute("INSERT INTO counters(model_id, name, value) VALUES(?, ?, ?) "
                              "ON CONFLICT(model_id, name) DO UPDATE SET value=value+excluded.value",
                              (model_id, name, k))
            if version is not None:
                self.conn.execute(
                    "INSERT INTO version_counters(model_id, version, name, value) VALUES(?, ?, ?, ?)"
                    " ON CONFLICT(model_id, version, name) DO UPDATE SET value=value+excluded.value",
                    (model_id, version, name, k))

    def version_counters(self, model_id: str, since: int = 0) -> dict[int, dict[str, int]]:
        """Counters of ``model_id`` per policy version (versions >= ``since``)."""
        out: dict[int, dict[str, int]] = {}
        for row in self.conn.execute("SELECT version, name, value FROM version_counters"
                                     " WHERE model_id=? AND version>=? ORDER BY version",
                                     (model_id, since)):
            out.setdefault(row["version"], {})[row["name"]] = row["value"]
        return out

    # ------------------------------------------------------------------ plugin state

    def plugin_states(self) -> dict[str, tuple[str, dict]]:
        """``name -> (class_path, state)`` of every saved data plugin."""
        return {r["name"]: (r["class_path"], json.loads(r["state"]))
                for r in self.conn.execute("SELECT name, class_path, state FROM plugin_state")}

    def save_plugin_state(self, name: str, class_path: str, state: dict, now: float) -> None:
        self.conn.execute("INSERT INTO plugin_state(name, class_path, state, saved_at)"
                          " VALUES(?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET"
                          " class_path=excluded.class_path, state=excluded.state,"
                          " saved_at=excluded.saved_at", (name, class_path, json.dumps(state), now))

    def journal(self, kind: str, data: dict) -> int:
        """Append what the prompt curators learn (``outcome``) or are told (``version``) to the
        journal, inside the caller's transaction; returns its sequence number. Replayed onto the
        last plugin snapshot at start, so curator state survives kill -9 exactly."""
        cur = self.conn.execute("INSERT INTO plugin_journal(kind, data) VALUES(?, ?)",
                                (kind, json.dumps(data)))
        return int(cur.lastrowid)

    def journal_after(self, seq: int) -> list[JournalEntry]:
        """Journal entries newer than ``seq``, oldest first."""
        return [JournalEntry.of(r) for r in self.conn.execute(
            "SELECT seq, kind, data FROM plugin_journal WHERE seq>? ORDER BY seq", (seq,))]

    def truncate_journal(self, through: int) -> None:
        """Forget entries a plugin snapshot already holds (seq <= ``through``)."""
        self.conn.execute("DELETE FROM plugin_journal WHERE seq<=?", (through,))

    def counters(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for row in self.conn.execute("SELECT model_id, name, value FROM counters"):
            out.setdefault(row["model_id"], {})[row["name"]] = row["value"]
        return out

    # ------------------------------------------------------------------ instances

    def instance(self, instance_id: str) -> InstanceRow | None:
        row = self.conn.execute("SELECT * FROM instances WHERE instance_id=?",
                                (instance_id,)).fetchone()
        return InstanceRow.of(row) if row is not None else None

    def upsert_instance(self, instance_id: str, model_ids: list[str], capacity: int, meta: dict,
                        now: float, capacity_units: float = 1.0,
                        lease_seconds: float | None = None, limits: dict | None = None) -> None:
        """Register a new instance, or reactivate a known one keeping its counters.

        A known instance that left (or went silent for more than ``lease_seconds``) starts a new
        stint: the time it was alive so far moves to ``alive_prior_s`` and ``registered_at``
        becomes now, so ``alive_s`` never counts the gap. A quick re-register (a restarted RaaS
        or dataflow) keeps the stint going. ``limits`` (what its engines said, per model_id)
        replaces what an earlier registration said.
        """
        row = self.instance(instance_id)
        limits_json = json.dumps(limits) if limits else None
        if row is None:
            self.conn.execute(
                "INSERT INTO instances(instance_id, model_ids, capacity, meta, registered_at,"
                " last_seen, capacity_units, state, limits)"
                " VALUES(?, ?, ?, ?, ?, ?, ?, 'active', ?)",
                (instance_id, json.dumps(model_ids), capacity, json.dumps(meta), now, now,
                 capacity_units, limits_json))
            return
        prior, start = float(row.alive_prior_s), row.registered_at
        if row.state == "left" and row.left_at is not None:
            prior, start = prior + max(0.0, row.left_at - start), now
        elif lease_seconds is not None and now - row.last_seen > lease_seconds:
            prior, start = prior + max(0.0, row.last_seen - start), now
        self.conn.execute(
            "UPDATE instances SET model_ids=?, capacity=?, meta=?, capacity_units=?, last_seen=?,"
            " state='active', left_at=NULL, registered_at=?, alive_prior_s=?, limits=?"
            " WHERE instance_id=?",
            (json.dumps(model_ids), capacity, json.dumps(meta), capacity_units, now, start, prior,
             limits_json, instance_id))

    def touch_instance(self, instance_id: str, now: float, leased: int = 0, pushed: int = 0) -> None:
        self.conn.execute("UPDATE instances SET last_seen=?, tasks_leased=tasks_leased+?,"
                          " samples_pushed=samples_pushed+? WHERE instance_id=?",
                          (now, leased, pushed, instance_id))

    def set_instance_state(self, instance_id: str, state: str, now: float | None = None) -> None:
        """``draining`` or ``left`` (with ``left_at=now``)."""
        if state == "left":
            self.conn.execute("UPDATE instances SET state='left', left_at=? WHERE instance_id=?",
                              (now, instance_id))
        else:
            self.conn.execute("UPDATE instances SET state=? WHERE instance_id=?",
                              (state, instance_id))

    def set_reported_in_flight(self, instance_id: str, n: int) -> None:
        self.conn.execute("UPDATE instances SET reported_in_flight=? WHERE instance_id=?",
                          (n, instance_id))

    def instance_done(self, instance_id: str, busy_s: float | None) -> None:
        """A successful push: one more task done, the fail streak reset, and (when the pusher
        held the lease, so lease->push is known) its busy time."""
        self.conn.execute(
            "UPDATE instances SET tasks_done=tasks_done+1, fail_streak=0, busy_s=busy_s+?,"
            " tasks_timed=tasks_timed+? WHERE instance_id=?",
            (busy_s or 0.0, 1 if busy_s is not None else 0, instance_id))

    def instance_failed(self, instance_id: str, n: int = 1) -> None:
        """``n`` tasks failed on the instance (lease expired, or returned as failed)."""
        self.conn.execute("UPDATE instances SET tasks_failed=tasks_failed+?,"
                          " fail_streak=fail_streak+? WHERE instance_id=?", (n, n, instance_id))

    def instance_returned(self, instance_id: str, n: int) -> None:
        self.conn.execute("UPDATE instances SET tasks_returned=tasks_returned+? WHERE instance_id=?",
                          (n, instance_id))

    def held_leases(self, now: float, instance_id: str | None = None) -> dict[str, int]:
        """Unexpired leases per instance (all instances, or just ``instance_id``)."""
        if instance_id is not None:
            n = self.conn.execute("SELECT COUNT(*) FROM tasks WHERE state='leased' AND"
                                  " instance_id=? AND deadline>?", (instance_id, now)).fetchone()[0]
            return {instance_id: n}
        rows = self.conn.execute("SELECT instance_id, COUNT(*) FROM tasks WHERE state='leased'"
                                 " AND deadline>? GROUP BY instance_id", (now,)).fetchall()
        return {r[0]: r[1] for r in rows}

    def return_tasks(self, instance_id: str, task_ids: list[str] | None, now: float) -> list[str]:
        """Make tasks leased by ``instance_id`` (all of them with ``task_ids=None``) and not done
        leasable at once (state ``pending``, deadline now); returns the ids moved."""
        if task_ids is None:
            rows = self.conn.execute("SELECT task_id FROM tasks WHERE state='leased' AND"
                                     " instance_id=?", (instance_id,)).fetchall()
            ids = [r[0] for r in rows]
        else:
            ids = []
            for tid in dict.fromkeys(task_ids):  # once each, in order
                row = self.conn.execute("SELECT state, instance_id FROM tasks WHERE task_id=?",
                                        (tid,)).fetchone()
                if row is not None and row[0] == "leased" and row[1] == instance_id:
                    ids.append(tid)
        self.conn.executemany("UPDATE tasks SET state='pending', deadline=? WHERE task_id=?",
                              [(now, tid) for tid in ids])
        return ids

    def instances(self) -> list[InstanceRow]:
        return [InstanceRow.of(r) for r in
                self.conn.execute("SELECT * FROM instances ORDER BY registered_at")]

    # ------------------------------------------------------------------ tasks

    def insert_task(self, task_id: str, kind: str, model_ids: list[str], payload: bytes, now: float,
                    prompt_index: int | None = None, target_model: str | None = None,
                    eval_version: int | None = None) -> None:
        self.conn.execute(
            "INSERT INTO tasks(task_id, kind, model_ids, target_model, eval_version, prompt_index,"
            " payload, state, created) VALUES(?, ?, ?, ?, ?, ?, ?, 'pending', ?)",
            (task_id, kind, json.dumps(model_ids), target_model, eval_version, prompt_index,
             payload, now))

    def task(self, task_id: str) -> TaskRow | None:
        row = self.conn.execute("SELECT * FROM tasks WHERE task_id=?", (task_id,)).fetchone()
        return TaskRow.of(row) if row is not None else None

    def leasable_tasks(self, kind: str, now: float) -> list[TaskRow]:
        """Tasks of ``kind`` never leased or whose lease expired, oldest first."""
        return [TaskRow.of(r) for r in self.conn.execute(
            "SELECT * FROM tasks WHERE kind=? AND (state='pending' OR (state='leased' AND deadline<?))"
            " ORDER BY seq", (kind, now))]

    def mark_leased(self, task_id: str, instance_id: str, deadline: float,
                    now: float | None = None) -> None:
        self.conn.execute("UPDATE tasks SET state='leased', instance_id=?, deadline=?,"
                          " leased_at=?, lease_count=lease_count+1 WHERE task_id=?",
                          (instance_id, deadline, now, task_id))

    def mark_done(self, task_id: str, now: float) -> None:
        self.conn.execute("UPDATE tasks SET state='done', done_at=? WHERE task_id=?", (now, task_id))

    def open_tasks(self, kind: str) -> list[Task]:
        """The :class:`Task` of every open (not done) task of ``kind``."""
        return [decode(bytes(r[0])) for r in self.conn.execute(
            "SELECT payload FROM tasks WHERE kind=? AND state!='done'", (kind,))]

    def count_open_tasks(self, kind: str) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM tasks WHERE kind=? AND state!='done'",
                                 (kind,)).fetchone()[0]

    # ------------------------------------------------------------------ samples

    def insert_sample(self, task_id: str, model_id: str, sample_index: int, min_version: int,
                      reward: float, blob: bytes, now: float, state: str = "queued") -> int:
        """Store an accepted sample (``queued``) or one a sample filter dropped (``filtered``)."""
        cur = self.conn.execute(
            "INSERT INTO samples(task_id, model_id, sample_index, min_version, reward, state, blob,"
            " created) VALUES(?, ?, ?, ?, ?, ?, ?, ?)",
            (task_id, model_id, sample_index, min_version, reward, state, blob, now))
        return int(cur.lastrowid)

    def replay_candidates(self, model_id: str, min_version: int, limit: int) -> list[SampleRow]:
        """The newest ``limit`` trained samples of ``model_id`` not older than ``min_version``,
        with how often each was replayed (what a restarted service's replay pool holds)."""
        return [SampleRow.of(r) for r in self.conn.execute(
            "SELECT s.id, s.model_id, s.min_version, s.state, s.blob, (SELECT COUNT(*) FROM"
            " replays r WHERE r.sample_id=s.id AND r.state IN ('served', 'acked')) AS uses"
            " FROM samples s WHERE s.model_id=? AND s.state='acked' AND s.min_version>=?"
            " ORDER BY s.id DESC LIMIT ?", (model_id, min_version, limit))]

    # ------------------------------------------------------------------ replays

    def insert_replays(self, batch_id: str, sample_ids: list[int]) -> None:
        self.conn.executemany("INSERT INTO replays(batch_id, sample_id, state) VALUES(?, ?, 'served')",
                              [(batch_id, i) for i in sample_ids])

    def set_replay_state(self, batch_id: str, state: str) -> int:
        """Move a batch's replayed samples to ``state``; returns how many it had."""
        return self.conn.execute("UPDATE replays SET state=? WHERE batch_id=?",
                                 (state, batch_id)).rowcount

    def replay_count(self, batch_id: str) -> int:
        """Replayed samples a batch carried (whatever their state now)."""
        return self.conn.execute("SELECT COUNT(*) FROM replays WHERE batch_id=?",
                                 (batch_id,)).fetchone()[0]

    def queued_samples(self) -> list[SampleRow]:
        return [SampleRow.of(r) for r in self.conn.execute(
            "SELECT id, model_id, min_version, state, blob FROM samples WHERE state='queued'"
            " ORDER BY id")]

    def set_sample_state(self, ids: list[int], state: str, batch_id: str | None = None) -> None:
        self.conn.executemany("UPDATE samples SET state=?, batch_id=COALESCE(?, batch_id) WHERE id=?",
                              [(state, batch_id, i) for i in ids])

    def batch_samples(self, batch_id: str, states: tuple[str, ...]) -> list[SampleRow]:
        marks = ",".join("?" * len(states))
        return [SampleRow.of(r) for r in self.conn.execute(
            f"SELECT id, model_id, min_version, state, blob FROM samples"
            f" WHERE batch_id=? AND state IN ({marks}) ORDER BY id", (batch_id, *states))]

    # ------------------------------------------------------------------ batches

    def insert_batch(self, batch_id: str, model_id: str, trainer_id: str | None, version: int,
                     n: int, now: float) -> None:
        self.conn.execute("INSERT INTO batches(batch_id, model_id, trainer_id, policy_version, n,"
                          " state, served_at) VALUES(?, ?, ?, ?, ?, 'served', ?)",
                          (batch_id, model_id, trainer_id, version, n, now))

    def batch(self, batch_id: str) -> BatchRow | None:
        row = self.conn.execute("SELECT * FROM batches WHERE batch_id=?", (batch_id,)).fetchone()
        return BatchRow.of(row) if row is not None else None

    def set_batch_state(self, batch_id: str, state: str, now: float | None = None) -> None:
        self.conn.execute("UPDATE batches SET state=?, acked_at=COALESCE(?, acked_at)"
                          " WHERE batch_id=?", (state, now, batch_id))

    def batches_served_before(self, cutoff: float) -> list[BatchRow]:
        """Outstanding batches neither served nor extended since ``cutoff`` (ack overdue)."""
        return [BatchRow.of(r) for r in self.conn.execute(
            "SELECT * FROM batches WHERE state='served' AND COALESCE(renewed_at, served_at)<?"
            " ORDER BY served_at", (cutoff,))]

    def set_acked_step(self, batch_id: str, step: int) -> None:
        """The trainer's optimizer step count after training this batch (inside the ack's tx)."""
        self.conn.execute("UPDATE batches SET acked_step=? WHERE batch_id=?", (step, batch_id))

    def roll_back_batches(self, model_id: str, after_step: int, now: float) -> list[BatchRow]:
        """Mark ``model_id``'s acked batches trained after optimizer step ``after_step`` (and not
        marked yet) as rolled back at ``now``; returns them (inside the caller's tx)."""
        rows = [BatchRow.of(r) for r in self.conn.execute(
            "SELECT * FROM batches WHERE model_id=? AND state='acked' AND acked_step>? AND"
            " rolled_back_at IS NULL ORDER BY acked_at", (model_id, after_step))]
        self.conn.executemany("UPDATE batches SET rolled_back_at=? WHERE batch_id=?",
                              [(now, r.batch_id) for r in rows])
        return rows

    def renew_batch(self, batch_id: str, now: float) -> None:
        """A keep-alive: the batch's ack timeout counts from ``now`` (inside the caller's tx)."""
        self.conn.execute("UPDATE batches SET renewed_at=MAX(COALESCE(renewed_at, 0), ?)"
                          " WHERE batch_id=?", (now, batch_id))

    def batch_member_count(self, batch_id: str) -> int:
        """Fresh samples still carrying ``batch_id`` in any state (a re-serve moves a sample to
        its new batch's id; a stale drop or an ack keeps it)."""
        return self.conn.execute("SELECT COUNT(*) FROM samples WHERE batch_id=?",
                                 (batch_id,)).fetchone()[0]

    def outstanding_batches(self) -> dict[str, int]:
        rows = self.conn.execute("SELECT model_id, COUNT(*) FROM batches WHERE state='served'"
                                 " GROUP BY model_id").fetchall()
        return {r[0]: r[1] for r in rows}

    # ------------------------------------------------------------------ versions

    def insert_version(self, model_id: str, version: int, manifest: bytes, now: float) -> None:
        self.conn.execute("INSERT INTO versions(model_id, version, manifest, published_at)"
                          " VALUES(?, ?, ?, ?)", (model_id, version, manifest, now))
        self.conn.execute("INSERT OR REPLACE INTO version_times(model_id, version, published_at)"
                          " VALUES(?, ?, ?)", (model_id, version, now))

    def version_times(self, model_id: str) -> dict[int, float]:
        """Publication time of every version of ``model_id`` ever published (kept after weight
        GC forgot the manifest: the balance report's wall time needs them)."""
        return {r[0]: r[1] for r in self.conn.execute(
            "SELECT version, published_at FROM version_times WHERE model_id=? ORDER BY version",
            (model_id,))}

    def first_activity(self) -> float | None:
        """When the oldest task was created (a start time for a state folder that predates the
        ``started_at`` meta key)."""
        return self.conn.execute("SELECT MIN(created) FROM tasks").fetchone()[0]

    def latest_versions(self) -> dict[str, int]:
        rows = self.conn.execute("SELECT model_id, MAX(version) FROM versions GROUP BY model_id")
        return {r[0]: r[1] for r in rows}

    def version_rows(self, model_id: str) -> list[VersionRow]:
        """Every stored version of ``model_id`` with its manifest, ascending."""
        return [VersionRow.of(r) for r in self.conn.execute(
            "SELECT version, published_at, manifest AS blob FROM versions WHERE model_id=?"
            " ORDER BY version", (model_id,))]

    def delete_versions(self, model_id: str, versions: list[int]) -> None:
        """Forget garbage-collected versions (their manifests)."""
        self.conn.executemany("DELETE FROM versions WHERE model_id=? AND version=?",
                              [(model_id, v) for v in versions])

    def manifest_blob(self, model_id: str, version: int | None = None) -> bytes | None:
        if version is None:
            row = self.conn.execute("SELECT manifest FROM versions WHERE model_id=?"
                                    " ORDER BY version DESC LIMIT 1", (model_id,)).fetchone()
        else:
            row = self.conn.execute("SELECT manifest FROM versions WHERE model_id=? AND version=?",
                                    (model_id, version)).fetchone()
        return bytes(row[0]) if row else None

    # ------------------------------------------------------------------ evals

    def eval_run_exists(self, model_id: str, version: int) -> bool:
        return self.conn.execute("SELECT 1 FROM eval_runs WHERE model_id=? AND version=?",
                                 (model_id, version)).fetchone() is not None

    def insert_eval_run(self, model_id: str, version: int, n_prompts: int, k: int,
                        now: float, n: int | None = None,
                        pass_k: list[int] | None = None) -> None:
        """One scheduled eval: ``k`` of avg@k / pass@k, ``n`` samples per prompt (None: k) and
        the k values pass@k is reported for (None: ``[k]``)."""
        self.conn.execute(
            "INSERT INTO eval_runs(model_id, version, n_prompts, k, scheduled_at, n, pass_k)"
            " VALUES(?, ?, ?, ?, ?, ?, ?)",
            (model_id, version, n_prompts, k, now, n,
             json.dumps([int(x) for x in pass_k]) if pass_k is not None else None))

    def insert_eval_report(self, model_id: str, version: int, prompt_index: int, task_id: str,
                           n_samples: int, n_correct: int, sum_reward: float,
                           min_version: int | None, max_version: int | None, now: float,
                           n_team_correct: int | None = None,
                           n_tool_calling: int | None = None) -> None:
        self.conn.execute(
            "INSERT OR IGNORE INTO eval_reports(model_id, version, prompt_index, task_id, n_samples,"
            " n_correct, sum_reward, min_version, max_version, reported_at, n_team_correct,"
            " n_tool_calling) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (model_id, version, prompt_index, task_id, n_samples, n_correct, sum_reward,
             min_version, max_version, now, n_team_correct, n_tool_calling))

    def eval_runs(self, model_id: str) -> list[EvalRunRow]:
        return [EvalRunRow.of(r) for r in self.conn.execute(
            "SELECT * FROM eval_runs WHERE model_id=? ORDER BY version", (model_id,))]

    def eval_reports(self, model_id: str, version: int) -> list[EvalReportRow]:
        return [EvalReportRow.of(r) for r in self.conn.execute(
            "SELECT * FROM eval_reports WHERE model_id=? AND version=?", (model_id, version))]
