"""The dataflow core with data plugins, in process on a real SQLite file: config checks, the
curator safety valve, per-policy queue orders, replay-pool and plugin-state restore."""

from __future__ import annotations

import logging

import pytest
import yaml

from astralight.dataflow.config import DataflowConfig, build_plugins, parse_config
from astralight.dataflow.core import Dataflow
from astralight.dataflow.curators import GRESO, PromptCurator
from astralight.dataflow.queues import Edf, Fifo
from tests.unit.dataflow_fakes import publish
from tests.unit.dataflow_fakes import samples as _samples


def samples(task, rewards, model_id="policy", version=0):
    return _samples(task, rewards, version, model_id)


class RejectAll(PromptCurator):
    """Rejects every prompt: only the service's safety valve lets tasks through."""

    def should_submit(self, prompt, version: int) -> bool:
        return False


def make(tmp_path, **kw) -> Dataflow:
    return Dataflow(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2, **kw))


def test_bad_plugin_config_names_the_field():
    with pytest.raises(ValueError, match=r"curators\[0\].*gresoo"):
        DataflowConfig(curators=["gresoo"])
    with pytest.raises(ValueError, match=r"replay\.ratio"):
        DataflowConfig(replay={"ratio": 1.0})
    with pytest.raises(ValueError, match=r"queue_order.*\['verifier'\]"):
        DataflowConfig(model_ids=["solver"], queue_order={"verifier": "edf"})
    with pytest.raises(ValueError, match=r"sample_filters\[1\]"):
        DataflowConfig(sample_filters=["zero_advantage", {"init_args": {}}])
    cfg = DataflowConfig(curators=[{"class_path": "greso", "init_args": {"p_easy": 7}}])
    with pytest.raises(ValueError, match=r"curators\[0\].*p_easy"):
        build_plugins(cfg)


def test_yaml_config_with_every_plugin_kind_parses(tmp_path):
    path = tmp_path / "dataflow.yaml"
    path.write_text(yaml.safe_dump({
        "model_ids": ["solver", "verifier"],
        "queue_order": {"solver": ["edf", "fifo"]},
        "curators": [{"class_path": "greso", "init_args": {"p_easy": 0.6}}, "filter_solved"],
        "sample_filters": ["zero_advantage", {"class_path": "length",
                                              "init_args": {"max_completion_tokens": 8}}],
        "replay": {"ratio": 0.3, "selectors": ["high_variance", "uniform"]}}))
    cfg = parse_config(["--config", str(path)])
    plugins = build_plugins(cfg)
    assert isinstance(plugins["curators"][0], GRESO) and plugins["curators"][0].metrics()["p_easy"] == 0.6
    assert [type(o) for o in plugins["queue_order"]["solver"]] == [Edf, Fifo]
    assert [type(o) for o in plugins["queue_order"]["verifier"]] == [Fifo]
    assert [type(s).__name__ for s in plugins["replay.selectors"]] == ["HighVariance", "Uniform"]


def test_safety_valve_forces_a_prompt_after_max_skips(tmp_path):
    flow = make(tmp_path, curator_max_skips=5,
                curators=[{"class_path": f"{__name__}.RejectAll"}])
    iid = flow.register(["policy"], 4, None, {})["instance_id"]
    tasks = flow.lease(iid, 3)
    assert len(tasks) == 3
    s = flow.stats()["models"]["policy"]
    assert (s["prompts_skipped"], s["prompts_forced"], s["prompts_submitted"]) == (15, 3, 3)
    # the source moved past every skipped prompt: task ids are the source positions
    assert [t.task_id for t in tasks] == ["train:5", "train:11", "train:17"]
    flow.close()


def test_plugin_state_and_replay_pool_come_back_after_restart(tmp_path, caplog):
    cfg = dict(curators=["greso"], replay={"ratio": 0.5, "pool_size": 8, "max_staleness": 4},
               max_staleness=4)
    flow = make(tmp_path, **cfg)
    iid = flow.register(["policy"], 8, None, {})["instance_id"]
    for t in flow.lease(iid, 4):
        flow.push(iid, t.task_id, samples(t, [1, 1]))
    for t in flow.lease(iid, 2):
        flow.push(iid, t.task_id, samples(t, [1, 0]))
    batch = flow.pull("policy", 4)
    flow.ack(batch.batch_id)
    assert len(flow.replay_pools["policy"]) == 4
    publish(flow, 1)
    greso = flow.curators[0]
    state, rng_state = greso.state_dict(), greso.rng.bit_generator.state
    flow.close()

    again = make(tmp_path, **cfg)
    assert again.curators[0].state_dict() == state
    assert again.curators[0].rng.bit_generator.state == rng_state
    assert [e.sample_id for e in again.replay_pools["policy"].entries()] == \
        [e.sample_id for e in flow.replay_pools["policy"].entries()]
    again.close()

    # a config naming another class for the same place starts it fresh, with a warning
    with caplog.at_level(logging.WARNING, logger="astralight.dataflow"):
        third = make(tmp_path, **{**cfg, "curators": ["filter_solved"]})
    assert "starting it fresh" in caplog.text
    assert third.curators[0].state_dict() == {"ewma": {}}
    third.close()


def test_filtered_groups_are_stored_counted_and_outcomes_reach_curators(tmp_path):
    flow = make(tmp_path, curators=["greso"], sample_filters=["zero_advantage"])
    iid = flow.register(["policy"], 8, None, {})["instance_id"]
    t1, t2 = flow.lease(iid, 2)
    assert flow.push(iid, t1.task_id, samples(t1, [1, 1]))["filtered"] == 2
    assert flow.push(iid, t2.task_id, samples(t2, [0, 1]))["accepted"] == 2
    rows = flow.store.conn.execute("SELECT state, COUNT(*) FROM samples GROUP BY state").fetchall()
    assert dict((r[0], r[1]) for r in rows) == {"filtered": 2, "queued": 2}
    assert flow.curators[0].metrics()["easy_streaks"] == 1  # the filtered group still taught GRESO
    per_version = flow.version_counters("policy")
    assert per_version[0]["rollouts_generated"] == 4 and per_version[0]["groups_filtered"] == 1
    flow.close()


def test_instance_status_and_throughput_share_in_stats_and_balance(tmp_path):
    flow = make(tmp_path, lease_seconds=10.0)
    a = flow.register(["policy"], 4, "a", {})["instance_id"]
    b = flow.register(["policy"], 4, "b", {})["instance_id"]
    c = flow.register(["policy"], 4, "c", {})["instance_id"]
    for t in flow.lease(a, 3):
        flow.push(a, t.task_id, samples(t, [1, 0]))
    [t] = flow.lease(b, 1)
    flow.push(b, t.task_id, samples(t, [1, 0]))
    now = __import__("time").time()
    with flow.store.tx():  # b missed its heartbeats, c went silent a lease period ago
        flow.store.touch_instance(b, now - 7.0)
        flow.store.touch_instance(c, now - 11.0)
    table = {r["instance_id"]: r for r in flow.stats()["instances"]}
    assert {i: r["status"] for i, r in table.items()} == {"a": "healthy", "b": "suspect",
                                                         "c": "gone"}
    assert (table["a"]["throughput_share"], table["b"]["throughput_share"]) == (0.75, 0.25)
    report = flow.balance("policy", window=1)
    assert report["live_instances"] == 2 and report["decision"]["pool"] == 2
    assert [r["instance_id"] for r in report["instances"]] == ["a", "b", "c"]
    flow.close()


@pytest.mark.parametrize("scale,expected", [("std", [1.0, -1.0]), ("none", [0.5, -0.5])])
def test_advantage_scale_sets_the_served_advantages(tmp_path, scale, expected):
    """``advantage_scale: none`` (Dr. GRPO) serves ``r - mean``; ``std`` (GRPO) divides by
    the group's std; a bad value names the field."""
    flow = make(tmp_path, advantage_scale=scale)
    iid = flow.register(["policy"], 8, None, {})["instance_id"]
    [task] = flow.lease(iid, 1)
    flow.push(iid, task.task_id, samples(task, [1, 0]))
    batch = flow.pull("policy", 2)
    assert [round(s.advantage, 4) for s in batch.samples] == expected
    flow.close()
    with pytest.raises(ValueError, match="advantage_scale: must be 'std'"):
        DataflowConfig(advantage_scale="mean")


def test_failed_group_advantage_is_served_on_groups_in_which_all_failed(tmp_path):
    """``failed_group_advantage``: every sample of an all-failed group is served with it (GRPO
    would serve 0); mixed and all-correct groups keep GRPO's; a positive or NaN value is
    refused naming the field."""
    flow = make(tmp_path, failed_group_advantage=-0.2)
    iid = flow.register(["policy"], 8, None, {})["instance_id"]
    for rewards in ([0, 0], [1, 1], [1, 0]):
        [task] = flow.lease(iid, 1)
        flow.push(iid, task.task_id, samples(task, rewards))
    batch = flow.pull("policy", 6)
    assert [round(s.advantage, 4) for s in batch.samples] == [-0.2, -0.2, 0.0, 0.0, 1.0, -1.0]
    flow.close()
    for bad in (0.1, float("nan"), -1.5):
        with pytest.raises(ValueError, match="failed_group_advantage: must be in"):
            DataflowConfig(failed_group_advantage=bad)
