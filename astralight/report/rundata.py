"""Read a run folder into plain Python data, without changing it.

A run folder is what ``astralight run RECIPE --run-dir D`` writes: ``summary.json`` (the
launcher's last word, absent when the run did not finish), ``balance.txt`` (a readable line then
the JSON of each balance report), ``dataflow/dataflow.db`` (the dataflow service's SQLite state),
``tensorboard/<name>/version_*/events.*`` (one TensorBoard logger per trainer), ``logs/`` and
``configs/``, and with an autoscaler ``autoscale.jsonl`` (its decisions).

Every source is optional except that the folder must hold ``summary.json`` or the dataflow DB:
what a source lacks is recorded in :attr:`RunData.notes` and the plots that need it are skipped
with that reason, so a report of a crashed or half-finished run still shows what there is.

The DB is opened read-only and never through :class:`~astralight.dataflow.store.Store`'s own
constructor, which switches the journal to WAL and migrates the schema (both write). With no
``-wal`` file beside it the DB is opened ``immutable`` (SQLite then creates no ``-shm``/``-wal``
files in the run folder); with one (a run still going, or killed) it is opened ``mode=ro`` so
the write-ahead log's last transactions are seen.
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from astralight.dataflow import evals as evals_mod
from astralight.dataflow.store import Store

#: what marks a folder as a run folder (at least one must be there)
RUN_MARKERS = ("summary.json", "dataflow/dataflow.db")


class RunFolderError(ValueError):
    """The folder is not a run folder (or cannot be read); the message names what is missing."""


@dataclass
class RunData:
    """Everything the report draws from, keyed by policy (``model_id``) where it is per policy.

    ``evals``: ``{model_id: {version: row}}``, complete eval runs only, each row as
    :func:`astralight.dataflow.evals.aggregate` returns it (``avg_at_k``, ``pass_at_k``, ``k``,
    optionally ``team_accuracy``, ``benchmarks``, ``benchmark_average``).
    ``per_version``: ``{model_id: {version: {counter: int}}}`` (the dataflow's version counters).
    ``scalars``: ``{logger name: {tag: [(step, value), ...]}}`` from TensorBoard, sorted by step.
    ``instances``: rows of the dataflow's instance table (dicts).
    ``pool_decisions``: the autoscaler's decisions log entries.
    ``notes``: what could not be read, and why (shown in summary.txt).
    """

    run_dir: Path
    summary: dict | None = None
    balance: list[dict] = field(default_factory=list)
    model_ids: list[str] = field(default_factory=list)
    evals: dict[str, dict[int, dict]] = field(default_factory=dict)
    per_version: dict[str, dict[int, dict[str, int]]] = field(default_factory=dict)
    version_times: dict[str, dict[int, float]] = field(default_factory=dict)
    started_at: float | None = None
    scalars: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)
    instances: list[dict] = field(default_factory=list)
    pool_decisions: list[dict] = field(default_factory=list)
    pool_log: Path | None = None
    has_db: bool = False
    notes: list[str] = field(default_factory=list)


class ReadOnlyStore(Store):
    """:class:`Store`'s queries over a read-only connection (its constructor would write)."""

    def __init__(self, path: Path):  # noqa: D107 - deliberately not calling Store.__init__
        self.path = Path(path)
        wal = self.path.with_name(self.path.name + "-wal")
        mode = "mode=ro" if wal.exists() else "immutable=1"
        self.conn = sqlite3.connect(f"file:{self.path}?{mode}", uri=True, check_same_thread=False)
        self.conn.row_factory = sqlite3.Row

    def model_ids(self) -> list[str]:
        """Every policy the DB knows of (published a version, was evaluated, or counted)."""
        found: set[str] = set()
        for table in ("version_times", "eval_runs", "version_counters", "counters"):
            try:
                rows = self.conn.execute(f"SELECT DISTINCT model_id FROM {table}")
                found.update(r[0] for r in rows)
            except sqlite3.Error:
                continue
        return sorted(found)


def check_run_dir(run_dir: Path) -> None:
    """Raise :class:`RunFolderError` unless ``run_dir`` looks like a run folder."""
    if not run_dir.exists():
        raise RunFolderError(f"RUN_DIR: {run_dir} does not exist")
    if not run_dir.is_dir():
        raise RunFolderError(f"RUN_DIR: {run_dir} is not a folder")
    if not any((run_dir / m).is_file() for m in RUN_MARKERS):
        raise RunFolderError(
            f"RUN_DIR: {run_dir} is not an astralight run folder: it holds neither "
            f"{' nor '.join(RUN_MARKERS)} (a run folder is what "
            f"`astralight run RECIPE --run-dir D` writes)")


def _read_summary(data: RunData) -> None:
    path = data.run_dir / "summary.json"
    if not path.is_file():
        data.notes.append("summary.json is missing (the run did not finish?): totals come from "
                          "the dataflow DB")
        return
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        data.notes.append(f"summary.json is unreadable ({exc})")
        return
    if not isinstance(summary, dict):
        data.notes.append("summary.json does not hold a JSON object; ignored")
        return
    data.summary = summary


def read_balance(path: Path) -> list[dict]:
    """The JSON reports of ``balance.txt`` (its readable lines are skipped)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def _read_balance(data: RunData) -> None:
    path = data.run_dir / "balance.txt"
    if not path.is_file():
        data.notes.append("balance.txt is missing (no balance report was written)")
        return
    try:
        data.balance = read_balance(path)
    except OSError as exc:
        data.notes.append(f"balance.txt is unreadable ({exc})")


def _db_path(run_dir: Path) -> Path:
    """``dataflow/dataflow.db``, or under the dataflow config's ``state_dir`` if that moved it."""
    default = run_dir / "dataflow" / "dataflow.db"
    if default.is_file():
        return default
    try:
        cfg = yaml.safe_load((run_dir / "configs" / "dataflow.yaml").read_text()) or {}
        state_dir = cfg.get("state_dir")
    except (OSError, yaml.YAMLError, AttributeError):
        state_dir = None
    return Path(state_dir) / "dataflow.db" if state_dir else default


def eval_benchmark_map(run_dir: Path) -> tuple[dict[int, str] | None, str | None]:
    """``({prompt_index: benchmark}, None)`` of the run's eval source, or ``(None, why not)``.

    The DB keeps eval results per prompt index only; which benchmark a prompt belongs to is the
    eval source's to say, so the source is rebuilt from ``configs/dataflow.yaml`` (as the dataflow
    service built it).
    """
    path = run_dir / "configs" / "dataflow.yaml"
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        return None, f"configs/dataflow.yaml unreadable ({exc})"
    spec = (cfg.get("eval") or {}).get("source") if isinstance(cfg, dict) else None
    if not spec:
        return None, "the dataflow config has no eval source"
    try:
        from astralight.dataflow.config import instantiate_plugin
        from astralight.tasks.base import PromptSource

        source = instantiate_plugin(spec, PromptSource, "eval.source")
        return evals_mod.benchmark_map(source), None
    except Exception as exc:  # a moved dataset file must not stop the report
        return None, f"could not rebuild the eval source to name benchmarks ({exc})"


def _read_db(data: RunData) -> None:
    path = _db_path(data.run_dir)
    if not path.is_file():
        data.notes.append(f"the dataflow DB {path} is missing: eval, wait fraction and pool come "
                          f"from summary.json alone")
        return
    try:
        store = ReadOnlyStore(path)
        store.conn.execute("SELECT 1 FROM sqlite_master").fetchone()
    except sqlite3.Error as exc:
        data.notes.append(f"the dataflow DB {path} cannot be opened ({exc})")
        return
    data.has_db = True
    try:
        data.model_ids = store.model_ids()
        _read_db_evals(data, store)
        for m in data.model_ids:
            try:
                counters = store.version_counters(m)
            except sqlite3.Error as exc:
                data.notes.append(f"dataflow DB: no per-version counters ({exc})")
                break
            if counters:
                data.per_version[m] = counters
        for m in data.model_ids:
            try:
                times = store.version_times(m)
            except sqlite3.Error:
                break
            if times:
                data.version_times[m] = times
        try:
            started = store.get_meta("started_at")
            data.started_at = float(started) if started is not None else store.first_activity()
        except (sqlite3.Error, TypeError, ValueError):
            pass
        try:
            data.instances = [dict(r) for r in store.instances()]
        except sqlite3.Error as exc:
            data.notes.append(f"dataflow DB: no instance table ({exc})")
    finally:
        store.close()


def _read_db_evals(data: RunData, store: ReadOnlyStore) -> None:
    try:
        has_runs = store.conn.execute("SELECT COUNT(*) FROM eval_runs").fetchone()[0] > 0
    except sqlite3.Error as exc:
        data.notes.append(f"dataflow DB: no eval tables ({exc})")
        return
    if not has_runs:
        return
    benchmarks, why = eval_benchmark_map(data.run_dir)
    if why:
        data.notes.append(f"per-benchmark eval lines: {why}")
    for m in data.model_ids:
        table = evals_mod.aggregate(store, m, benchmarks)
        complete = {v: row for v, row in table.items() if row.get("complete")}
        if complete:
            data.evals[m] = complete


def _evals_from_summary(data: RunData) -> None:
    """The summary's eval table (primary policy only) when the DB gave none."""
    summary = data.summary or {}
    table = summary.get("eval") or {}
    if data.evals or not table:
        return
    model_id = (summary.get("balance") or {}).get("model_id") or _primary_from_policies(summary)
    rows = {}
    for v, row in table.items():
        try:
            rows[int(v)] = dict(row)
        except (TypeError, ValueError):
            continue
    if rows:
        data.evals[model_id or "policy"] = rows


def _primary_from_policies(summary: dict) -> str | None:
    policies = summary.get("policies")
    return next(iter(policies)) if isinstance(policies, dict) and policies else None


def _per_version_from_summary(data: RunData) -> None:
    summary = data.summary or {}
    table = summary.get("per_version")
    if data.per_version or not isinstance(table, dict):
        return
    model_id = (summary.get("balance") or {}).get("model_id") or _primary_from_policies(summary)
    rows = {}
    for v, counters in table.items():
        try:
            rows[int(v)] = {str(k): int(x) for k, x in counters.items()}
        except (TypeError, ValueError, AttributeError):
            continue
    if rows:
        data.per_version[model_id or "policy"] = rows


def _read_tensorboard(data: RunData) -> None:
    root = data.run_dir / "tensorboard"
    if not root.is_dir():
        data.notes.append("tensorboard/ is missing (no trainer logged scalars)")
        return
    names = sorted(p for p in root.iterdir() if p.is_dir())
    if not names:
        data.notes.append("tensorboard/ holds no logger folder")
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name_dir in names:
        merged: dict[str, dict[int, tuple[float, float]]] = {}
        # version_* folders: a resumed trainer writes a new one; the later event of a step wins
        for version_dir in sorted(_event_dirs(name_dir), key=_version_key):
            try:
                acc = EventAccumulator(str(version_dir), size_guidance={"scalars": 0})
                acc.Reload()
                for tag in acc.Tags().get("scalars", []):
                    steps = merged.setdefault(tag, {})
                    for ev in acc.Scalars(tag):
                        old = steps.get(ev.step)
                        if old is None or ev.wall_time >= old[0]:
                            steps[ev.step] = (ev.wall_time, float(ev.value))
            except Exception as exc:  # a truncated event file must not stop the report
                data.notes.append(f"tensorboard/{name_dir.name}: {version_dir.name} "
                                  f"unreadable ({exc})")
        if merged:
            data.scalars[name_dir.name] = {
                tag: [(s, v) for s, (_, v) in sorted(steps.items())]
                for tag, steps in merged.items()}
    if not data.scalars:
        data.notes.append("tensorboard/ holds no scalar events")


def _event_dirs(name_dir: Path) -> list[Path]:
    dirs = {p.parent for p in name_dir.rglob("events.out.tfevents.*")}
    return list(dirs)


def _version_key(path: Path) -> tuple[int, str]:
    m = re.search(r"version_(\d+)$", path.name)
    return (int(m.group(1)) if m else -1, str(path))


def pool_log_path(run_dir: Path) -> Path | None:
    """The autoscaler's decisions log, where the launcher (``autoscale.jsonl``) or a hand-started
    autoscaler (``logs/autoscale-decisions.jsonl``) put it; None when there is none."""
    candidates = [run_dir / "autoscale.jsonl", *sorted(run_dir.glob("autoscale*.jsonl")),
                  *sorted((run_dir / "logs").glob("autoscale*.jsonl"))]
    return next((p for p in candidates if p.is_file()), None)


def _read_pool(data: RunData) -> None:
    path = pool_log_path(data.run_dir)
    if path is None:
        return
    data.pool_log = path
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("time") is not None:
            data.pool_decisions.append(entry)


def load_run(run_dir: str | Path) -> RunData:
    """Read every source of a run folder; raises :class:`RunFolderError` for a non-run folder."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    data = RunData(run_dir=run_dir)
    _read_summary(data)
    _read_balance(data)
    _read_db(data)
    _evals_from_summary(data)
    _per_version_from_summary(data)
    _read_tensorboard(data)
    _read_pool(data)
    if not data.model_ids:
        data.model_ids = sorted(set(data.evals) | set(data.per_version))
    return data


def recipe_name(data: RunData) -> str:
    """The recipe's name: the summary's ``name`` / ``recipe`` when it has one, else read from the
    launcher's default folder name ``<name>-YYYYMMDD-HHMMSS``, else the folder's name."""
    summary: dict[str, Any] = data.summary or {}
    for key in ("recipe", "name"):
        if isinstance(summary.get(key), str) and summary[key]:
            return summary[key]
    folder = data.run_dir.resolve().name
    m = re.fullmatch(r"(.+)-\d{8}-\d{6}", folder)
    if m:
        return m.group(1)
    return f"{folder} (the run folder's name; summary.json names no recipe)"
