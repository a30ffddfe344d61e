"""A damaged state is detected at start (issue 41, item 10), on real SQLite files: the service
refuses to start with one error line naming ``state_dir`` and what to do, exit status 2, no
traceback, for

* (a) a WAL deleted or truncated while it held acknowledged pushes and acks -- SQLite opens the
  rest without a word; the commit count kept outside SQLite (``dataflow.commits``) is ahead of
  the database's own, and the audit reports the loss instead of ``balanced``;
* (b) 64 pages of the database overwritten -- ``PRAGMA quick_check`` at start;
* (c) a damaged database header -- "file is not a database", once a raw traceback.

``allow_lost_commits: true`` starts on (a) anyway and records the loss, which the audit keeps
reporting; the start-up check is bounded by ``integrity_check_s``.
"""

from __future__ import annotations

import logging
import random
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import yaml

from astralight.dataflow import service
from astralight.dataflow.audit import audit
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.protocol import Sample

FIXES = ("backup", "fresh state_dir")


def config(state: Path, **kw) -> DataflowConfig:
    return DataflowConfig(state_dir=str(state), group_size=2, lease_seconds=3600, **kw)


def group(task, tokens: int = 8) -> list[Sample]:
    """A valid group of two samples of ``tokens`` tokens (2 prompt, the rest at version 0)."""
    n = tokens
    return [Sample(task_id=task.task_id, sample_index=i, model_id="policy",
                   token_ids=np.arange(n, dtype=np.int32) % 500,
                   logprobs=np.concatenate([np.zeros(2), np.full(n - 2, -0.5)]).astype(np.float32),
                   loss_mask=np.concatenate([np.zeros(2), np.ones(n - 2)]).astype(np.uint8),
                   versions=np.concatenate([np.full(2, -1), np.zeros(n - 2)]).astype(np.int32),
                   reward=float(i), prompt_len=2) for i in range(2)]


def start(state: Path, tmp_path: Path, monkeypatch, caplog, capsys, **cfg) -> tuple[int, list]:
    """``astralight dataflow serve`` on ``state`` as a user starts it (the server loop itself
    replaced by a no-op: a start that gets that far returns 0). Returns the exit status and
    the error records logged."""
    path = tmp_path / f"dataflow-{state.name}.yaml"
    path.write_text(yaml.safe_dump({"state_dir": str(state), "port": 0, "group_size": 2, **cfg}))
    for name in ("ASTRALIGHT_TOKEN", "ASTRALIGHT_ROLLOUT_TOKEN", "ASTRALIGHT_TRAINER_TOKEN",
                 "ASTRALIGHT_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(service._Server, "run", lambda self, sockets=None: None)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rc = service.main(["--config", str(path)])
    assert "Traceback" not in capsys.readouterr().err
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    return rc, [r for r in caplog.records if r.levelno >= logging.ERROR]


def assert_refused(rc: int, errors: list, state: Path, *words: str) -> str:
    """Exit status 2 and exactly one error line naming ``state_dir`` and the way out."""
    assert rc == 2, (rc, [r.getMessage() for r in errors])
    assert len(errors) == 1, [r.getMessage() for r in errors]
    line = errors[0].getMessage()
    assert "\n" not in line and line.startswith("state_dir"), line
    assert str(state) in line, line
    for word in FIXES + words:
        assert word in line, (word, line)
    return line


# ---------------------------------------------------------------------- (a) a lost WAL


def acknowledged_work(state: Path) -> Dataflow:
    """A live state: 4 pushes checkpointed into dataflow.db, then 4 more pushes, a pull and its
    ack, all acknowledged (durable) and still only in the WAL. The service is left running."""
    flow = Dataflow(config(state))
    iid = flow.register(["policy"], 16, None, {})["instance_id"]
    tasks = flow.lease(iid, 8)
    for t in tasks[:4]:
        flow.push(iid, t.task_id, group(t))
    with flow.lock:
        flow.store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for t in tasks[4:]:
        flow.push(iid, t.task_id, group(t))
    batch = flow.pull("policy", 4)
    flow.ack(batch.batch_id)
    return flow


def copy_without_wal(src: Path, dst: Path, how: str) -> None:
    """The state as a copy (or a crash) that lost its WAL leaves it: dataflow.db and the commit
    count, and the -wal deleted or cut in half."""
    dst.mkdir()
    shutil.copy(src / "dataflow.db", dst / "dataflow.db")
    if (src / "dataflow.commits").exists():  # (none before the count outside SQLite existed)
        shutil.copy(src / "dataflow.commits", dst / "dataflow.commits")
    if how == "truncated":
        wal = (src / "dataflow.db-wal").read_bytes()
        (dst / "dataflow.db-wal").write_bytes(wal[:len(wal) // 2])


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_a_lost_wal_is_detected_by_the_audit_and_refused_at_start(tmp_path, monkeypatch, caplog,
                                                                  capsys, how):
    live = acknowledged_work(tmp_path / "live")
    copy = tmp_path / f"wal-{how}"
    copy_without_wal(tmp_path / "live", copy, how)
    live.close()
    report = audit(copy)
    assert not report["balanced"] and report["commits_lost"] > 0, report
    assert any("committed transactions are lost" in m for m in report["mismatches"]), report
    rc, errors = start(copy, tmp_path, monkeypatch, caplog, capsys)
    assert_refused(rc, errors, copy, "committed transactions are lost", "allow_lost_commits")
    assert audit(tmp_path / "live")["balanced"]  # the original, WAL and all, is whole


def test_allow_lost_commits_starts_and_the_audit_keeps_the_loss(tmp_path):
    live = acknowledged_work(tmp_path / "live")
    copy = tmp_path / "copy"
    copy_without_wal(tmp_path / "live", copy, "deleted")
    live.close()
    lost = audit(copy)["commits_lost"]
    assert lost > 0
    flow = Dataflow(config(copy, allow_lost_commits=True))
    flow.close()
    report = audit(copy)
    assert report["commits_lost"] == lost and not report["balanced"], report
    assert any("allow_lost_commits" in m for m in report["mismatches"]), report
    Dataflow(config(copy)).close()  # accepted once: later starts need no override


# ---------------------------------------------------------------------- (b) damaged pages


def closed_state(state: Path, tasks: int = 24, tokens: int = 1024) -> Path:
    """A state with some hundred pages (big samples), cleanly closed (checkpointed)."""
    flow = Dataflow(config(state))
    iid = flow.register(["policy"], tasks, None, {})["instance_id"]
    for t in flow.lease(iid, tasks):
        flow.push(iid, t.task_id, group(t, tokens))
    flow.close()
    return state / "dataflow.db"


def data_pages(db: Path) -> list[int]:
    """The pages of the state's tables and indexes, not of its schema (damage there stops
    SQLite before any check, which case (c) covers): what a flipped disk block most often hits
    in a database of samples. From ``dbstat`` where SQLite has it, else the file's second half
    (the samples pushed last)."""
    conn = sqlite3.connect(db)
    try:
        return sorted(r[0] for r in conn.execute(
            "SELECT pageno FROM dbstat WHERE name NOT IN ('sqlite_master', 'sqlite_schema')"))
    except sqlite3.OperationalError:  # no dbstat
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        return list(range(pages // 2 + 1, pages + 1))
    finally:
        conn.close()


def flip_pages(db: Path, n: int, seed: int = 0) -> None:
    """Invert every byte of ``n`` of its data pages (:func:`data_pages`)."""
    candidates = data_pages(db)
    assert len(candidates) > n, f"only {len(candidates)} data pages"
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    for p in random.Random(seed).sample(candidates, n):
        start = (p - 1) * page
        data[start:start + page] = bytes(b ^ 0xFF for b in data[start:start + page])
    db.write_bytes(bytes(data))


def test_damaged_pages_are_found_at_start_and_refused(tmp_path, monkeypatch, caplog, capsys):
    db = closed_state(tmp_path / "state")
    flip_pages(db, 64)
    rc, errors = start(tmp_path / "state", tmp_path, monkeypatch, caplog, capsys)
    assert_refused(rc, errors, tmp_path / "state", "quick_check", "damage")


# ---------------------------------------------------------------------- (c) the header


def test_a_bad_database_header_is_one_line_not_a_traceback(tmp_path, monkeypatch, caplog,
                                                           capsys):
    db = closed_state(tmp_path / "state", tasks=2, tokens=8)
    with open(db, "r+b") as f:
        f.write(b"not a database!\0")  # the 16-byte magic "SQLite format 3\0"
    rc, errors = start(tmp_path / "state", tmp_path, monkeypatch, caplog, capsys)
    assert_refused(rc, errors, tmp_path / "state", "not a database")


# ---------------------------------------------------------------------- the bound


def test_the_start_up_check_is_reported_and_bounded(tmp_path, caplog):
    from astralight.dataflow.integrity import quick_check

    db = closed_state(tmp_path / "state")
    with caplog.at_level(logging.INFO, logger="astralight.dataflow"):
        Dataflow(config(tmp_path / "state")).close()
    line = [r.getMessage() for r in caplog.records if "quick_check" in r.getMessage()]
    assert len(line) == 1 and "ok in" in line[0] and "MiB" in line[0], line
    ticks = iter(range(0, 10 ** 9, 100))  # a clock 100 s further on at every look
    conn = sqlite3.connect(db)
    try:
        result = quick_check(conn, limit_s=50.0, clock=lambda: next(ticks))
        whole = quick_check(conn, limit_s=3600.0)
    finally:
        conn.close()
    assert not result.complete and result.problems == [], result  # stopped, nothing found
    assert whole.complete and whole.problems == [], whole


def test_a_counter_behind_or_torn_never_refuses_a_whole_state(tmp_path, caplog):
    """The database ahead of the file (a crash between a commit and its fsync) is normal, and a
    record torn by a crash or a concurrent read is unknown, not a count: neither refuses."""
    from astralight.dataflow.commit_counter import parse, record

    acknowledged_work(tmp_path / "state").close()
    counted = audit(tmp_path / "state")["commits"]
    path = tmp_path / "state" / "dataflow.commits"
    assert parse(path.read_bytes()) == counted > 0  # every acknowledged commit, none more
    path.write_bytes(record(counted - 3))
    Dataflow(config(tmp_path / "state")).close()
    torn = record(counted + 100)[:30] + record(counted)[30:]  # the new copy, half the old
    assert parse(torn) is None
    path.write_bytes(torn)
    with caplog.at_level(logging.WARNING, logger="astralight.dataflow"):
        Dataflow(config(tmp_path / "state")).close()
    assert any("does not hold a commit count" in r.getMessage() for r in caplog.records)
    assert parse(path.read_bytes()) == audit(tmp_path / "state")["commits"]  # written again
