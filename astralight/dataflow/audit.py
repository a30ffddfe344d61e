"""Audit a dataflow state folder: is every train task and every sample accounted for?

    python -m astralight.dataflow.audit RUN/dataflow/dataflow.db [--json]

Why: "nothing is lost silently" is a claim about the durable state, so it is checked on the
durable state. The audit opens the SQLite file **read-only** (``file:...?mode=ro``; never through
:class:`~astralight.dataflow.store.Store`, whose constructor writes) and may run while the service
is alive (WAL readers do not block it) or after a ``kill -9``.

The states it reads (``store.SCHEMA``, ``core.Dataflow``):

* ``tasks.state``: ``pending`` (never leased, or handed back), ``leased`` (deadline may have
  passed: re-issued at the next lease), ``done`` (its first push was accepted; later pushes are
  ignored as duplicates). Only ``kind='train'`` tasks are audited (eval samples are scored into
  ``eval_reports`` and never trained).
* ``samples.state``: a push stores every sample of a train task in the push's transaction as
  ``queued`` (accepted), ``filtered`` (a sample filter dropped its group) or ``stale`` (sync mode,
  an older round). A pull moves ``queued`` -> ``served`` (``batch_id`` set); a version publication
  or a pull moves ``queued`` -> ``stale`` (too old); an ack moves the batch's ``served``/``queued``
  rows -> ``acked``; an ack timeout moves ``served`` -> ``queued`` (``batch_id`` kept).
* ``batches.state``: ``served`` -> ``acked``, or ``served`` -> ``requeued`` (neither acked nor
  extended by a keep-alive within ``batch_ack_timeout_s``; a late ack of a requeued batch ->
  ``acked``). ``batches.n`` is the number of samples the trainer received: fresh ones (their
  ``batch_id``) plus replayed ones (table ``replays``).
* ``counters``: bumped in the same transactions, so they are a second ledger:
  ``rollouts_generated`` (every stored sample), ``samples_accepted``, ``samples_filtered``,
  ``stale_dropped``, ``samples_acked``, ``samples_trained`` (acked fresh + replayed),
  ``tasks_issued`` (first leases), ``samples_trained_twice`` (what late acks of re-served batches
  trained a second time, counted by the ack that made them duplicates).

Definitions (what :func:`audit` returns):

* Every train task lands in exactly one class, by the first rule that applies:
  ``pending`` -- ``unleased`` (state pending: never leased or handed back), ``leased``, or done
  with a sample still ``served`` (``in_batch``: in an unacked batch) or ``queued``; ``lost`` --
  done with no sample row at all; ``trained`` -- some sample acked; ``filtered`` -- every sample
  filtered; ``stale`` -- the rest (stale, maybe some filtered). ``tasks_issued`` = train tasks ever
  leased; the classes always sum to the train tasks, so "exactly once" holds by construction and
  the checks below are what can fail.
* ``samples_lost``: samples the state once held and no longer accounts for, per model_id the
  larger of (``rollouts_generated`` counter - stored rows) and (``n`` of every ``lost`` task), plus
  rows ``served`` whose batch is not outstanding (no ack and no re-queue will ever move them) and
  rows in a state the schema does not know.
* ``duplicates_trained``: fresh samples trained more than once, over all versions (stricter than
  "twice in one version"; replay is deliberate re-use and counted apart as ``replays_trained``):
  for each acked batch, ``n`` minus its rows still carrying its ``batch_id`` minus its replays. A
  sample leaves a batch's ``batch_id`` only by an ack timeout and a new serve; if that first batch
  was acked anyway (late), the trainer saw the sample in both. The same (task_id, model_id,
  sample_index) cannot be stored twice (UNIQUE), and a second push of a task is ignored. With the
  trainers' keep-alive this needs a trainer frozen (SIGSTOP, swapped out) longer than
  ``batch_ack_timeout_s``; the service counts each such duplicate when the late ack arrives
  (``samples_trained_twice``, reported as ``duplicates_counted``), and any duplicate it did not
  count is a mismatch.
* ``samples_accepted``: the ``samples_accepted`` counters; ``samples_trained``: acked rows
  (distinct fresh samples trained); ``samples_filtered`` / ``samples_stale`` / ``samples_pending``
  (queued or served): rows by state.
* ``mismatches``: every place where the row ledger and the counter ledger disagree.
* ``balanced``: no lost task, ``samples_lost == 0``, ``duplicates_trained == 0`` and no mismatch.

* ``batches_rolled_back`` / ``samples_rolled_back``: acked batches whose training a trainer's
  restart from an older checkpoint discarded (the resumed trainer reports its checkpoint's step;
  acks after it are marked, ``core.Dataflow.trainer_resumed``). They still count as trained (the
  versions published from them were served); these figures say how much training was redone,
  and the ``samples_rolled_back`` counter must match the marked batches.

* ``commits`` / ``commits_counted``: the committed transactions the database counts (meta
  ``commits``) and the durable ones the file ``state_dir/dataflow.commits`` counted outside SQLite
  (None: no file); ``commits_lost``: how many of those the database no longer holds (its WAL
  deleted or damaged: both ledgers above lose the same transactions, so only this shows it),
  plus those lost at an earlier start that ``allow_lost_commits`` accepted (meta
  ``commits_lost``). Any is a mismatch (:mod:`astralight.dataflow.commit_counter`). The file is
  read before the database's snapshot is taken, so a service writing meanwhile never makes the
  database look behind.

What the database cannot show: a batch trained but never acked (a trainer killed after its step)
is re-served after the ack timeout and trained again (the trainer's resume contract).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from astralight.dataflow import commit_counter

#: sample states the service writes (anything else is counted lost)
SAMPLE_STATES = ("queued", "served", "acked", "filtered", "stale")
TASK_CLASSES = ("trained", "filtered", "stale", "pending", "lost")
PENDING_CLASSES = ("unleased", "leased", "queued", "in_batch")


def _db_file(db_path: str | Path) -> Path:
    path = Path(db_path)
    return path / "dataflow.db" if path.is_dir() else path  # a state_dir was given


def _connect(db_path: str | Path) -> sqlite3.Connection:
    path = _db_file(db_path)
    if not path.is_file():
        raise FileNotFoundError(f"db_path: no dataflow database at {path} (give the state_dir "
                                "or its dataflow.db)")
    conn = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def _task_n(payload: bytes) -> int:
    """Samples per model_id the task asked for (``Task.n``); 1 if the payload is unreadable."""
    try:
        from astralight.protocol import decode

        return max(1, int(decode(bytes(payload)).n))
    except Exception:
        return 1


def audit(db_path: str | Path) -> dict[str, Any]:
    """Audit the dataflow database at ``db_path`` (a ``dataflow.db`` or its state_dir),
    read-only; see the module docstring for every definition."""
    conn = _connect(db_path)
    try:
        # the count outside SQLite first: it never runs ahead of what is durable, so a snapshot
        # taken after it holds at least that many commits (module docstring)
        counter = commit_counter.CommitCounter(commit_counter.counter_path(_db_file(db_path)))
        counted = counter.read()
        conn.execute("BEGIN")  # one snapshot for every query, even with the service writing
        report = _audit(conn)
        _check_commits(conn, counted, counter.path.name, report)
        return report
    finally:
        conn.close()


def _check_commits(conn: sqlite3.Connection, counted: int | None, file_name: str,
                   report: dict[str, Any]) -> None:
    """Add ``commits``, ``commits_counted`` and ``commits_lost`` to ``report``, and a mismatch
    (not balanced) for any commit lost (module docstring)."""
    have = commit_counter.db_count(conn)
    lost_before = commit_counter.db_count(conn, commit_counter.LOST_KEY)
    lost_now = max(0, counted - have) if counted is not None else 0
    report.update(commits=have, commits_counted=counted, commits_lost=lost_now + lost_before)
    if lost_now:
        report["mismatches"].append(
            f"state_dir: the database holds {have} committed transactions but {file_name} "
            f"counted {counted} durable ones: {lost_now} committed transactions are lost (a "
            "deleted or damaged WAL, or an older copy of dataflow.db)")
    if lost_before:
        report["mismatches"].append(
            f"state_dir: {lost_before} committed transactions were found lost at an earlier start "
            "and accepted (allow_lost_commits)")
    if lost_now or lost_before:
        report["balanced"] = False


def _audit(conn: sqlite3.Connection) -> dict[str, Any]:
    counters: dict[str, dict[str, int]] = defaultdict(dict)
    for r in conn.execute("SELECT model_id, name, value FROM counters"):
        counters[r["model_id"]][r["name"]] = int(r["value"])

    def ctr(model_id: str, name: str) -> int:
        return counters.get(model_id, {}).get(name, 0)

    # samples of train tasks, by task and by (model_id, state)
    by_task: dict[str, Counter] = defaultdict(Counter)
    rows_by_model: Counter = Counter()
    by_model_state: Counter = Counter()
    for r in conn.execute(
            "SELECT s.task_id, s.model_id, s.state, COUNT(*) AS k FROM samples s"
            " JOIN tasks t ON t.task_id = s.task_id WHERE t.kind='train'"
            " GROUP BY s.task_id, s.model_id, s.state"):
        by_task[r["task_id"]][r["state"]] += r["k"]
        rows_by_model[r["model_id"]] += r["k"]
        by_model_state[r["model_id"], r["state"]] += r["k"]
    orphan_rows = conn.execute(  # samples of no task at all (should never exist)
        "SELECT COUNT(*) FROM samples s LEFT JOIN tasks t ON t.task_id = s.task_id"
        " WHERE t.task_id IS NULL").fetchone()[0]

    # ---- tasks
    classes: Counter = Counter({c: 0 for c in TASK_CLASSES})
    pending: Counter = Counter({c: 0 for c in PENDING_CLASSES})
    lost_tasks: list[str] = []
    lost_expected: Counter = Counter()  # model_id -> samples the lost tasks should have held
    n_train = issued = 0
    for t in conn.execute("SELECT task_id, state, lease_count, model_ids, payload FROM tasks"
                          " WHERE kind='train' ORDER BY seq"):
        n_train += 1
        issued += t["lease_count"] > 0
        states = by_task.get(t["task_id"], Counter())
        if t["state"] != "done":
            cls, sub = "pending", ("leased" if t["state"] == "leased" else "unleased")
        elif not states:
            cls, sub = "lost", None
            lost_tasks.append(t["task_id"])
            for m in json.loads(t["model_ids"]):
                lost_expected[m] += _task_n(t["payload"])
        elif states["served"]:
            cls, sub = "pending", "in_batch"
        elif states["queued"]:
            cls, sub = "pending", "queued"
        elif states["acked"]:
            cls, sub = "trained", None
        elif states["filtered"] and sum(states.values()) == states["filtered"]:
            cls, sub = "filtered", None
        else:
            cls, sub = "stale", None
        classes[cls] += 1
        if sub:
            pending[sub] += 1

    # ---- batches: duplicates and orphaned served samples
    members = {r[0]: r[1] for r in conn.execute(
        "SELECT batch_id, COUNT(*) FROM samples WHERE batch_id IS NOT NULL GROUP BY batch_id")}
    replays = {r[0]: r[1] for r in conn.execute(
        "SELECT batch_id, COUNT(*) FROM replays GROUP BY batch_id")}
    batch_states: Counter = Counter()
    duplicates: Counter = Counter()
    for b in conn.execute("SELECT batch_id, model_id, n, state FROM batches"):
        batch_states[b["state"]] += 1
        if b["state"] == "acked":
            extra = b["n"] - members.get(b["batch_id"], 0) - replays.get(b["batch_id"], 0)
            duplicates[b["model_id"]] += max(0, extra)
    stranded = Counter({r[0]: r[1] for r in conn.execute(
        "SELECT s.model_id, COUNT(*) FROM samples s LEFT JOIN batches b ON b.batch_id = s.batch_id"
        " WHERE s.state='served' AND (b.batch_id IS NULL OR b.state != 'served')"
        " GROUP BY s.model_id")})
    marks = ",".join("?" * len(SAMPLE_STATES))
    unknown = Counter({r[0]: r[1] for r in conn.execute(
        f"SELECT model_id, COUNT(*) FROM samples WHERE state NOT IN ({marks}) GROUP BY model_id",
        SAMPLE_STATES)})
    acked_replays = Counter({r[0]: r[1] for r in conn.execute(
        "SELECT b.model_id, COUNT(*) FROM replays r JOIN batches b ON b.batch_id = r.batch_id"
        " WHERE r.state='acked' GROUP BY b.model_id")})

    # ---- the two ledgers, per model_id
    rolled_back = _rolled_back(conn)
    model_ids = sorted(set(counters) | set(rows_by_model) | set(duplicates) | set(lost_expected))
    mismatches: list[str] = []
    lost_by_model: dict[str, int] = {}
    for m in model_ids:
        rows = rows_by_model[m]
        st = {s: by_model_state[m, s] for s in SAMPLE_STATES}
        generated = ctr(m, "rollouts_generated")
        lost_by_model[m] = (max(generated - rows, lost_expected[m]) + stranded[m] + unknown[m])
        checks = (("rollouts_generated", generated, rows, "stored sample rows"),
                  ("samples_filtered", ctr(m, "samples_filtered"), st["filtered"], "filtered rows"),
                  ("stale_dropped", ctr(m, "stale_dropped"), st["stale"], "stale rows"),
                  ("samples_acked", ctr(m, "samples_acked"), st["acked"], "acked rows"),
                  ("samples_trained", ctr(m, "samples_trained"), st["acked"] + acked_replays[m],
                   "acked rows + acked replays"),
                  ("samples_trained_twice", ctr(m, "samples_trained_twice"), duplicates[m],
                   "duplicates found in acked batches"),
                  ("samples_rolled_back", ctr(m, "samples_rolled_back"), rolled_back[m][1],
                   "samples of batches marked rolled back"))
        for name, counted, found, what in checks:
            if counted != found:
                mismatches.append(f"{m}: counter {name}={counted} but {what}={found}")
        accepted, filtered = ctr(m, "samples_accepted"), ctr(m, "samples_filtered")
        if not accepted + filtered <= rows <= accepted + filtered + ctr(m, "stale_dropped"):
            mismatches.append(f"{m}: {rows} stored rows outside samples_accepted + samples_filtered"
                              f" (+ stale_dropped) = [{accepted + filtered}, "
                              f"{accepted + filtered + ctr(m, 'stale_dropped')}]")
        if m in rows_by_model or generated:  # a policy of the train tasks
            if ctr(m, "tasks_issued") != issued:
                mismatches.append(f"{m}: counter tasks_issued={ctr(m, 'tasks_issued')} but "
                                  f"{issued} train tasks were ever leased")
    if orphan_rows:
        mismatches.append(f"{orphan_rows} sample rows belong to no task")
    if sum(classes.values()) != n_train:  # cannot happen: a guard against edits of the rules
        mismatches.append(f"task classes sum to {sum(classes.values())}, not {n_train}")

    samples_lost = sum(lost_by_model.values())
    dup = sum(duplicates.values())
    total = Counter()
    for (m, s), k in by_model_state.items():
        total[s] += k
    return {
        "model_ids": model_ids,
        "tasks_total": n_train,
        "tasks_issued": issued,
        "tasks": dict(classes),
        "tasks_pending": dict(pending),
        "tasks_lost_ids": lost_tasks[:20],
        "samples_stored": sum(rows_by_model.values()),
        "samples_accepted": sum(ctr(m, "samples_accepted") for m in model_ids),
        "samples_trained": total["acked"],
        "samples_filtered": total["filtered"],
        "samples_stale": total["stale"],
        "samples_pending": total["queued"] + total["served"],
        "replays_trained": sum(acked_replays.values()),
        "samples_lost": samples_lost,
        "samples_lost_by_model": {m: k for m, k in lost_by_model.items() if k},
        "samples_stranded": sum(stranded.values()),
        "duplicates_trained": dup,
        "duplicates_counted": sum(ctr(m, "samples_trained_twice") for m in model_ids),
        "late_acks": sum(ctr(m, "late_acks") for m in model_ids),
        "late_acks_after_reserve": sum(ctr(m, "late_acks_after_reserve") for m in model_ids),
        "batches": dict(batch_states),
        "batches_rolled_back": sum(b for b, _ in rolled_back.values()),
        "samples_rolled_back": sum(n for _, n in rolled_back.values()),
        "mismatches": mismatches,
        "balanced": not lost_tasks and samples_lost == 0 and dup == 0 and not mismatches,
    }


def _rolled_back(conn: sqlite3.Connection) -> defaultdict[str, tuple[int, int]]:
    """Per model_id, (batches, samples) marked rolled back (a trainer resumed from a checkpoint
    older than their acks); nothing for a database written before the column existed."""
    out: defaultdict[str, tuple[int, int]] = defaultdict(lambda: (0, 0))
    if "rolled_back_at" not in {r["name"] for r in conn.execute("PRAGMA table_info(batches)")}:
        return out
    for r in conn.execute("SELECT model_id, COUNT(*) AS b, SUM(n) AS k FROM batches"
                          " WHERE rolled_back_at IS NOT NULL GROUP BY model_id"):
        out[r["model_id"]] = (int(r["b"]), int(r["k"] or 0))
    return out


def format_report(report: dict) -> str:
    """A few human lines for the CLI."""
    t, p = report["tasks"], report["tasks_pending"]
    lines = [
        f"balanced: {'yes' if report['balanced'] else 'NO'}",
        f"train tasks: {report['tasks_total']} ({report['tasks_issued']} issued): "
        f"trained {t['trained']}, filtered {t['filtered']}, stale {t['stale']}, pending "
        f"{t['pending']} (unleased {p['unleased']}, leased {p['leased']}, queued {p['queued']}, "
        f"in an unacked batch {p['in_batch']}), lost {t['lost']}",
        f"samples: stored {report['samples_stored']}, accepted {report['samples_accepted']}, "
        f"trained {report['samples_trained']} (+{report['replays_trained']} replayed), filtered "
        f"{report['samples_filtered']}, stale {report['samples_stale']}, pending "
        f"{report['samples_pending']}",
        f"samples lost: {report['samples_lost']}, duplicates trained: "
        f"{report['duplicates_trained']} ({report.get('duplicates_counted', 0)} counted by "
        f"{report.get('late_acks_after_reserve', 0)} late acks of re-served batches)",
        f"rolled back by trainer restarts: {report.get('batches_rolled_back', 0)} batches "
        f"({report.get('samples_rolled_back', 0)} samples) trained into weights a crash discarded",
    ]
    if report.get("commits_counted") is not None or report.get("commits_lost"):
        lines.append(f"commits: {report.get('commits')} in the database, "
                     f"{report.get('commits_counted')} counted outside it, "
                     f"{report.get('commits_lost', 0)} lost")
    lines += [f"mismatch: {m}" for m in report["mismatches"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m astralight.dataflow.audit DB [--json]``; exit 0 if balanced, 1 if not,
    2 if the database cannot be read."""
    p = argparse.ArgumentParser(prog="python -m astralight.dataflow.audit",
                                description="Account for every train task and sample of a "
                                            "dataflow state (read-only).")
    p.add_argument("db", help="the dataflow's dataflow.db, or its state_dir")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    args = p.parse_args(argv)
    try:
        report = audit(args.db)
    except (OSError, sqlite3.Error) as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["balanced"] else 1


if __name__ == "__main__":
    sys.exit(main())
