"""The real dataflow service over HTTP: the synchronous mode's rounds, and routing of several
policies' samples (each trainer receives only its own)."""

from __future__ import annotations

import numpy as np
import pytest

from astralight.protocol import Sample
from tests.integration.service_helpers import make_samples, model_stats, publish_version


def test_sync_mode_runs_rounds_of_exactly_one_batch_per_version(tmp_path, dataflow_service,
                                                                client_for):
    url, _, _ = dataflow_service(tmp_path, mode="sync", sync_batch_size=8, group_size=4,
                                 max_staleness=0, sample_filters=["zero_advantage"])
    c = client_for(url)
    iid = c.register(["policy"], 16)["instance_id"]
    tasks = c.lease(iid, 16)
    assert len(tasks) == 2 and all(t.min_versions == {"policy": 0} for t in tasks)
    assert c.lease(iid, 16) == []  # the round's tasks are out
    c.push(iid, tasks[0].task_id, make_samples(tasks[0], [1, 0, 1, 0]))
    c.push(iid, tasks[1].task_id, make_samples(tasks[1], [1, 1, 1, 1]))  # filtered: top up
    [extra] = c.lease(iid, 16)
    assert extra.min_versions == {"policy": 0}
    c.push(iid, extra.task_id, make_samples(extra, [0, 1, 0, 0]))
    assert c.lease(iid, 16) == []
    batch = c.pull_batch("policy", 8, timeout_s=1)
    assert batch is not None and {s.min_version for s in batch.samples} == {0}
    c.ack(batch.batch_id)
    assert c.lease(iid, 16) == []  # the trainer has not published the next version yet
    publish_version(c, 1)
    late = c.lease(iid, 16)
    assert len(late) == 2 and all(t.min_versions == {"policy": 1} for t in late)
    # a sample of round 0 arriving in round 1 is never trained on
    c.push(iid, late[0].task_id, make_samples(late[0], [1, 0, 1, 0], version=0))
    s = model_stats(c)
    assert s["stale_dropped"] == 4 and s["queue_depth"] == 0
    assert len(c.lease(iid, 16)) == 1  # the dropped group is replaced


def _samples_two_policies(task, solver_rewards, verifier_rewards) -> list[Sample]:
    solver = make_samples(task, solver_rewards, model_id="solver")
    verifier = make_samples(task, verifier_rewards, model_id="verifier")
    for s in solver:
        s.role = "solver"
    for s in verifier:
        s.role = "verifier"
        s.token_ids = np.full_like(s.token_ids, 7)  # recognisable
    return solver + verifier


def test_each_trainer_receives_only_its_policys_samples(tmp_path, dataflow_service, client_for):
    url, _, _ = dataflow_service(tmp_path, model_ids=["solver", "verifier"], group_size=2,
                                 max_staleness=4)
    c = client_for(url)
    iid = c.register(["solver", "verifier"], 8)["instance_id"]
    for t in c.lease(iid, 4):
        assert t.model_ids == ["solver", "verifier"]
        c.push(iid, t.task_id, _samples_two_policies(t, [1, 0], [0, 1]))
    vb = c.pull_batch("verifier", 8, timeout_s=1)
    sb = c.pull_batch("solver", 8, timeout_s=1)
    assert {s.model_id for s in vb.samples} == {"verifier"} and {s.role for s in vb.samples} == {"verifier"}
    assert all((s.token_ids == 7).all() for s in vb.samples)
    assert {s.model_id for s in sb.samples} == {"solver"}
    # group statistics per (task, model_id, role)
    assert all(abs(s.advantage) == pytest.approx(1.0, abs=1e-3) for s in vb.samples + sb.samples)
    # per-policy versions and weight streams: publishing the solver does not move the verifier
    publish_version(c, 1, payload=b"solver v1", model_id="solver")
    publish_version(c, 2, payload=b"solver v2", model_id="solver")
    assert (c.current_version("solver"), c.current_version("verifier")) == (2, 0)
    assert c.latest_manifest("verifier") is None
    assert c.download_weight_file("solver", 2, "model.safetensors") == b"solver v2"
    publish_version(c, 1, payload=b"verifier v1", model_id="verifier")
    assert c.download_weight_file("verifier", 1, "model.safetensors") == b"verifier v1"


def test_acks_carry_trainer_timings_into_the_balance_report(tmp_path, dataflow_service,
                                                            client_for):
    url, _, _ = dataflow_service(tmp_path, group_size=4, max_staleness=4)
    c = client_for(url)
    iid = c.register(["policy"], 8)["instance_id"]
    for t in c.lease(iid, 4):
        c.push(iid, t.task_id, make_samples(t, [1, 0, 1, 0]))
    for _ in range(2):
        batch = c.pull_batch("policy", 8, timeout_s=1)
        c.ack(batch.batch_id, wait_s=0.5, step_s=2.0)
    publish_version(c, 1)
    report = c.balance("policy", window=1, pool=4)
    assert report["versions"] == [0, 0] and report["live_instances"] == 1
    assert report["wait_fraction"] == pytest.approx(0.25)
    assert (report["accepted"], report["consumed"]) == (16, 16)
    assert report["decision"]["action"] == "scale_up" and report["decision"]["target"] == 6
    with pytest.raises(Exception, match="wait_s"):
        c.ack(batch.batch_id, wait_s=-1.0, step_s=1.0)
