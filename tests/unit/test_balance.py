"""The balance report's three-zone decision and window sums, on hand-made windows."""

from __future__ import annotations

import pytest

from astralight.dataflow.balance import decide, window_report


def test_scale_up_when_the_trainer_starves():
    d = decide(pool=4, wait_fraction=0.5, consumed=100, accepted=100)
    assert (d.action, d.target) == ("scale_up", 8)  # ceil(4 / (1 - 0.5))
    assert decide(pool=3, wait_fraction=0.11, consumed=1, accepted=1).target == 4  # ceil(3.37)


def test_scale_down_when_rollout_overproduces():
    d = decide(pool=10, wait_fraction=0.01, consumed=500, accepted=1000)
    assert (d.action, d.target) == ("scale_down", 6)  # ceil(10 * 0.5 * 1.1) = ceil(5.5)
    # never above G, and no move without both counts
    assert decide(pool=10, wait_fraction=0.0, consumed=1000, accepted=1000).action == "hold"
    assert decide(pool=10, wait_fraction=0.0, consumed=0, accepted=1000).action == "hold"
    assert decide(pool=10, wait_fraction=0.0, consumed=5, accepted=0).action == "hold"


def test_hold_inside_the_band_and_bad_thresholds():
    for w in (0.05, 0.07, 0.10):
        d = decide(pool=5, wait_fraction=w, consumed=10, accepted=100)
        assert (d.action, d.target) == ("hold", 5)
    with pytest.raises(ValueError, match="tau_low"):
        decide(pool=5, wait_fraction=0.0, consumed=1, accepted=1, tau_low=0.2, tau_high=0.1)
    with pytest.raises(ValueError, match="pool"):
        decide(pool=-1, wait_fraction=0.0, consumed=1, accepted=1)


def test_window_report_sums_the_versions_of_the_window():
    per_version = {
        3: {"rollouts_generated": 999, "trainer_wait_ms": 10_000, "trainer_step_ms": 10_000},
        4: {"rollouts_generated": 600, "samples_accepted": 500, "samples_trained": 256,
            "stale_dropped": 40, "trainer_wait_ms": 300, "trainer_step_ms": 2000,
            "trainer_steps_timed": 2},
        5: {"rollouts_generated": 400, "samples_accepted": 300, "samples_trained": 256,
            "trainer_wait_ms": 100, "trainer_step_ms": 2000, "trainer_steps_timed": 2},
    }
    r = window_report(per_version, 4, 5, pool=2)
    assert r["versions"] == [4, 5]
    assert (r["produced"], r["accepted"], r["consumed"], r["stale"]) == (1000, 800, 512, 40)
    assert r["wait_fraction"] == pytest.approx(0.1)  # 0.4 s of 4 s
    assert (r["mean_step_s"], r["mean_wait_s"]) == (1.0, 0.1)
    assert r["decision"]["action"] == "hold"
    starving = window_report(per_version, 3, 3, pool=2)
    assert starving["decision"]["action"] == "scale_up" and starving["decision"]["target"] == 200
    with pytest.raises(ValueError, match="window"):
        window_report(per_version, 5, 4, pool=2)
