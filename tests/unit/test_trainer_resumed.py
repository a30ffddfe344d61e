"""Acks undone by a trainer's restart from an older checkpoint are counted as rolled back.

A trainer killed after acking batches past its last checkpoint resumes from that checkpoint: the
training of those batches was lost with the crash. The resumed datamodule reports the
checkpoint's step (``POST /v1/trainer/resumed``) and the dataflow marks exactly the batches acked
after it (``batches_rolled_back`` / ``samples_rolled_back``), so the audit can say how much
training a restart cost. These tests use a real SQLite store, the real app in-process and the
real audit; the datamodule test substitutes a recording client.
"""

from __future__ import annotations

from fastapi.testclient import TestClient

from astralight.dataflow.app import create_app
from astralight.dataflow.audit import audit
from astralight.datamodules.rollout import RolloutDataModule
from astralight.protocol import decode, encode
from astralight.dataflow.config import DataflowConfig
from tests.fakes import RecordingClient
from tests.unit.batch_ack_flow import GROUP, TIMEOUT, make, samples


def trained_batches(flow, steps):
    """Serve and ack one batch per step in ``steps`` (None: an ack without a step)."""
    iid = flow.register(["policy"], capacity=64, instance_id="raas-a", meta={})["instance_id"]
    ids = []
    for step in steps:
        (task,) = flow.lease(iid, 1)
        flow.push(iid, task.task_id, samples(task))
        batch = flow.pull("policy", GROUP, trainer_id="trainer-0")
        flow.ack(batch.batch_id, step=step)
        ids.append(batch.batch_id)
    return ids


def test_acks_after_the_checkpoint_step_are_rolled_back_once(tmp_path):
    flow = make(tmp_path)
    ids = trained_batches(flow, [1, 2, 3, None])
    answer = flow.trainer_resumed("policy", 1)
    assert answer == {"model_id": "policy", "step": 1, "batches_rolled_back": 2,
                      "samples_rolled_back": 2 * GROUP}
    marked = [b for b in ids if flow.store.batch(b)["rolled_back_at"] is not None]
    assert marked == ids[1:3]  # steps 2 and 3; the ack without a step is never marked
    assert all(flow.store.batch(b)["state"] == "acked" for b in ids)  # nothing re-served
    assert flow.trainer_resumed("policy", 1)["batches_rolled_back"] == 0  # idempotent
    stats = flow.stats()["models"]["policy"]
    assert stats["batches_rolled_back"] == 2 and stats["samples_rolled_back"] == 2 * GROUP
    flow.close()

    report = audit(tmp_path / "state" / "dataflow.db")
    assert report["balanced"] and report["mismatches"] == []
    assert report["batches_rolled_back"] == 2 and report["samples_rolled_back"] == 2 * GROUP
    assert report["samples_trained"] == 4 * GROUP  # still trained: those versions were served


def test_audit_flags_a_marked_batch_the_counter_missed(tmp_path):
    flow = make(tmp_path)
    ids = trained_batches(flow, [1, 2])
    with flow.store.tx():  # a mark without its counter: the two ledgers disagree
        flow.store.conn.execute("UPDATE batches SET rolled_back_at=1.0 WHERE batch_id=?", (ids[1],))
    flow.close()
    report = audit(tmp_path / "state" / "dataflow.db")
    assert not report["balanced"]
    assert any("samples_rolled_back" in m for m in report["mismatches"])


def test_the_route_validates_and_answers(tmp_path):
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=GROUP,
                                    batch_ack_timeout_s=TIMEOUT), token="")
    with TestClient(app, base_url="http://127.0.0.1") as http:  # no token: a loopback Host
        trained_batches(app.state.dataflow, [1, 2])
        def post(body):
            return http.post("/v1/trainer/resumed", content=encode(body),
                             headers={"Content-Type": "application/msgpack"})

        ok = post({"model_id": "policy", "step": 1})
        assert ok.status_code == 200 and decode(ok.content)["batches_rolled_back"] == 1
        assert post({"model_id": "nobody", "step": 1}).status_code == 404
        assert post({"model_id": "policy", "step": -1}).status_code == 422
        assert post({"model_id": "policy", "step": "1"}).status_code == 422
        assert post({"model_id": "policy"}).status_code == 422
        assert post({"model_id": "policy", "step": 1, "extra": 1}).status_code == 422
        bad_ack = http.post("/v1/ack", content=encode({"batch_id": "x", "step": -3}),
                            headers={"Content-Type": "application/msgpack"})
        assert bad_ack.status_code == 422 and bad_ack.json()["field"] == "step"


class FakeTrainer:
    global_step = 7
    is_global_zero = True
    global_rank = 0


def test_datamodule_acks_with_its_step_and_reports_a_resume_once():
    dm = RolloutDataModule("http://127.0.0.1:9", keepalive_interval_s=0)
    client = dm.client = RecordingClient()
    dm.trainer = FakeTrainer()
    dm.acknowledge("b-1")
    assert client.acks == [("b-1", 7)]
    state = dm.state_dict()
    assert state["step"] == 7

    resumed = RolloutDataModule("http://127.0.0.1:9", keepalive_interval_s=0)
    client2 = resumed.client = RecordingClient()
    resumed.trainer = FakeTrainer()
    resumed.load_state_dict(state)
    assert client2.resumes == []  # reported at the first batch, not at load time
    resumed.on_before_batch_transfer({"batch_id": "ready"}, 0)
    resumed.on_before_batch_transfer({"batch_id": "ready"}, 0)
    assert client2.resumes == [("policy", 7)]
