"""The balance report's three-zone decision, window sums, wall time, eval time and rates, on
hand-made windows."""

from __future__ import annotations

import pytest

from astralight.dataflow.balance import decide, window_report, window_wall_s


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


def test_window_wall_time_runs_from_the_first_version_to_the_next_publication():
    published = {1: 110.0, 2: 130.0, 3: 170.0, 5: 250.0}  # version 4 was skipped
    assert window_wall_s(published, 0, 0, started_at=100.0, now=999.0) == 10.0  # start -> v1
    assert window_wall_s(published, 1, 2, started_at=100.0, now=999.0) == 60.0  # v1 -> v3
    assert window_wall_s(published, 4, 4, started_at=100.0, now=999.0) == 80.0  # from v3 to v5
    assert window_wall_s(published, 3, 4, started_at=100.0, now=999.0) == 80.0
    assert window_wall_s(published, 5, 5, started_at=100.0, now=262.5) == 12.5  # still open: now
    assert window_wall_s({}, 0, 0, started_at=100.0, now=103.0) == 3.0
    # weight GC forgot v1's manifest, but the time of v2 is kept: the window starts there
    assert window_wall_s({2: 130.0, 3: 170.0}, 2, 2, started_at=100.0, now=999.0) == 40.0


def test_window_report_wall_eval_rates_and_throughput_per_capacity_unit():
    per_version = {
        6: {"rollouts_generated": 300, "samples_accepted": 240, "samples_trained": 200,
            "stale_dropped": 20, "eval_task_ms": 1500, "trainer_wait_ms": 500,
            "trainer_step_ms": 10_000, "trainer_steps_timed": 4},
        7: {"rollouts_generated": 100, "samples_accepted": 80, "samples_trained": 200,
            "eval_task_ms": 2500, "trainer_wait_ms": 500, "trainer_step_ms": 10_000,
            "trainer_steps_timed": 4},
        8: {"eval_task_ms": 99_000},  # outside the window
    }
    r = window_report(per_version, 6, 7, pool=4, wall_s=20.0, capacity_units=2.5)
    assert (r["wall_s"], r["eval_s"]) == (20.0, 4.0)
    assert (r["produced"], r["accepted"], r["consumed"], r["stale"]) == (400, 320, 400, 20)
    assert r["rates"] == {"produced": 20.0, "accepted": 16.0, "consumed": 20.0, "stale": 1.0}
    assert r["capacity_units"] == 2.5
    assert r["throughput_per_capacity_unit"] == 8.0  # 400 / 20 s / 2.5 units
    assert r["wait_fraction"] == pytest.approx(0.05) and r["mean_step_s"] == 2.5
    # w = 0.05 is not below tau_low: hold (and consumed >= accepted would not scale down anyway)
    assert r["decision"] == {"action": "hold", "pool": 4, "target": 4,
                             "reason": r["decision"]["reason"]}
    # without a wall time or capacity the derived figures are None, never a division by zero
    bare = window_report(per_version, 6, 7, pool=4)
    assert bare["wall_s"] is None and set(bare["rates"].values()) == {None}
    assert bare["throughput_per_capacity_unit"] is None
    assert window_report(per_version, 6, 7, pool=4, wall_s=20.0,
                         capacity_units=0.0)["throughput_per_capacity_unit"] is None
    assert window_report(per_version, 6, 7, pool=4, wall_s=0.0)["rates"]["produced"] is None


def test_window_report_scales_down_on_overproduction_with_the_new_fields():
    per_version = {3: {"rollouts_generated": 1000, "samples_accepted": 1000,
                       "samples_trained": 250, "trainer_wait_ms": 0, "trainer_step_ms": 5000,
                       "trainer_steps_timed": 5}}
    r = window_report(per_version, 3, 3, pool=8, wall_s=50.0, capacity_units=8.0)
    assert r["decision"]["action"] == "scale_down"
    assert r["decision"]["target"] == 3  # ceil(8 * 250/1000 * 1.1) = ceil(2.2)
    assert r["throughput_per_capacity_unit"] == 2.5 and r["eval_s"] == 0.0


def test_the_new_report_fields_become_balance_scalars():
    from astralight.callbacks.dataflow_monitor import balance_metrics

    r = window_report({0: {"rollouts_generated": 40, "eval_task_ms": 2000}}, 0, 0, pool=1,
                      wall_s=10.0, capacity_units=2.0)
    out = balance_metrics(r)
    assert (out["balance/wall_s"], out["balance/eval_s"]) == (10.0, 2.0)
    assert out["balance/throughput_per_capacity_unit"] == 2.0
    assert "balance/wall_s" not in balance_metrics(window_report({}, 0, 0, pool=1))  # None: skipped


def test_scale_up_target_is_not_inflated_by_float_rounding():
    # 1 / (1 - 0.9) = 10.000000000000002 in floating point: the target must be 10, not 11
    assert decide(1, 0.9, 0, 0).target == 10
    assert decide(3, 0.5, 0, 0).target == 6


def test_agent_counts_and_weight_pauses_reach_the_report_and_the_scalars():
    from astralight.callbacks.dataflow_monitor import balance_metrics

    per_version = {0: {"agent_episodes": 6, "tool_episodes": 3, "tool_calls": 4,
                       "tool_errors_timeout": 1},
                   1: {"agent_episodes": 2, "tool_episodes": 1, "tool_calls": 2,
                       "tool_errors_malformed": 2}}
    r = window_report(per_version, 0, 1, pool=1)
    assert r["agent"]["episodes"] == 8 and r["agent"]["tool_call_rate"] == 0.5
    assert r["agent"]["tool_calls_per_episode"] == 0.75
    assert r["agent"]["tool_errors"]["timeout"] == 1 and r["agent"]["tool_errors"]["malformed"] == 2
    assert "agent" not in window_report({0: {"rollouts_generated": 4}}, 0, 0, pool=1)
    r["weight_pause_s"] = 1.5  # added by the service from the instances' heartbeats
    out = balance_metrics(r)
    assert out["raas/weight_pause_s"] == 1.5
    assert out["balance/agent/tool_call_rate"] == 0.5
    assert out["balance/agent/tool_errors/malformed"] == 2.0
