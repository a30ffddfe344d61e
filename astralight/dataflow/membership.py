"""Pool membership: who is in the RaaS pool, how healthy each instance is, how much it may lease.

A RaaS instance registers with its capacity (``capacity``: the most tasks it runs at once;
``capacity_units``: the GPUs or CPU slots it occupies, what the balance report normalises
throughput by), renews itself by leasing and heartbeating, and leaves by deregistering. Its
stored ``state`` is what it or an operator said: ``active``, ``draining`` (the drain route: it
gets no new task and its heartbeat replies ``drain=True``) or ``left`` (deregistered; a later
register makes it ``active`` again, its counters kept). Its *status* adds what the dataflow
observed (:func:`status`): missed heartbeats and failed tasks make it ``suspect``, a whole lease
period of silence ``gone`` (its leases have expired and are re-issued).

:func:`lease_allowance` is how assignment favours instances with free capacity and throttles
the others: never more tasks held than ``capacity``; none while draining or left; a single probe
while its last ``suspect_failures`` tasks failed (one success lifts it); and a slow instance
(mean lease->push time above ``slow_factor`` x the pool median) holds proportionally fewer, so
it stops hoarding tasks the fast instances would finish sooner.

**Engine limits.** A RaaS registers, per model_id it serves, what its engine can produce
(``limits``: ``vocab_size``, the rows of the model's embedding, and ``max_model_len``, its context
length); :func:`check_limits` validates them, and the service refuses pushed samples with a token
id outside the vocabulary or more tokens than the context (the trainer would crash on the first,
and pad a whole batch to the second). The dataflow's own ``vocab_sizes`` config wins and a
registration must agree with it, and with what the other live instances serving the same
model_id registered (they must serve the same model).

**Workflow.** A RaaS registers the name of the workflow it runs (``meta["workflow"]``); one that is
not the dataflow's ``workflow:`` setting is refused (409 ``workflow``, :func:`check_workflow`),
since every task names that setting and the RaaS would hand every task back.

Pure functions over plain values: the service core feeds them stored rows and the clock, tests
feed them hand-made values.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Mapping

from astralight.dataflow.errors import ServiceError
from astralight.dataflow.rows import InstanceRow
from astralight.protocol import MAX_ARRAY_ELEMENTS, MAX_VOCAB_SIZE

#: stored states (what the instance or an operator asked for)
ACTIVE, DRAINING, LEFT = "active", "draining", "left"
#: observed statuses (:func:`status`)
HEALTHY, SUSPECT, GONE = "healthy", "suspect", "gone"
#: an instance's mean task time counts (for itself and the pool median) after this many tasks
MIN_TIMED_TASKS = 3
#: what a registration's ``limits`` may say per model_id, with the largest accepted value
LIMIT_KEYS = {"vocab_size": MAX_VOCAB_SIZE, "max_model_len": MAX_ARRAY_ELEMENTS}


def status(state: str, idle_s: float, fail_streak: int, lease_seconds: float,
           suspect_failures: int = 3) -> str:
    """``left`` (deregistered), ``draining``, ``gone`` (silent for more than a lease period),
    ``suspect`` (silent for more than half of one: heartbeats come every third; or its last
    ``suspect_failures`` tasks failed), else ``healthy``."""
    if state == LEFT:
        return LEFT
    if state == DRAINING:
        return DRAINING
    if idle_s > lease_seconds:
        return GONE
    if idle_s > lease_seconds / 2 or fail_streak >= suspect_failures:
        return SUSPECT
    return HEALTHY


def is_live(state: str, idle_s: float, lease_seconds: float) -> bool:
    """Counts in the pool G (and its capacity units): not left, and heard from within a lease
    period (a draining instance that went silent died before deregistering)."""
    return state != LEFT and idle_s <= lease_seconds


def mean_task_s(busy_s: float, tasks_timed: int) -> float | None:
    """Mean lease->push seconds over the instance's timed tasks (None before the first)."""
    return busy_s / tasks_timed if tasks_timed > 0 else None


def pool_median(means: Iterable[tuple[float | None, int]]) -> float | None:
    """Median mean task time over ``(mean_task_s, tasks_timed)`` of the live instances, counting
    only those with at least :data:`MIN_TIMED_TASKS` timed tasks (None if there are none)."""
    values = [m for m, n in means if m is not None and n >= MIN_TIMED_TASKS]
    return statistics.median(values) if values else None


def slow_ratio(mean_s: float | None, tasks_timed: int, median_s: float | None) -> float | None:
    """How many times slower than the pool median the instance is (None: not enough data)."""
    if mean_s is None or median_s is None or median_s <= 0 or tasks_timed < MIN_TIMED_TASKS:
        return None
    return mean_s / median_s


def lease_allowance(requested: int, *, capacity: int, held: int, state: str = ACTIVE,
                    fail_streak: int = 0, mean_s: float | None = None, tasks_timed: int = 0,
                    median_s: float | None = None, suspect_failures: int = 3,
                    slow_factor: float = 3.0) -> int:
    """How many tasks a lease of ``requested`` may hand the instance now.

    ``min(requested, limit - held)`` where ``held`` is the tasks it holds unexpired leases on
    and ``limit`` is ``capacity``, 0 while draining or left, 1 (a probe) while ``fail_streak >=
    suspect_failures``, and ``max(1, ceil(capacity / ratio))`` for a slow instance (``ratio`` =
    its mean task time over the pool median, above ``slow_factor``, with at least
    :data:`MIN_TIMED_TASKS` timed tasks). The limits bound the tasks held at once, so a throttled
    instance does not collect more by leasing more often.
    """
    if state in (DRAINING, LEFT):
        return 0
    limit = capacity
    if fail_streak >= suspect_failures:
        limit = min(limit, 1)
    ratio = slow_ratio(mean_s, tasks_timed, median_s)
    if ratio is not None and ratio > slow_factor:
        limit = min(limit, max(1, math.ceil(capacity / ratio)))
    return max(0, min(requested, limit - held))


def instance_row(row: InstanceRow | Mapping, now: float, held: int, lease_seconds: float,
                 suspect_failures: int = 3) -> dict:
    """One row of the instance table (``/v1/stats["instances"]``, the balance report) from a
    stored instance row (a mapping of its columns is read as one: :meth:`InstanceRow.of`);
    ``throughput_share`` is added by :func:`instance_table`."""
    row = InstanceRow.of(row)
    idle = now - row.last_seen
    end = row.left_at if row.state == LEFT and row.left_at is not None else row.last_seen
    alive = max(0.0, float(row.alive_prior_s) + end - row.registered_at)
    mean = mean_task_s(float(row.busy_s), int(row.tasks_timed))
    return {
        "instance_id": row.instance_id, "model_ids": list(row.model_ids),
        "capacity": row.capacity, "capacity_units": float(row.capacity_units),
        "state": row.state,
        "status": status(row.state, idle, row.fail_streak, lease_seconds, suspect_failures),
        "live": is_live(row.state, idle, lease_seconds),
        "registered_at": row.registered_at, "left_at": row.left_at,
        "last_seen": row.last_seen, "idle_s": round(idle, 3), "alive_s": round(alive, 3),
        "in_flight": held, "reported_in_flight": row.reported_in_flight,
        "tasks_leased": row.tasks_leased, "tasks_done": row.tasks_done,
        "tasks_failed": row.tasks_failed, "tasks_returned": row.tasks_returned,
        "fail_streak": row.fail_streak,
        "mean_task_s": round(mean, 4) if mean is not None else None,
        "samples_pushed": row.samples_pushed,
        "samples_per_s": round(row.samples_pushed / alive, 4) if alive > 0 else 0.0,
        "limits": dict(row.limits),
    }


def instance_table(rows: Iterable[InstanceRow | Mapping], now: float, held: Mapping[str, int],
                   lease_seconds: float, suspect_failures: int = 3) -> list[dict]:
    """The instance table, with each instance's share of all samples pushed."""
    typed = [InstanceRow.of(r) for r in rows]
    table = [instance_row(r, now, held.get(r.instance_id, 0), lease_seconds, suspect_failures)
             for r in typed]
    total = sum(r["samples_pushed"] for r in table) or 1
    for r in table:
        r["throughput_share"] = round(r["samples_pushed"] / total, 4)
    return table


# ----------------------------------------------------------------------------- workflow


def check_workflow(meta: Mapping, workflow: str) -> None:
    """Refuse a registration whose RaaS runs another workflow than this dataflow's ``workflow:``.

    Every task the dataflow creates names its ``workflow:`` setting (``Task.workflow``), and a
    RaaS runs only the tasks that name its workflow class's ``name`` (it returns the others): an
    instance whose names differ would lease, return and lease the same tasks forever. The RaaS
    says its workflow's name at registration (``meta["workflow"]``); a name that differs is
    refused with 409 naming both values and the settings to change. A registration that names no
    workflow (an older RaaS, a client of one's own) or an empty name (a workflow that runs any
    task) is not checked.
    """
    theirs = meta.get("workflow") if isinstance(meta, Mapping) else None
    if not isinstance(theirs, str) or not theirs or theirs == workflow:
        return
    raise ServiceError(409, "workflow", (
        f"this RaaS runs workflow {theirs!r} (its workflow class's `name`) but this dataflow's "
        f"`workflow:` setting is {workflow!r}, and every task it creates asks for {workflow!r}: "
        f"the RaaS could run none of them. Set the dataflow's `workflow: {theirs}` (a recipe's "
        f"`dataflow.workflow`), or give the RaaS a `workflow:` whose class is named "
        f"{workflow!r}"))


# ----------------------------------------------------------------------------- engine limits


def check_limits(limits: Any, model_ids: list[str], field: str = "limits") -> dict:
    """A registration's ``limits``: ``{model_id: {"vocab_size": int, "max_model_len": int}}``
    for model_ids the instance serves, each value a positive int within :data:`LIMIT_KEYS`
    (either key may be absent: an engine that does not know it says nothing). Returns a clean
    copy; raises ServiceError 422 naming ``limits.<model_id>.<key>``."""
    if limits is None:
        return {}
    if not isinstance(limits, dict):
        raise ServiceError(422, field, f"must map model_id -> {{vocab_size, max_model_len}}, got "
                                       f"{type(limits).__name__}")
    out: dict[str, dict[str, int]] = {}
    for mid, entry in limits.items():
        at = f"{field}.{str(mid)[:64]}"
        if mid not in model_ids:
            raise ServiceError(422, at, f"{str(mid)[:64]!r} is not one of the model_ids this "
                                        f"instance registers for {model_ids}")
        if not isinstance(entry, dict):
            raise ServiceError(422, at, f"must be a map {{vocab_size, max_model_len}}, got "
                                        f"{type(entry).__name__}")
        clean: dict[str, int] = {}
        for key, value in entry.items():
            if key not in LIMIT_KEYS:
                raise ServiceError(422, f"{at}.{str(key)[:64]}",
                                   f"unknown limit; an engine may say {sorted(LIMIT_KEYS)}")
            if value is None:
                continue
            hi = LIMIT_KEYS[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise ServiceError(422, f"{at}.{key}", f"must be an int in [1, {hi}], got "
                                                       f"{value!r}")
            clean[key] = value
        if clean:
            out[mid] = clean
    return out


def vocab_conflict(model_id: str, vocab_size: int, others: Iterable[tuple[str, Mapping]]
                   ) -> tuple[str, int] | None:
    """``(instance_id, vocab_size)`` of the first of ``others`` (``(instance_id, limits)`` of
    the live instances besides the registering one) that registered another vocabulary size
    for ``model_id``; None when they agree."""
    for iid, limits in others:
        theirs = (limits.get(model_id) or {}).get("vocab_size")
        if theirs is not None and theirs != vocab_size:
            return iid, theirs
    return None


def pool_limits(model_id: str, registered: Iterable[Mapping]) -> dict[str, int]:
    """What the pool as a whole says about ``model_id`` (for an instance that registered
    nothing itself): the vocabulary size of the first registration that names one (live
    instances agree, :func:`vocab_conflict`), and the largest ``max_model_len`` (a sample may
    come from the instance with the longest context)."""
    out: dict[str, int] = {}
    for limits in registered:
        entry = limits.get(model_id) or {}
        if "vocab_size" in entry and "vocab_size" not in out:
            out["vocab_size"] = int(entry["vocab_size"])
        if "max_model_len" in entry:
            out["max_model_len"] = max(out.get("max_model_len", 0), int(entry["max_model_len"]))
    return out
