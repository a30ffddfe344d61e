"""Read a run folder into plain Python data, without changing it.

A run folder is what ``astralight run RECIPE --run-dir D`` writes: ``summary.json`` (the
launcher's last word, absent when the run did not finish), ``balance.jsonl`` (each balance
report; an older run's ``balance.txt`` mixed a readable line then the JSON of each),
``dataflow/dataflow.db`` (the dataflow service's SQLite state),
``tensorboard/<name>/version_*/events.*`` (one TensorBoard logger per trainer), ``logs/`` and
``configs/``, and with an autoscaler ``autoscale.jsonl`` (its decisions).

Trainer metrics are read from every folder of TensorBoard event files under the run folder:
``tensorboard/<name>/`` (the launcher's loggers, named ``<name>``), ``lightning_logs/`` (Lightning's
default logger when a trainer config sets ``default_root_dir`` inside the run folder) and any other
folder of ``events.out.tfevents.*``, plus the folders given with ``--tensorboard DIR`` (a cluster
run's trainers log under their own ``default_root_dir``). ``--db PATH`` names the dataflow DB when
it is not at ``dataflow/dataflow.db`` (Kubernetes: the ``/state`` volume). :attr:`RunData.sources`
says what was read from where, and what was looked for and not found.

Every source is optional except that the folder must hold ``summary.json``, the dataflow DB or
TensorBoard event files (or ``--db`` / ``--tensorboard`` name them): what a source lacks is
recorded in :attr:`RunData.notes` and the plots that need it are skipped with that reason, so a
report of a crashed or half-finished run still shows what there is.

The DB is opened read-only and never through :class:`~astralight.dataflow.store.Store`'s own
constructor, which switches the journal to WAL and migrates the schema (both write). With no
``-wal`` file beside it the DB is opened ``immutable`` (SQLite then creates no ``-shm``/``-wal``
files in the run folder); with one (a run still going, or killed) it is opened ``mode=ro`` so
the write-ahead log's last transactions are seen.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from astralight.dataflow import evals as evals_mod
from astralight.dataflow.store import Store

#: what marks a folder as a run folder (at least one must be there, or TensorBoard event files)
RUN_MARKERS = ("summary.json", "dataflow/dataflow.db")
#: TensorBoard event files (SummaryWriter / Lightning's TensorBoardLogger)
EVENTS_GLOB = "events.out.tfevents.*"
#: how deep under a folder event files are looked for (RUN_DIR/a/b/lightning_logs/version_0: 4)
MAX_EVENTS_DEPTH = 6


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
    ``eval_versions``: ``{model_id: [version, ...]}``, every version an eval was scheduled for
    (complete or not: the wait-fraction plot marks them).
    ``eval_later``: ``{model_id: {version: prompts}}``, per eval version the number of eval
    prompts some of whose tokens came from a version *after* the label (the RaaS picked up newer
    weights while the eval ran); absent where the DB has no per-prompt reports.
    ``staleness``: ``{model_id: {(reference version, staleness): samples}}`` over every trained
    sample (the dataflow DB: acknowledged batches, fresh and replayed samples), staleness being
    the reference version minus the oldest version behind the sample's loss-masked tokens;
    ``staleness_reference[model_id]`` says which reference: ``"trainer"`` (the trainer's own
    version at the pull, ``(acked_step - 1) // every_n_steps`` of its WeightPublisher, as
    ``train/staleness_*`` measures) or ``"dataflow"`` (the dataflow's version when it served the
    batch, when the trainer config or the acked steps are missing: up to one version lower).
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
    #: ``{what: where it came from, or why it is missing}``: ``dataflow DB``, ``TensorBoard``
    sources: dict[str, str] = field(default_factory=dict)
    db_path: Path | None = None
    #: the TensorBoard loggers read: ``(name in scalars, folder, [event folders])``
    tensorboard: list[tuple[str, Path, list[Path]]] = field(default_factory=list)
    eval_versions: dict[str, list[int]] = field(default_factory=dict)
    eval_later: dict[str, dict[int, int]] = field(default_factory=dict)
    staleness: dict[str, dict[tuple[int, int], int]] = field(default_factory=dict)
    staleness_reference: dict[str, str] = field(default_factory=dict)


class ReadOnlyStore(Store):
    """:class:`Store`'s queries over a read-only connection (its constructor would write)."""

    def __init__(self, path: Path):  # noqa: D107 - deliberately not calling Store.__init__
        self.path = Path(path)
        wal = self.path.with_name(self.path.name + "-wal")
        mode = "mode=ro" if wal.exists() else "immutable=1"
        self.conn = sqlite3.connect(f"file:{self.path}?{mode}", uri=True, check_same_thread=False)
        self.conn.row_factory = sqlite3.Row

    def close(self) -> None:
        """Close the read-only connection (nothing was written: nothing to make durable)."""
        self.conn.close()

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


def check_run_dir(run_dir: Path, db: Path | None = None,
                  tensorboard: tuple[Path, ...] | list[Path] = ()) -> None:
    """Raise :class:`RunFolderError` unless ``run_dir`` looks like a run folder, or an explicit
    ``--db`` / ``--tensorboard`` exists (a missing one is an error naming the option)."""
    if not run_dir.exists():
        raise RunFolderError(f"RUN_DIR: {run_dir} does not exist")
    if not run_dir.is_dir():
        raise RunFolderError(f"RUN_DIR: {run_dir} is not a folder")
    if db is not None and not Path(db).is_file():
        raise RunFolderError(f"--db: {db} is not a file (the dataflow's "
                             f"<state_dir>/dataflow.db)")
    for tb in tensorboard:
        if not Path(tb).is_dir():
            raise RunFolderError(f"--tensorboard: {tb} is not a folder (a folder holding "
                                 f"TensorBoard {EVENTS_GLOB} files, e.g. a trainer's "
                                 f"default_root_dir or its lightning_logs/)")
    if db is not None or tensorboard:
        return
    if any((run_dir / m).is_file() for m in RUN_MARKERS) or event_dirs(run_dir, limit=1):
        return
    raise RunFolderError(
        f"RUN_DIR: {run_dir} is not an astralight run folder: it holds neither "
        f"{' nor '.join(RUN_MARKERS)} nor TensorBoard event files (a run folder is what "
        f"`astralight run RECIPE --run-dir D` writes; elsewhere name the sources with "
        f"--db PATH / --tensorboard DIR)")


def event_dirs(root: Path, limit: int | None = None,
               max_depth: int = MAX_EVENTS_DEPTH) -> list[Path]:
    """Folders under ``root`` (itself included, at most ``max_depth`` levels down) holding
    TensorBoard event files, sorted; hidden folders are skipped. ``limit``: stop after that
    many (a cheap "is there any")."""
    found: list[Path] = []
    root = Path(root)
    base = len(root.parts)
    for here, dirs, files in os.walk(root):
        path = Path(here)
        if len(path.parts) - base >= max_depth:
            dirs[:] = []
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if any(f.startswith("events.out.tfevents.") for f in files):
            found.append(path)
            if limit is not None and len(found) >= limit:
                break
    return sorted(found)


def _read_summary(data: RunData) -> None:
    path = data.run_dir / "summary.json"
    if not path.is_file():
        data.notes.append("summary.json is missing (the run did not finish?): totals come from "
                          "the dataflow DB")
        data.sources["summary.json"] = "missing"
        return
    data.sources["summary.json"] = "summary.json"
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
    """The JSON reports of ``balance.jsonl``, or of an older run's ``balance.txt`` (which mixed
    readable lines, skipped here, with the JSON)."""
    from astralight.launch.balance import read_jsonl

    return read_jsonl(path)  # an old balance.txt's readable lines do not parse: skipped


def _read_balance(data: RunData) -> None:
    path = data.run_dir / "balance.jsonl"
    if not path.is_file():  # a run folder written before balance.jsonl existed
        path = data.run_dir / "balance.txt"
    if not path.is_file():
        data.notes.append("balance.jsonl is missing (no balance report was written)")
        return
    try:
        data.balance = read_balance(path)
    except OSError as exc:
        data.notes.append(f"{path.name} is unreadable ({exc})")


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


def shown(data: RunData, path: Path) -> str:
    """``path`` relative to the run folder when inside it, else as given."""
    try:
        return Path(path).resolve().relative_to(data.run_dir.resolve()).as_posix() or "."
    except ValueError:
        return str(path)


def _read_db(data: RunData, db: Path | None = None) -> None:
    path = Path(db) if db is not None else _db_path(data.run_dir)
    origin = "--db" if db is not None else "RUN_DIR"
    if not path.is_file():
        data.notes.append(f"the dataflow DB {path} is missing: eval, wait fraction and pool come "
                          f"from summary.json alone")
        data.sources["dataflow DB"] = (f"missing (looked for {shown(data, path)}; pass --db PATH "
                                       f"when the dataflow's state_dir is elsewhere)")
        return
    try:
        store = ReadOnlyStore(path)
        store.conn.execute("SELECT 1 FROM sqlite_master").fetchone()
    except sqlite3.Error as exc:
        data.notes.append(f"the dataflow DB {path} cannot be opened ({exc})")
        data.sources["dataflow DB"] = f"unreadable: {shown(data, path)} ({exc})"
        return
    data.has_db = True
    data.db_path = path
    data.sources["dataflow DB"] = f"{shown(data, path)}" + (" (--db)" if origin == "--db" else "")
    try:
        data.model_ids = store.model_ids()
        _read_db_evals(data, store)
        _read_db_staleness(data, store)
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
        if table:
            data.eval_versions[m] = sorted(table)
        complete = {v: row for v, row in table.items() if row.get("complete")}
        if complete:
            data.evals[m] = complete
        later = {}
        for v in complete:
            reports = store.eval_reports(m, v)
            later[v] = sum(1 for r in reports
                           if r["max_version"] is not None and r["max_version"] > v)
        if later:
            data.eval_later[m] = later


#: trained samples per (reference version, min_version) of one policy: fresh samples carry their
#: batch's id; replayed ones are in ``replays`` (one row per batch that carried them)
_TRAINED_SAMPLES = """
    SELECT b.policy_version AS served, b.acked_step AS step, s.min_version AS v, COUNT(*) AS n
      FROM samples s JOIN batches b ON b.batch_id = s.batch_id
     WHERE s.model_id = ? AND s.state = 'acked' AND b.state = 'acked'
     GROUP BY served, step, v
    UNION ALL
    SELECT b.policy_version, b.acked_step, s.min_version, COUNT(*)
      FROM replays r JOIN samples s ON s.id = r.sample_id JOIN batches b ON b.batch_id = r.batch_id
     WHERE s.model_id = ? AND r.state = 'acked' AND b.state = 'acked'
     GROUP BY b.policy_version, b.acked_step, s.min_version
"""


def publisher_every_n_steps(run_dir: Path, model_id: str) -> int | None:
    """``every_n_steps`` of the WeightPublisher in ``configs/trainer-<model_id>.yaml`` (1 when
    the callback leaves it at its default), or None without that config or that callback."""
    try:
        cfg = yaml.safe_load((run_dir / "configs" / f"trainer-{model_id}.yaml").read_text())
        callbacks = (cfg.get("trainer") or {}).get("callbacks") or []
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    for cb in callbacks if isinstance(callbacks, list) else []:
        path = cb.get("class_path", "") if isinstance(cb, dict) else ""
        if path.rsplit(".", 1)[-1] == "WeightPublisher":
            every = (cb.get("init_args") or {}).get("every_n_steps", 1)
            return int(every) if isinstance(every, int) and every >= 1 else None
    return None


def _read_db_staleness(data: RunData, store: ReadOnlyStore) -> None:
    """Per policy, trained samples per (reference version, staleness): see :class:`RunData`."""
    for m in data.model_ids:
        try:
            rows = store.conn.execute(_TRAINED_SAMPLES, (m, m)).fetchall()
        except sqlite3.Error as exc:
            data.notes.append(f"dataflow DB: no trained samples to measure staleness ({exc})")
            return
        if not rows:
            continue
        every = publisher_every_n_steps(data.run_dir, m)
        trainer = every is not None and all(r["step"] is not None for r in rows)
        table: dict[tuple[int, int], int] = {}
        for r in rows:
            ref = (int(r["step"]) - 1) // every if trainer else int(r["served"])
            key = (ref, ref - int(r["v"]))
            table[key] = table.get(key, 0) + int(r["n"])
        data.staleness[m] = table
        data.staleness_reference[m] = "trainer" if trainer else "dataflow"


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


def tensorboard_loggers(root: Path, legacy: bool = False) -> dict[str, tuple[Path, list[Path]]]:
    """``{name: (logger folder, [event folders])}`` of the TensorBoard logs under ``root``.

    A ``version_N`` event folder belongs to its parent (Lightning's ``<save_dir>/<name>/version_N``:
    a resumed trainer writes a new version); any other event folder is a logger of its own. A
    logger is named by its path relative to ``root`` (``lightning_logs``,
    ``trainer/lightning_logs``), or ``root``'s name when it is ``root`` itself. With ``legacy``
    (the run folder), ``tensorboard/<name>/...`` is the launcher's logger ``<name>``.
    """
    out: dict[str, tuple[Path, list[Path]]] = {}
    root = Path(root)
    for ev in event_dirs(root):
        rel = ev.relative_to(root).parts
        if legacy and len(rel) >= 2 and rel[0] == "tensorboard":
            logger, name = root / rel[0] / rel[1], rel[1]
        else:
            logger = ev.parent if (re.fullmatch(r"version_\d+", ev.name) and ev != root) else ev
            rel_logger = logger.relative_to(root).as_posix() if logger != root else ""
            name = rel_logger if rel_logger not in ("", ".") else root.resolve().name
        out.setdefault(name, (logger, []))[1].append(ev)
    return out


def _read_logger(data: RunData, name: str, logger: Path, dirs: list[Path]) -> bool:
    """Merge the scalars of one logger's event folders into ``data.scalars[name]``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    merged: dict[str, dict[int, tuple[float, float]]] = {}
    # version_* folders: a resumed trainer writes a new one; the later event of a step wins
    for version_dir in sorted(dirs, key=_version_key):
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
            data.notes.append(f"TensorBoard {shown(data, version_dir)} unreadable ({exc})")
    if not merged:
        return False
    data.scalars[name] = {tag: [(s, v) for s, (_, v) in sorted(steps.items())]
                          for tag, steps in merged.items()}
    return True


def _read_tensorboard(data: RunData, extra: tuple[Path, ...] | list[Path] = ()) -> None:
    """Scalars of every TensorBoard logger under the run folder and the ``--tensorboard`` folders.

    Loggers keep their names (``tensorboard/policy`` -> ``policy``); a name found twice (two
    trainers' ``lightning_logs``) is prefixed by the folder it was found under."""
    roots = [(data.run_dir, True)] + [(Path(p), False) for p in extra]
    seen: set[Path] = set()
    found: list[str] = []
    for root, legacy in roots:
        for name, (logger, dirs) in tensorboard_loggers(root, legacy).items():
            dirs = [d for d in dirs if d.resolve() not in seen]
            if not dirs:
                continue
            seen.update(d.resolve() for d in dirs)
            if name in data.scalars or name in {n for n, _, _ in data.tensorboard}:
                name = f"{root.resolve().name}/{name}"
                while name in data.scalars:
                    name += "'"
            where = shown(data, logger) + (" (--tensorboard)" if not legacy else "")
            if _read_logger(data, name, logger, dirs):
                data.tensorboard.append((name, logger, dirs))
                versions = ", ".join(d.name for d in sorted(dirs, key=_version_key))
                found.append(f"{name} <- {where} [{versions}]" if name != where
                             else f"{where} [{versions}]")
            else:
                data.notes.append(f"TensorBoard {where}: event files without scalars")
    looked = "RUN_DIR (tensorboard/, lightning_logs/, any folder of " + EVENTS_GLOB + ")"
    if extra:
        looked += " and " + ", ".join(str(p) for p in extra)
    if found:
        data.sources["TensorBoard"] = "; ".join(found)
    else:
        data.sources["TensorBoard"] = (f"none found in {looked}; pass --tensorboard DIR (a "
                                       f"trainer's default_root_dir or save_dir)")
        data.notes.append(f"no TensorBoard scalars in {looked}: reward, staleness and weights "
                          f"plots need them")


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
    from astralight.launch.balance import read_jsonl

    data.pool_decisions += [entry for entry in read_jsonl(path) if entry.get("time") is not None]


def load_run(run_dir: str | Path, tensorboard: tuple | list = (),
             db: str | Path | None = None) -> RunData:
    """Read every source of a run folder (plus the ``tensorboard`` folders and the ``db`` given);
    raises :class:`RunFolderError` for a non-run folder or a missing ``db`` / ``tensorboard``."""
    run_dir = Path(run_dir)
    extra = [Path(p) for p in tensorboard]
    check_run_dir(run_dir, Path(db) if db is not None else None, extra)
    data = RunData(run_dir=run_dir)
    _read_summary(data)
    _read_balance(data)
    _read_db(data, Path(db) if db is not None else None)
    _evals_from_summary(data)
    for m, table in data.evals.items():
        data.eval_versions.setdefault(m, sorted(table))
    _per_version_from_summary(data)
    _read_tensorboard(data, extra)
    _read_pool(data)
    if not data.model_ids:
        data.model_ids = sorted(set(data.evals) | set(data.per_version))
    return data


def recipe_name(data: RunData) -> str:
    """The recipe's name: ``name`` of the run folder's ``recipe.yaml`` (what the launcher saved),
    else the summary's ``recipe`` / ``name``, else read from the launcher's default folder name
    ``<name>-YYYYMMDD-HHMMSS``, else the folder's name."""
    saved = run_recipe(data.run_dir)
    if isinstance(saved.get("name"), str) and saved["name"]:
        return saved["name"]
    summary: dict[str, Any] = data.summary or {}
    for key in ("recipe", "name"):
        if isinstance(summary.get(key), str) and summary[key]:
            return summary[key]
    folder = data.run_dir.resolve().name
    m = re.fullmatch(r"(.+)-\d{8}-\d{6}", folder)
    if m:
        return m.group(1)
    return f"{folder} (the run folder's name; summary.json names no recipe)"


def run_recipe(run_dir: Path) -> dict:
    """The run folder's ``recipe.yaml`` (the recipe the launcher ran), or {} when it has none or
    it does not parse."""
    import yaml

    try:
        recipe = yaml.safe_load((Path(run_dir) / "recipe.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return recipe if isinstance(recipe, dict) else {}


def max_staleness(run_dir: Path) -> int | None:
    """The dataflow's ``max_staleness`` for the run: its exported config
    (``configs/dataflow.yaml``), else the recipe's ``dataflow`` section, else the dataflow's
    default; None when the folder holds neither."""
    import yaml

    from astralight.dataflow.config import DataflowConfig

    for load in (lambda: yaml.safe_load((Path(run_dir) / "configs" / "dataflow.yaml").read_text()),
                 lambda: run_recipe(run_dir).get("dataflow")):
        try:
            cfg = load()
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(cfg, dict):
            value = cfg.get("max_staleness", DataflowConfig.max_staleness)
            return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
    return None
