"""The launcher's progress line: a rate (versions/s or s/version, measured from the first
publication seen) and an ETA (to stop.versions, or the stop.max_wall_s budget if sooner)."""

from __future__ import annotations

from astralight.launch.progress import ProgressRate, duration, progress_line


def test_duration():
    assert [duration(s) for s in (0, 42.4, 250, 3900)] == ["0s", "42s", "4m10s", "1h05m"]


def test_rate_from_the_first_publication_and_eta():
    rate = ProgressRate()
    rate.update(0.0, 0)
    rate.update(100.0, 0)  # start-up: no publication yet
    assert rate.per_second() is None and rate.text(100.0, 0, 150) == "rate --"
    rate.update(110.0, 1)
    rate.update(130.0, 11)
    assert rate.per_second() == 0.5
    assert rate.text(130.0, 11, 150) == "2.0 s/version, ETA 4m38s"  # 139 versions x 2 s
    rate.update(132.0, 31)
    assert rate.text(132.0, 31, 150).startswith("1.4 versions/s")
    # a time budget that ends the run first
    assert rate.text(132.0, 31, 150, {"max_wall_s": 160.0}) == \
        "1.4 versions/s, ETA 28s (max_wall_s)"
    # the trainer's max_time ending before both: named as such
    assert rate.text(132.0, 31, 150, {"max_wall_s": 160.0, "max_time": 150.0}) == \
        "1.4 versions/s, ETA 18s (max_time)"
    # budgets that end later than the versions leave the versions' ETA
    assert rate.text(132.0, 31, 150, {"max_wall_s": 9999.0, "max_time": None}) == \
        "1.4 versions/s, ETA 1m27s"  # 119 versions at 30/22 per second


def test_a_time_only_run_has_no_target_and_its_budgets_eta_from_the_start():
    rate = ProgressRate()
    rate.update(0.0, 0)
    # before any publication: the budget's ETA alone, not 'rate --' and not a placeholder target
    assert rate.text(100.0, 0, None, {"max_wall_s": 700.0}) == "rate --, ETA 10m00s (max_wall_s)"
    assert rate.text(100.0, 0, None) == "rate --"
    rate.update(110.0, 1)
    rate.update(130.0, 11)
    assert rate.text(130.0, 11, None, {"max_wall_s": 700.0, "max_time": 3730.0}) == \
        "2.0 s/version, ETA 9m30s (max_wall_s)"
    assert rate.text(130.0, 11, None, {}) == "2.0 s/version"
    stats = {"models": {"policy": {"current_version": 40}}}
    line = progress_line(120.0, None, stats, {}, "policy", "2.1 s/version")
    assert line.startswith("[   120s] version 40 | 2.1 s/version | trained 0")


def test_a_resumed_run_measures_from_its_own_first_publication():
    rate = ProgressRate()
    rate.update(0.0, 90)
    rate.update(10.0, 91)
    rate.update(20.0, 101)
    assert rate.per_second() == 1.0


def test_the_progress_line_shows_the_rate():
    stats = {"models": {"policy": {"current_version": 40, "samples_trained": 10240,
                                   "samples_accepted": 11000, "queue_depth": 12,
                                   "stale_dropped": 3}}}
    evals = {0: {"complete": True, "avg_at_k": 0.21}, 40: {"complete": True, "avg_at_k": 0.635}}
    line = progress_line(120.0, 150, stats, evals, "policy", "2.1 s/version, ETA 3m51s")
    assert line == ("[   120s] version 40/150 | 2.1 s/version, ETA 3m51s | trained 10240"
                    " | accepted 11000 | queued 12 | stale 3 | eval v0 21.0% -> v40 63.5%")


def test_failed_agents_are_shown_by_kind_once_there_are_any():
    stats = {"models": {"policy": {"current_version": 5, "agent_episodes": 40,
                                   "agent_failed_error": 0, "agent_failed_timeout": 0}}}
    assert "agents failed" not in progress_line(10.0, 10, stats, {}, "policy")
    stats["models"]["policy"].update(agent_failed_error=7, agent_failed_timeout=2)
    line = progress_line(10.0, 10, stats, {}, "policy")
    assert " | agents failed 9 (error 7, timeout 2) | " in line
