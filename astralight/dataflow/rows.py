"""Typed rows of the dataflow's SQLite tables, as :class:`~astralight.dataflow.store.Store`
returns them.

Each row is a frozen dataclass with typed fields in the table's column order: JSON columns (``model_ids``, ``meta``,
``limits``, ``pass_k``, a journal entry's ``data``) are decoded once, here, and BLOB columns
are ``bytes`` with a method that decodes the msgpack they hold (a task's payload, a sample, a
manifest). Columns added after release (:data:`~astralight.dataflow.schema.MIGRATIONS`), which an
older state folder read without migration lacks (as the run report reads it), have the default
the migration would give them. So the service logic reads attributes and
never the storage format.

Mapping reads (``row["state"]``, ``dict(row)``) give the stored columns as SQLite holds them
(JSON as text): they are for readers outside the service logic, such as the HTTP layer's
ownership checks and the run report's instance table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from astralight.protocol import Sample, Task, WeightManifest, decode

R = TypeVar("R", bound="StoredRow")


def _json(raw: Any, default: Any) -> Any:
    """A JSON column's value: ``default`` for NULL, for text that is not JSON, or for a value
    not of ``default``'s type."""
    if raw is None or raw == "":
        return default
    try:
        value = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except ValueError:
        return default
    return value if isinstance(value, type(default)) else default


class StoredRow:
    """Base of the typed rows: built from a ``sqlite3.Row`` (or any mapping of columns) by
    :meth:`of`; read as a mapping, it is the stored columns (see the module docstring)."""

    #: JSON columns and the value NULL (or a column the table lacks) reads as
    JSON: ClassVar[dict[str, Any]] = {}
    #: BLOB columns (read as ``bytes``)
    BLOBS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def of(cls: type[R], row: Mapping | R) -> R:
        """The typed row of ``row``: its columns this class declares, JSON decoded."""
        if isinstance(row, cls):
            return row
        columns = list(row.keys())
        have = set(columns)
        values = {}
        for f in fields(cls):
            if f.name in cls.JSON:
                values[f.name] = _json(row[f.name] if f.name in have else None,
                                       cls.JSON[f.name])
            elif f.name in have:
                value = row[f.name]
                values[f.name] = bytes(value) if f.name in cls.BLOBS else value
        typed = cls(**values)
        object.__setattr__(typed, "_columns", {k: row[k] for k in columns})
        return typed

    def _stored(self) -> dict[str, Any]:
        columns = self.__dict__.get("_columns")
        return columns if columns is not None else {f.name: getattr(self, f.name)
                                                    for f in fields(self)}

    def keys(self) -> list[str]:
        return list(self._stored())

    def __getitem__(self, key: str) -> Any:
        return self._stored()[key]


@dataclass(frozen=True)
class InstanceRow(StoredRow):
    """A registered RaaS instance: capacity, state, health counters and registered limits
    (``{model_id: {vocab_size, max_model_len}}``, empty when its engines said nothing)."""

    JSON: ClassVar[dict[str, Any]] = {"model_ids": [], "meta": {}, "limits": {}}

    instance_id: str
    model_ids: list[str]
    capacity: int
    meta: dict
    registered_at: float
    last_seen: float
    tasks_leased: int
    samples_pushed: int
    capacity_units: float = 1.0
    state: str = "active"
    left_at: float | None = None
    alive_prior_s: float = 0.0
    tasks_done: int = 0
    tasks_failed: int = 0
    tasks_returned: int = 0
    fail_streak: int = 0
    busy_s: float = 0.0
    tasks_timed: int = 0
    reported_in_flight: int | None = None
    limits: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TaskRow(StoredRow):
    """A task (train or eval) and its lease; ``payload`` is the msgpack of its :class:`Task`."""

    JSON: ClassVar[dict[str, Any]] = {"model_ids": []}
    BLOBS: ClassVar[tuple[str, ...]] = ("payload",)

    seq: int
    task_id: str
    kind: str
    model_ids: list[str]
    target_model: str | None
    eval_version: int | None
    prompt_index: int | None
    payload: bytes
    state: str
    instance_id: str | None
    deadline: float | None
    lease_count: int
    created: float
    done_at: float | None
    leased_at: float | None = None

    def task(self) -> Task:
        return decode(self.payload)


@dataclass(frozen=True)
class SampleRow(StoredRow):
    """A stored sample; ``blob`` is the msgpack of its :class:`Sample`. ``uses``: how often it
    was replayed (served or acked), filled by :meth:`Store.replay_candidates` only."""

    BLOBS: ClassVar[tuple[str, ...]] = ("blob",)

    id: int
    model_id: str
    min_version: int
    state: str
    blob: bytes
    uses: int = 0

    def sample(self) -> Sample:
        return decode(self.blob)


@dataclass(frozen=True)
class BatchRow(StoredRow):
    """A served batch until (and after) its ack."""

    batch_id: str
    model_id: str
    trainer_id: str | None
    policy_version: int
    n: int
    state: str
    served_at: float
    acked_at: float | None
    renewed_at: float | None = None
    acked_step: int | None = None
    rolled_back_at: float | None = None


@dataclass(frozen=True)
class VersionRow(StoredRow):
    """A stored (not garbage-collected) published version; ``blob`` is its manifest's msgpack."""

    BLOBS: ClassVar[tuple[str, ...]] = ("blob",)

    version: int
    published_at: float
    blob: bytes

    def manifest(self) -> WeightManifest:
        return decode(self.blob)


@dataclass(frozen=True)
class EvalRunRow(StoredRow):
    """A scheduled eval: ``k`` of avg@k / pass@k, ``n`` samples per prompt (None: ``k``, a run
    stored without that column) and the k values of pass@k (empty: ``[k]``)."""

    JSON: ClassVar[dict[str, Any]] = {"pass_k": []}

    model_id: str
    version: int
    n_prompts: int
    k: int
    scheduled_at: float
    n: int | None = None
    pass_k: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class EvalReportRow(StoredRow):
    """One eval prompt's report (:func:`astralight.dataflow.evals.summarize`); the team and
    tool counts are None where the workflow has no team or no tools (or the DB predates them)."""

    model_id: str
    version: int
    prompt_index: int
    task_id: str
    n_samples: int
    n_correct: int
    sum_reward: float
    min_version: int | None
    max_version: int | None
    reported_at: float
    n_team_correct: int | None = None
    n_tool_calling: int | None = None


@dataclass(frozen=True)
class JournalEntry(StoredRow):
    """A curator event of the plugin journal: ``outcome`` or ``version`` with its ``data``."""

    JSON: ClassVar[dict[str, Any]] = {"data": {}}

    seq: int
    kind: str
    data: dict = field(default_factory=dict)
