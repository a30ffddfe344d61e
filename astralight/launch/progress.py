"""The launcher's progress line: where the run is, how fast it goes and when it will end.

``[   120s] version 40/150 | 2.1 s/version, ETA 3m51s | trained 10240 | rollouts ... | eval v0
21.0% -> v40 63.5%``. The rate (:class:`ProgressRate`) is measured from the first publication
this launch saw, so the start-up (prepare, vLLM, the first batch) does not distort it; the ETA
is the versions left at that rate, or the ``stop.max_wall_s`` budget left when that comes first.
"""

from __future__ import annotations

from astralight.launch.summary import policy_stats


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

    def text(self, now: float, version: int, target: int, budget_end: float | None = None) -> str:
        """``2.1 s/version, ETA 3m51s`` (``versions/s`` when faster than one a second);
        ``ETA ... (max_wall_s)`` when the time budget ends the run first."""
        rate = self.per_second()
        if rate is None:
            return "rate --"
        speed = f"{rate:.1f} versions/s" if rate >= 1 else f"{1 / rate:.1f} s/version"
        eta = max(target - version, 0) / rate
        if budget_end is not None and budget_end - now < eta:
            return f"{speed}, ETA {duration(budget_end - now)} (max_wall_s)"
        return f"{speed}, ETA {duration(eta)}"


def progress_line(elapsed: float, target: int, stats: dict, evals: dict[int, dict],
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
    return (f"[{elapsed:6.0f}s] version {version}/{target}"
            f"{' | ' + rate_text if rate_text else ''}"
            f" | trained {trained}{rollout_text}"
            f" | accepted {pol.get('samples_accepted', 0)}"
            f" | queued {pol.get('queue_depth', 0)}"
            f" | stale {pol.get('stale_dropped', 0)}{eval_text}")


__all__ = ["duration", "ProgressRate", "progress_line"]
