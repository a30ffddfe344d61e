"""Benchmark: what the commit counter outside SQLite costs (``dataflow.commit_counter``).

    python tests/benchmarks/bench_commit_counter.py [--dir STATE_DIR_PARENT] [--n 2000]

Prints one JSON line, microseconds per operation, measured in a temporary folder under ``--dir``
(default: the system's temp folder; pass a folder on the state_dir's volume for its figures):

* ``file_write_us``: one :meth:`CommitCounter.write` (a ``pwrite`` in place), what each group
  of durable commits pays (after its fsync);
* ``rename_write_us``: the same count written to a temporary file and renamed over the old one
  (``os.replace``), the alternative it replaced: on ext4 the rename starts writeback;
* ``file_write_fsync_us``: the in-place write with an fsync of the file, what it would cost if
  the file were fsynced too (it is not: see the module);
* ``db_count_us``: the extra statement per counted transaction (the ``meta`` upsert, and the
  page it dirties), measured as a store transaction with one small insert, with and without it
  (``tx_us``, ``tx_plain_us``; noisy on a loaded machine), and ``db_stmt_us``: the statement
  alone, inside one open transaction;
* ``wal_fsync_us``: one fsync of a WAL-sized file, the cost the counter write rides along with.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from astralight.dataflow.commit_counter import CommitCounter, record, set_db_count  # noqa: E402


def per_op_us(fn, n: int) -> float:
    """Median over 5 rounds of the mean time of ``n`` calls, in microseconds."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return round(statistics.median(rounds), 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="parent folder of the temporary state folder")
    p.add_argument("--n", type=int, default=2000, help="operations per round")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        counter = CommitCounter(folder / "dataflow.commits")
        seq = iter(range(1, 10 ** 9))  # a new count every call (an equal one is skipped)
        file_write = per_op_us(lambda i: counter.write(next(seq)), args.n)

        def write_rename(i: int) -> None:
            fd = os.open(folder / ".x.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, record(i))
            os.close(fd)
            os.replace(folder / ".x.tmp", folder / "x")

        rename_write = per_op_us(write_rename, max(20, args.n // 10))
        fd = os.open(folder / "y", os.O_RDWR | os.O_CREAT, 0o644)

        def write_fsync(i: int) -> None:
            os.pwrite(fd, record(i), 0)
            os.fsync(fd)

        file_fsync = per_op_us(write_fsync, max(20, args.n // 20))
        os.close(fd)
        counter.close()
        conn = sqlite3.connect(str(folder / "bench.db"), isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=OFF")  # the statement's own cost, not the disk's
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")

        def tx(counted: bool):
            def run(i: int) -> None:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT INTO t(v) VALUES(?)", (b"x" * 200,))
                if counted:
                    set_db_count(conn, i)
                conn.execute("COMMIT")
            return run

        tx_plain = per_op_us(tx(False), args.n)
        tx_counted = per_op_us(tx(True), args.n)
        conn.execute("BEGIN IMMEDIATE")
        db_stmt = per_op_us(lambda i: set_db_count(conn, i), args.n)  # the statement alone
        conn.execute("COMMIT")
        conn.close()
        wal = folder / "wal"
        wal.write_bytes(b"\0" * (4 << 20))

        def wal_fsync(i: int) -> None:
            fd = os.open(wal, os.O_WRONLY)
            os.pwrite(fd, b"y" * 4096, (i % 1000) * 4096)
            os.fsync(fd)
            os.close(fd)

        wal_sync = per_op_us(wal_fsync, max(20, args.n // 20))
    print(json.dumps({"file_write_us": file_write, "rename_write_us": rename_write,
                      "file_write_fsync_us": file_fsync,
                      "tx_plain_us": tx_plain, "tx_us": tx_counted,
                      "db_count_us": round(tx_counted - tx_plain, 2), "db_stmt_us": db_stmt,
                      "wal_fsync_us": wal_sync,
                      "folder": str(Path(args.dir or tempfile.gettempdir()).resolve())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
