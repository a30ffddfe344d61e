"""The launcher's progress line: where the run is, how fast it goes and when it will end.

``[   120s] version 40/150 | 2.1 s/version, ETA 3m51s | trained 10240 | rollouts ... | eval v0
21.0% -> v40 63.5%``. The rate (:class:`ProgressRate`) is measured from the first publication
this launch saw, so the start-up (prepare, vLLM, the first batch) does not distort it; the ETA
is the versions left at that rate, or the time budget left (``stop.max_wall_s``, the trainer's
``max_time``) when that comes first. A time-only run (no ``stop.versions``) shows ``version 40``
with no target and its budget's ETA.
"""

from __future__ import annotations

from astralight.launch.summary import agents_failed, policy_stats


def duration(seconds: float) -> str:
    """``42s``, ``4m10s``, ``1h05m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


class ProgressRate:
    """Versions per second since the first publication seen (:meth:`update` at each look)."""

    def __init__(self):
        self._base: int | None = None
        self._since: tuple[float, int] | None = None  # (time, version) of the first publication
        self._latest: tuple[float, int] | None = None

    def update(self, now: float, version: int) -> None:
        if self._base is None:
            self._base = version
        elif self._since is None and version > self._base:
            self._since = (now, version)
        self._latest = (now, version)

    def per_second(self) -> float | None:
        """None until two publications were seen."""
        if self._since is None or self._latest is None:
            return None
        (t0, v0), (t1, v1) = self._since, self._latest
        return (v1 - v0) / (t1 - t0) if v1 > v0 and t1 > t0 else None

    def text(self, now: float, version: int, target: int | None,
             budgets: dict[str, float] | None = None) -> str:
        """``2.1 s/version, ETA 3m51s`` (``versions/s`` when faster than one a second): the
        ETA of whichever ends the run first, the ``target`` versions at this rate or a time
        budget of ``budgets`` (``{"max_wall_s": end, "max_time": end}``, absolute times), named
        in brackets when it is a budget. A time-only run (``target`` None) shows its budget's
        ETA from the start, before any rate is known."""
        rate = self.per_second()
        ends = sorted((end, name) for name, end in (budgets or {}).items() if end is not None)
        if rate is None:
            if target is None and ends:
                return f"rate --, ETA {duration(ends[0][0] - now)} ({ends[0][1]})"
            return "rate --"
        speed = f"{rate:.1f} versions/s" if rate >= 1 else f"{1 / rate:.1f} s/version"
        if target is not None:
            ends.append((now + max(target - version, 0) / rate, ""))
        if not ends:
            return speed
        end, name = min(ends)
        return f"{speed}, ETA {duration(end - now)}" + (f" ({name})" if name else "")


def progress_line(elapsed: float, target: int | None, stats: dict, evals: dict[int, dict],
                  model_id: str, rate_text: str = "") -> str:
    """One progress line from the dataflow's stats and eval table (``rate_text``: from
    :meth:`ProgressRate.text`)."""
    pol = policy_stats(stats, model_id)
    version = pol.get("current_version", 0)
    done = [v for v, r in sorted(evals.items()) if r.get("complete")]
    eval_text = ""
    if done:
        first, last = evals[done[0]], evals[done[-1]]
        eval_text = (f" | eval v{done[0]} {100 * first['avg_at_k']:.1f}%"
                     f" -> v{done[-1]} {100 * last['avg_at_k']:.1f}%")
    trained = pol.get("samples_trained", pol.get("samples_acked", 0))
    rollouts = pol.get("rollouts_generated")
    rollout_text = f" | rollouts {rollouts}" if rollouts is not None else ""
    instances = stats.get("instances") or []
    if instances and all("live" in r for r in instances):  # the pool size, as it changes
        rollout_text += f" | raas {sum(1 for r in instances if r['live'])}"
    failed = agents_failed(pol) or {}
    if sum(failed.values()):  # an agent workflow whose agents raised or timed out
        rollout_text += (f" | agents failed {sum(failed.values())} ("
                         + ", ".join(f"{k} {n}" for k, n in failed.items() if n) + ")")
    return (f"[{elapsed:6.0f}s] version {version}{'' if target is None else f'/{target}'}"
            f"{' | ' + rate_text if rate_text else ''}"
            f" | trained {trained}{rollout_text}"
            f" | accepted {pol.get('samples_accepted', 0)}"
            f" | queued {pol.get('queue_depth', 0)}"
            f" | stale {pol.get('stale_dropped', 0)}{eval_text}")


__all__ = ["duration", "ProgressRate", "progress_line"]
