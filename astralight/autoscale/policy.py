"""The autoscaler's policy: from a balance report and the pool it sees, what to do now.

Pure (no I/O, the clock is an argument), so every rule is tested with hand-made reports:

- **target**: the report's ``decision.target`` (the dataflow's three-zone rule,
  astralight/ARCHITECTURE.md "Elasticity and the balance report"). The autoscaler asks for the
  report with ``pool`` set to the pool it counts itself; if the report was computed for another
  pool size, the same rule (:func:`astralight.dataflow.balance.decide`) is applied to the report's
  wait fraction and counts for this pool instead.
- **bounds**: the target is clamped to ``[min_instances, max_instances]``; a pool outside the
  bounds is brought back inside even during a cooldown (:meth:`Policy.bounds`, checked on every
  poll, so an instance that died is replaced without waiting for the next report, at most once per
  ``replace_backoff_s`` so a crash loop does not spin).
- **cooldown**: after any action, ``cooldown_s`` without another report-driven action. A new
  instance needs time to start and to show up in a window of versions; acting on every report
  would overshoot. A decision held by the cooldown says so in its reason.
- **retirement order**: instances that are suspect or gone first (they produce little and may hold
  leases), then the least productive (lowest ``samples_per_s``), ties broken newest first (an
  instance still starting has produced nothing and cost least). Only instances this autoscaler
  started are retired, unless ``retire_unmanaged``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

#: statuses of the dataflow's instance table that count as members of the pool
LIVE = ("healthy", "suspect")
#: states (or statuses) of an instance on its way out: not counted, never retired twice
LEAVING = ("draining", "left")
#: retired first, in this order, before any healthy instance
UNHEALTHY = ("gone", "suspect")


@dataclass(frozen=True)
class PolicyConfig:
    """Bounds and pacing; every bad value raises ValueError naming the field."""

    min_instances: int = 1
    max_instances: int = 4
    cooldown_s: float = 120.0
    retire_unmanaged: bool = False
    replace_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("min_instances", "max_instances"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
        if self.max_instances < max(self.min_instances, 1):
            raise ValueError(f"max_instances: must be >= min_instances and >= 1, got "
                             f"{self.max_instances} (min_instances {self.min_instances})")
        for name in ("cooldown_s", "replace_backoff_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: must be a number of seconds >= 0, got {value!r}")

    def clamp(self, n: int) -> int:
        return min(max(int(n), self.min_instances), self.max_instances)


@dataclass
class Member:
    """One instance counted in the pool, as the policy sees it."""

    instance_id: str
    managed: bool            # started by this autoscaler (and so retirable)
    status: str              # healthy | suspect | gone (the dataflow's) | starting (not registered yet)
    samples_per_s: float = 0.0
    since: float = 0.0       # registered (or launched) at, seconds; larger = newer


@dataclass
class Decision:
    """What the autoscaler decided, and why; one line of output and one JSON record each."""

    action: str              # scale_up | scale_down | hold | replace | initial | died | shutdown
                             # | adopt
    pool: int                # the pool counted when deciding
    target: int              # the pool size aimed at (after bounds)
    launch: int = 0          # instances to start
    retire: list[str] = field(default_factory=list)  # instances to drain and stop, in order
    reason: str = ""
    report: dict | None = None  # the report's own view: versions, wait_fraction, action, target, pool

    def line(self) -> str:
        what = self.action
        if self.launch:
            what += f" +{self.launch}"
        if self.retire:
            what += f" -{len(self.retire)} ({', '.join(self.retire)})"
        head = ""
        if self.report and self.report.get("versions"):
            first, last = self.report["versions"]
            head = (f"versions {first}..{last}: wait {self.report.get('wait_fraction', 0):.1%}, ")
        return f"{head}pool {self.pool} -> {self.target}: {what}: {self.reason}"

    def to_dict(self) -> dict:
        return asdict(self)


def pool_members(instances: Iterable[Mapping], managed: Mapping[str, float],
                 model_id: str | None = None) -> list[Member]:
    """The pool: every managed instance still running (``managed``: id -> launched at) and every
    live unmanaged instance of the dataflow's table that serves ``model_id``.

    A managed instance not in the table yet is ``starting``; one whose table row says it is
    draining or has left is on its way out and not counted. ``samples_per_s`` falls back to
    ``samples_pushed / alive_s`` for tables without it.
    """
    rows = {str(r["instance_id"]): r for r in instances}
    members = []
    for iid, launched_at in managed.items():
        row = rows.get(iid)
        if row is None:
            members.append(Member(iid, True, "starting", 0.0, float(launched_at)))
        elif not _leaving(row):
            members.append(_member(row, True, launched_at))
    for iid, row in rows.items():
        if iid in managed or _leaving(row) or row.get("status") not in LIVE:
            continue
        if model_id is not None and model_id not in (row.get("model_ids") or [model_id]):
            continue
        members.append(_member(row, False, 0.0))
    return members


def _leaving(row: Mapping) -> bool:
    return row.get("state") in LEAVING or row.get("status") in LEAVING


def _member(row: Mapping, managed: bool, launched_at: float) -> Member:
    rate = row.get("samples_per_s")
    if rate is None:
        alive = row.get("alive_s") or 0.0
        rate = (row.get("samples_pushed") or 0) / alive if alive > 0 else 0.0
    since = row.get("registered_at")
    return Member(str(row["instance_id"]), managed, str(row.get("status", "healthy")),
                  float(rate), float(since if since is not None else launched_at))


def retirement_order(members: Iterable[Member], retire_unmanaged: bool = False) -> list[Member]:
    """The retirable members, first to retire first: gone, then suspect, then the least
    productive; ties newest first (equal timestamps: the later in ``members``, which lists
    managed instances in launch order)."""
    candidates = [(i, m) for i, m in enumerate(members) if m.managed or retire_unmanaged]

    def key(item: tuple[int, Member]):
        i, m = item
        rank = UNHEALTHY.index(m.status) if m.status in UNHEALTHY else len(UNHEALTHY)
        return (rank, m.samples_per_s, -m.since, -i)

    return [m for _, m in sorted(candidates, key=key)]


def report_target(report: Mapping, pool: int) -> tuple[int, str, str]:
    """``(target, action, reason)`` of the report for a pool of ``pool`` instances.

    The report's own decision when it was computed for this pool; else the same three-zone rule
    over the report's wait fraction and counts.
    """
    d = report.get("decision") or {}
    if d.get("pool") == pool and "target" in d:
        return int(d["target"]), str(d.get("action", "hold")), str(d.get("reason", ""))
    from astralight.dataflow.balance import decide

    redone = decide(pool, float(report.get("wait_fraction") or 0.0),
                    int(report.get("consumed") or 0), int(report.get("accepted") or 0))
    return redone.target, redone.action, f"{redone.reason} (rule applied to pool {pool})"


class Policy:
    """Decisions with memory of the last action (for the cooldown) and the last replacement."""

    def __init__(self, config: PolicyConfig):
        self.config = config
        self.last_action: float | None = None
        self.last_replace: float | None = None

    def cooldown_left(self, now: float) -> float:
        if self.last_action is None:
            return 0.0
        return max(0.0, self.last_action + self.config.cooldown_s - now)

    def acted(self, now: float) -> None:
        """Start a cooldown (called by :meth:`decide` and :meth:`bounds` for every action; call it
        for actions taken outside them, such as the initial launch)."""
        self.last_action = now

    def decide(self, report: Mapping, members: list[Member], now: float) -> Decision:
        """The report-driven decision (an action starts the cooldown)."""
        cfg = self.config
        pool = len(members)
        wanted, action, reason = report_target(report, pool)
        view = {"versions": report.get("versions"), "wait_fraction": report.get("wait_fraction"),
                "action": action, "target": wanted, "pool": pool}
        target = cfg.clamp(wanted)
        note = reason
        if target != wanted:
            bound = "max_instances" if wanted > target else "min_instances"
            note = f"{reason}; report target {wanted} clamped to {bound} {target}"
        if target == pool:
            return Decision("hold", pool, pool, reason=note, report=view)
        outside = pool < cfg.min_instances or pool > cfg.max_instances
        left = self.cooldown_left(now)
        if left > 0 and not outside:
            return Decision("hold", pool, pool, report=view,
                            reason=f"cooldown: {left:.0f}s left of {cfg.cooldown_s:.0f}s "
                                   f"(report: {action} {wanted}; {reason})")
        decision = self._resize(pool, target, members, note)
        decision.report = view
        if decision.action != "hold":
            self.acted(now)
        return decision

    def bounds(self, members: list[Member], now: float) -> Decision | None:
        """Between reports: bring a pool outside the bounds back inside (a died instance is
        replaced), at most once per ``replace_backoff_s``; None when nothing to do."""
        cfg = self.config
        pool = len(members)
        if cfg.min_instances <= pool <= cfg.max_instances:
            return None
        if self.last_replace is not None and now - self.last_replace < cfg.replace_backoff_s:
            return None
        target = cfg.clamp(pool)
        reason = (f"pool below min_instances {cfg.min_instances}" if pool < target
                  else f"pool above max_instances {cfg.max_instances}")
        decision = self._resize(pool, target, members, reason)
        if decision.action == "hold":
            return None
        decision.action = "replace" if pool < target else "scale_down"
        self.last_replace = now
        self.acted(now)
        return decision

    def _resize(self, pool: int, target: int, members: list[Member], reason: str) -> Decision:
        if target > pool:
            return Decision("scale_up", pool, target, launch=target - pool, reason=reason)
        order = retirement_order(members, self.config.retire_unmanaged)
        chosen = [m.instance_id for m in order[:pool - target]]
        if not chosen:
            return Decision("hold", pool, pool,
                            reason=f"{reason}; no instance this autoscaler may retire "
                                   f"(retire_unmanaged is off)")
        if len(chosen) < pool - target:
            reason += f"; only {len(chosen)} retirable"
        return Decision("scale_down", pool, pool - len(chosen), retire=chosen, reason=reason)

