"""The balance report: is rollout production keeping up with training, and how big should the pool be?

The dataflow sees both sides of the system: what the rollout services produce (pushed, accepted,
dropped as stale) and what the trainers consume (samples in acknowledged batches, with the time
each trainer waited for its batch and the time its whole step took, reported with the ack). Over
a window of trainer versions it computes the trainer wait fraction ``w = sum(wait) / sum(step)``
and the three-zone decision of astralight/ARCHITECTURE.md ("Elasticity and the balance report"):

- ``w > tau_high``: the trainer starves, ``scale_up`` to ``ceil(G / (1 - w))``;
- ``w < tau_low`` and both counts positive: rollout overproduces, ``scale_down`` to
  ``min(G, ceil(G * consumed / accepted * rho))``;
- otherwise ``hold`` at ``G``.

The report also says how long the window took and what the pool delivered in it:

- ``wall_s``: from the publication of the window's first version to that of the next version
  after its last (:func:`window_wall_s`; the current version's window is still open: until now);
- ``eval_s``: the lease->push seconds of the eval tasks finished in the window (rollout time
  that went to held-out evaluation instead of training data);
- ``rates``: produced / accepted / consumed / stale per second of ``wall_s``;
- ``capacity_units`` (GPUs or CPU slots of the live instances) and
  ``throughput_per_capacity_unit`` = produced / ``wall_s`` / ``capacity_units``;
- ``agent`` (only when tool workflows produced the window's samples): episodes, the share that
  called a tool, calls per episode, and failed calls by kind (:mod:`astralight.agents.stats`).

Pure functions over the per-version counters (``Store.version_counters``) and publication times,
so the same numbers serve the route, a text file and TensorBoard.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from astralight.agents.stats import COUNTER_NAMES as AGENT_COUNTERS
from astralight.agents.stats import window_section as agent_window

#: the counters a window sums (names as in the dataflow's per-version counters)
WINDOW_COUNTERS = ("rollouts_generated", "samples_accepted", "samples_trained", "stale_dropped",
                   "groups_filtered", "samples_filtered", "trainer_wait_ms", "trainer_step_ms",
                   "trainer_steps_timed", "eval_task_ms")


@dataclass
class Decision:
    action: str        # scale_up | scale_down | hold
    pool: int          # G: the pool size the window ran with
    target: int        # G_target
    reason: str


def decide(pool: int, wait_fraction: float, consumed: int, accepted: int,
           tau_high: float = 0.10, tau_low: float = 0.05, rho: float = 1.10) -> Decision:
    """The three-zone target pool size for a window (see the module docstring)."""
    if pool < 0:
        raise ValueError(f"pool: must be >= 0, got {pool}")
    if not 0 <= tau_low <= tau_high < 1:
        raise ValueError(f"tau_low/tau_high: need 0 <= tau_low <= tau_high < 1, got "
                         f"{tau_low}/{tau_high}")
    w = min(max(float(wait_fraction), 0.0), 0.99)
    if w > tau_high:
        # rounded first: 1 / (1 - 0.9) is 10.000000000000002 in floating point, not 10
        target = math.ceil(round(max(pool, 1) / (1.0 - w), 9))
        return Decision("scale_up", pool, target,
                        f"trainer waited {w:.1%} of its steps (> {tau_high:.0%})")
    if w < tau_low and consumed > 0 and accepted > 0:
        target = min(pool, math.ceil(pool * consumed / accepted * rho))
        if target < pool:
            return Decision("scale_down", pool, target,
                            f"trainer waited {w:.1%} (< {tau_low:.0%}); it consumed "
                            f"{consumed / accepted:.0%} of what was accepted")
    return Decision("hold", pool, pool, f"trainer waited {w:.1%}: within the target band")


def window_wall_s(published: dict[int, float], first: int, last: int, started_at: float,
                  now: float) -> float:
    """Wall seconds of versions ``first..last``: from the publication of ``first`` to that of
    the next published version after ``last`` (or ``now`` while there is none).

    ``published`` maps version -> publication time; a version never published (a publisher
    that fell behind skips versions) starts when the newest version before it was published,
    and version 0, never published, when the service first started (``started_at``).
    """
    before = [v for v in published if v <= first]
    start = published[max(before)] if before else started_at
    after = [v for v in published if v > last]
    end = published[min(after)] if after else now
    return max(0.0, end - start)


def _per_s(count: float, wall_s: float | None) -> float | None:
    return round(count / wall_s, 4) if wall_s else None


def window_report(per_version: dict[int, dict[str, int]], first: int, last: int, pool: int,
                  wall_s: float | None = None, capacity_units: float | None = None,
                  **thresholds: float) -> dict:
    """The report for versions ``first..last`` (inclusive) of one policy's per-version counters.

    ``wall_s``: the window's wall time (:func:`window_wall_s`); ``capacity_units``: of the live
    pool. Rates and the throughput per capacity unit are None without them (or when zero).
    """
    if last < first:
        raise ValueError(f"window: last version {last} before first {first}")
    sums = dict.fromkeys(WINDOW_COUNTERS, 0)
    for v in range(first, last + 1):
        for name in WINDOW_COUNTERS:
            sums[name] += int(per_version.get(v, {}).get(name, 0))
    step_s, wait_s = sums["trainer_step_ms"] / 1000.0, sums["trainer_wait_ms"] / 1000.0
    w = wait_s / step_s if step_s > 0 else 0.0
    decision = decide(pool, w, sums["samples_trained"], sums["samples_accepted"], **thresholds)
    steps = sums["trainer_steps_timed"]
    counts = {"produced": sums["rollouts_generated"], "accepted": sums["samples_accepted"],
              "consumed": sums["samples_trained"], "stale": sums["stale_dropped"]}
    agent_sums: dict[str, int] = {}
    for v in range(first, last + 1):
        for name in AGENT_COUNTERS:
            agent_sums[name] = agent_sums.get(name, 0) + int(per_version.get(v, {}).get(name, 0))
    per_unit = None
    if wall_s and capacity_units:
        per_unit = round(counts["produced"] / wall_s / capacity_units, 4)
    return {
        "versions": [first, last],
        "wall_s": round(wall_s, 3) if wall_s is not None else None,
        "eval_s": round(sums["eval_task_ms"] / 1000.0, 3),
        "wait_fraction": round(w, 4),
        "trainer_step_s": round(step_s, 3),
        "trainer_wait_s": round(wait_s, 3),
        "mean_step_s": round(step_s / steps, 4) if steps else None,
        "mean_wait_s": round(wait_s / steps, 4) if steps else None,
        **counts,
        "filtered": sums["samples_filtered"],
        "rates": {k: _per_s(n, wall_s) for k, n in counts.items()},
        "capacity_units": round(capacity_units, 4) if capacity_units is not None else None,
        "throughput_per_capacity_unit": per_unit,
        "decision": asdict(decision),
        **({"agent": agent} if (agent := agent_window(agent_sums)) else {}),
    }


def pool_report(per_version: dict[int, dict[str, int]], first: int, last: int,
                instances: list[dict], pool: int | None, wall_s: float | None,
                **labels: object) -> dict:
    """:func:`window_report` with ``labels`` (the policy and its current version), the instance
    table ``instances`` (the live ones set G when ``pool`` is None, and their capacity units
    normalise the throughput) and the weight-update pauses the instances reported."""
    live = [r for r in instances if r["live"]]
    report = window_report(per_version, first, last, pool if pool is not None else len(live),
                           wall_s=wall_s, capacity_units=sum(r["capacity_units"] for r in live))
    report.update(labels)
    report.update(live_instances=len(live), instances=instances,
                  weight_pause_s=round(sum(float(r["reported"].get("weight_pause_s", 0))
                                           for r in instances), 4))
    return report
