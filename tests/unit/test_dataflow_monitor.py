"""DataflowMonitor logs the dataflow's eval results, counters and data-plugin gauges.

A fake client stands in for the dataflow service (the real route is covered by the integration
tests); the trainer is a stand-in with a recording logger, so no fit is run.
"""

from __future__ import annotations

from astralight.callbacks.dataflow_monitor import plugin_metrics, stat_metrics
from tests.fakes import BalanceClient
from tests.unit.monitor_fakes import monitor_with


STATS = {
    "models": {
        "policy": {
            "current_version": 7, "samples_accepted": 96, "stale_dropped": 3, "samples_acked": 64,
            "queue_depth": 32, "rollouts_generated": 160, "prompts_skipped": 11, "prompts_forced": 1,
            "groups_filtered": 8, "samples_filtered": 64, "replay_served": 40, "replay_evicted": 2,
            "replay_stale_dropped": 5, "samples_trained": 104, "weight_oldest_version": None,
        },
        "other": {"rollouts_generated": 999},
    },
    "plugins": {
        "curators[0]": {"class": "GRESO", "metrics": {"p_easy": 0.49, "p_hard": 0.51,
                                                      "note": "not a number"}},
        "sample_filters[0]": {"class": "ZeroAdvantage", "metrics": {}},
        "replay.selectors[0]": {"class": "Uniform", "metrics": {"pool size": 12}},
    },
}


def test_poll_logs_data_algorithm_counters_and_plugin_gauges():
    monitor, trainer = monitor_with(STATS)
    monitor.poll(trainer)
    logged = trainer.logger.merged()
    for key in ("rollouts_generated", "prompts_skipped", "prompts_forced", "groups_filtered",
                "samples_filtered", "replay_served", "replay_evicted", "replay_stale_dropped",
                "samples_trained", "samples_accepted", "stale_dropped", "current_version"):
        assert logged[f"dataflow/{key}"] == float(STATS["models"]["policy"][key]), key
    # this trainer's policy only, not another model_id's counters
    assert logged["dataflow/rollouts_generated"] == 160.0
    assert logged["dataflow/plugins/curators_0_GRESO/p_easy"] == 0.49
    assert logged["dataflow/plugins/curators_0_GRESO/p_hard"] == 0.51
    assert logged["dataflow/plugins/replay.selectors_0_Uniform/pool_size"] == 12.0
    # non-numeric values are not logged
    assert not any(k.endswith("/note") or "weight_oldest_version" in k for k in logged)
    assert all(step == 14 for _, step in trainer.logger.calls)


def test_poll_without_plugins_or_new_counters_still_logs_the_old_ones():
    """An older dataflow (no ``plugins``, no data-algorithm counters) is still monitored."""
    stats = {"models": {"policy": {"samples_accepted": 5, "current_version": 1}}}
    monitor, trainer = monitor_with(stats)
    monitor.poll(trainer)
    assert trainer.logger.merged() == {"dataflow/samples_accepted": 5.0,
                                       "dataflow/current_version": 1.0}


def test_eval_results_logged_once_at_the_version_step():
    evals = {4: {"complete": True, "avg_at_k": 0.5, "pass_at_k": 0.75},
             6: {"complete": False, "avg_at_k": 0.0, "pass_at_k": 0.0}}
    monitor, trainer = monitor_with({"models": {}}, evals)
    monitor.poll(trainer)
    monitor.poll(trainer)
    eval_calls = [(m, s) for m, s in trainer.logger.calls if "eval/avg_at_k" in m]
    assert eval_calls == [({"eval/avg_at_k": 0.5, "eval/pass_at_k": 0.75, "eval/version": 4.0}, 8)]


def test_every_logger_gets_the_eval_and_the_counters():
    """TensorBoard plus W&B: both get eval/* and the counters (the monitor logged to
    ``trainer.logger``, the first one, only)."""
    evals = {4: {"complete": True, "avg_at_k": 0.5, "pass_at_k": 0.75}}
    monitor, trainer = monitor_with(STATS, evals, n_loggers=2)
    monitor.poll(trainer)
    first, second = trainer.loggers
    assert first.calls and first.calls == second.calls
    assert second.merged()["eval/avg_at_k"] == 0.5
    assert second.merged()["dataflow/samples_accepted"] == 96.0


def test_tag_names_are_tensorboard_friendly():
    assert stat_metrics({"groups_filtered": 3, "unknown_key": 1}) == {"dataflow/groups_filtered": 3.0}
    out = plugin_metrics({"curators[1]": {"class": "my.pkg.Curator", "metrics": {"p/x y": 1}}})
    assert out == {"dataflow/plugins/curators_1_my.pkg.Curator/p_x_y": 1.0}
    assert plugin_metrics(None) == {}


def test_balance_report_is_logged_every_balance_every_versions():
    stats = {"models": {"policy": {"current_version": 12}}}
    monitor, trainer = monitor_with(stats)
    monitor.client = BalanceClient(stats)
    monitor.poll(trainer)
    logged = trainer.logger.merged()
    assert logged["balance/wait_fraction"] == 0.25 and logged["balance/target"] == 6.0
    assert logged["balance/action"] == 1.0 and logged["balance/pool"] == 4.0
    assert monitor.client.calls == [("policy", 10)]
    monitor.poll(trainer)  # same version: not again
    assert len(monitor.client.calls) == 1
    # a service without the route: a warning, then no more tries, the rest still logged
    monitor2, trainer2 = monitor_with(stats)
    monitor2.poll(trainer2)
    assert monitor2.balance_every == 0 and "dataflow/current_version" in trainer2.logger.merged()
