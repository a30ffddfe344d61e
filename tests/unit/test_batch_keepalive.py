"""Batch keep-alive: ``Dataflow.extend_batch`` on the real core and SQLite store (clock passed in,
no timed asserts), the store migration for old databases, the route in-process, and the
datamodule's :class:`BatchKeepAlive` thread against a fake client."""

from __future__ import annotations

import logging
import sqlite3
import time

import pytest
from fastapi.testclient import TestClient

from astralight.dataflow.app import create_app
from astralight.dataflow.client import ACK_TIMEOUT_HEADER, DataflowError, DataflowUnreachable
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.store import SCHEMA, Store
from astralight.datamodules.rollout import BatchKeepAlive, RolloutDataModule
from astralight.protocol import decode, encode
from tests.fakes import FakeKeepAliveClient as FakeClient
from tests.fakes import FakeTrainerClient
from tests.unit.batch_ack_flow import GROUP, TIMEOUT, make, samples


def served(flow: Dataflow, n_tasks: int = 1):
    iid = flow.register(["policy"], capacity=8, instance_id="raas-a", meta={})["instance_id"]
    for t in flow.lease(iid, n_tasks):
        flow.push(iid, t.task_id, samples(t))
    batch = flow.pull("policy", GROUP * n_tasks, trainer_id="trainer-0")
    assert batch is not None
    return batch, flow.store.batch(batch.batch_id)["served_at"]


# ----------------------------------------------------------------------------- core


def test_extend_keeps_a_batch_past_the_timeout(tmp_path):
    flow = make(tmp_path)
    batch, t0 = served(flow)
    answer = flow.extend_batch(batch.batch_id, now=t0 + 1.5)
    assert answer == {"batch_id": batch.batch_id, "extended": True, "deadline_s": TIMEOUT,
                      "batch_ack_timeout_s": TIMEOUT}
    # 3 s after the serve: past the timeout from served_at, not from the extend
    assert flow.requeue_expired_batches(now=t0 + 3.0) == set()
    assert flow.store.batch(batch.batch_id)["state"] == "served"
    flow.extend_batch(batch.batch_id, now=t0 + 3.0)
    assert flow.requeue_expired_batches(now=t0 + 4.9) == set()
    # an extend with an older clock never moves the deadline back
    flow.extend_batch(batch.batch_id, now=t0 + 0.5)
    assert flow.requeue_expired_batches(now=t0 + 4.9) == set()
    # no extend for longer than the timeout: re-queued
    assert flow.requeue_expired_batches(now=t0 + 5.1) == {"policy"}
    stats = flow.stats()["models"]["policy"]
    assert stats["batches_extended"] == 3 and stats["batches_requeued"] == 1
    assert stats["queue_depth"] == GROUP
    flow.close()


def test_a_batch_never_extended_is_requeued_as_before(tmp_path):
    flow = make(tmp_path)
    batch, t0 = served(flow)
    assert flow.requeue_expired_batches(now=t0 + 1.9) == set()
    assert flow.requeue_expired_batches(now=t0 + 2.1) == {"policy"}
    flow.close()


def test_extend_of_unknown_acked_or_requeued_batches_is_refused(tmp_path):
    flow = make(tmp_path)
    with pytest.raises(ServiceError) as info:
        flow.extend_batch("no-such-batch")
    assert (info.value.status, info.value.field) == (404, "batch_id")

    acked, t0 = served(flow)
    flow.ack(acked.batch_id)
    with pytest.raises(ServiceError) as info:
        flow.extend_batch(acked.batch_id)
    assert (info.value.status, info.value.field) == (409, "batch_id")
    assert "already acknowledged" in info.value.message

    late, t1 = served(flow)
    flow.requeue_expired_batches(now=t1 + TIMEOUT + 1)
    with pytest.raises(ServiceError) as info:
        flow.extend_batch(late.batch_id)
    assert (info.value.status, info.value.field) == (409, "batch_id")
    assert "re-queued" in info.value.message and "batch_ack_timeout_s=2" in info.value.message
    assert flow.store.batch(late.batch_id)["state"] == "requeued"  # the refusal changed nothing
    flow.close()


def test_an_extend_is_durable_across_a_restart(tmp_path):
    flow = make(tmp_path)
    batch, t0 = served(flow)
    flow.extend_batch(batch.batch_id, now=t0 + 100.0)
    flow.close()
    again = make(tmp_path)
    # far past served_at + timeout, within renewed_at + timeout: kept only if the extend was stored
    assert again.requeue_expired_batches(now=t0 + 101.0) == set()
    assert again.store.batch(batch.batch_id)["renewed_at"] == pytest.approx(t0 + 100.0)
    assert again.requeue_expired_batches(now=t0 + 102.5) == {"policy"}
    again.close()


def test_a_database_from_before_keepalive_opens_and_its_batches_time_out(tmp_path):
    """An old state folder (batches without renewed_at) gets the column; its batches count
    from served_at as before."""
    path = tmp_path / "state" / "dataflow.db"
    path.parent.mkdir(parents=True)
    old = SCHEMA.replace("acked_at REAL, renewed_at REAL, acked_step INTEGER,\n    rolled_back_at REAL)",
                         "acked_at REAL)")
    assert old != SCHEMA
    conn = sqlite3.connect(path)
    conn.executescript(old)
    conn.execute("INSERT INTO batches(batch_id, model_id, trainer_id, policy_version, n, state,"
                 " served_at) VALUES('b-old', 'policy', 't', 0, 0, 'served', 10.0)")
    conn.commit()
    conn.close()
    store = Store(path)
    cols = {r["name"] for r in store.conn.execute("PRAGMA table_info(batches)")}
    assert "renewed_at" in cols
    assert [r["batch_id"] for r in store.batches_served_before(10.5)] == ["b-old"]
    with store.tx():
        store.renew_batch("b-old", 20.0)
    assert store.batches_served_before(10.5) == [] and store.batches_served_before(20.5)
    store.close()


# ----------------------------------------------------------------------------- route


def test_the_route_and_the_pull_header(tmp_path):
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=GROUP,
                                    batch_ack_timeout_s=TIMEOUT), token="")
    core = app.state.dataflow
    hdr = {"Content-Type": "application/msgpack"}
    with TestClient(app, base_url="http://127.0.0.1") as http:  # no token: a loopback Host
        iid = core.register(["policy"], 4, "raas-a", {})["instance_id"]
        task = core.lease(iid, 1)[0]
        core.push(iid, task.task_id, samples(task))
        r = http.post("/v1/pull", content=encode({"model_id": "policy", "size": GROUP}),
                      headers=hdr)
        assert r.status_code == 200 and r.headers[ACK_TIMEOUT_HEADER] == "2"
        batch_id = decode(r.content).batch_id

        def extend(body):
            return http.post("/v1/batches/extend", content=encode(body), headers=hdr)

        r = extend({"batch_id": batch_id})
        assert r.status_code == 200 and decode(r.content)["deadline_s"] == TIMEOUT
        assert extend({"batch_id": "nope"}).status_code == 404
        r = extend({"batch_id": batch_id, "step": 3})
        assert r.status_code == 422 and r.json()["field"] == "step"
        assert extend({"batch_id": 7}).status_code == 422
        assert extend({}).json()["field"] == "batch_id"
        http.post("/v1/ack", content=encode({"batch_id": batch_id}), headers=hdr)
        r = extend({"batch_id": batch_id})
        assert r.status_code == 409 and r.json()["field"] == "batch_id"
        assert http.get("/v1/info").json()["batch_ack_timeout_s"] == TIMEOUT
        assert http.get("/v1/stats").json()["models"]["policy"]["batches_extended"] == 1


# ----------------------------------------------------------------------------- keep-alive thread


def test_keepalive_extends_held_batches_until_released():
    fake = FakeClient()
    ka = BatchKeepAlive(lambda: fake, interval_s=3600.0)  # the thread never ticks by itself
    ka.hold("a")
    ka.hold("b")
    ka.tick()
    assert sorted(fake.calls) == ["a", "b"] and ka.extended == 2
    assert ka.release("a") and not ka.release("a")
    ka.tick()
    assert fake.calls[-1] == "b" and len(fake.calls) == 3
    ka.close()
    assert fake.closed and ka.held == []


def test_keepalive_drops_a_refused_batch_and_warns_once(caplog):
    fake = FakeClient()
    ka = BatchKeepAlive(lambda: fake, interval_s=3600.0, name="policy@r0")
    fake.fail["gone-1"] = DataflowError(409, "batch gone-1 was re-queued", "batch_id")
    fake.fail["gone-2"] = DataflowError(404, "unknown batch 'gone-2'", "batch_id")
    for b in ("ok", "gone-1", "gone-2"):
        ka.hold(b)
    with caplog.at_level(logging.WARNING):
        ka.tick()
        ka.tick()
    assert ka.held == ["ok"] and ka.refused == 2 and fake.calls.count("gone-1") == 1
    warnings = [r for r in caplog.records if "refused to extend" in r.getMessage()]
    assert len(warnings) == 1 and "frozen" in warnings[0].getMessage()
    assert "policy@r0" in warnings[0].getMessage()
    ka.close()


def test_keepalive_ignores_a_409_for_a_batch_acked_meanwhile(caplog):
    fake = FakeClient()
    ka = BatchKeepAlive(lambda: fake, interval_s=3600.0)
    ka.hold("a")

    def ack_races(batch_id):  # the ack lands (and releases) while the extend is in flight
        ka.release(batch_id)
        raise DataflowError(409, "already acknowledged", "batch_id")

    fake.extend_batch = ack_races
    with caplog.at_level(logging.WARNING):
        ka.tick()
    assert ka.refused == 0 and not caplog.records
    ka.close()


def test_keepalive_survives_transient_errors_and_retries():
    fake = FakeClient()
    ka = BatchKeepAlive(lambda: fake, interval_s=3600.0)
    ka.hold("a")
    for exc in (DataflowUnreachable("connection refused"), DataflowError(500, "boom"),
                RuntimeError("anything")):
        fake.fail["a"] = exc
        ka.tick()
    assert ka.errors == 3 and ka.held == ["a"] and ka.extended == 0
    del fake.fail["a"]
    ka.tick()
    assert ka.extended == 1 and ka.held == ["a"]
    ka.close()


def test_keepalive_thread_ticks_and_stops_at_close():
    fake = FakeClient()
    ka = BatchKeepAlive(lambda: fake, interval_s=0.05)
    ka.hold("a")
    assert fake.called.wait(timeout=30)
    thread = ka._thread
    ka.close()
    assert thread is not None and not thread.is_alive()
    n = len(fake.calls)
    time.sleep(0.2)
    assert len(fake.calls) == n  # nothing after close
    with pytest.raises(ValueError, match="keepalive_interval_s"):
        BatchKeepAlive(lambda: fake, interval_s=0)


def test_datamodule_holds_a_pulled_batch_until_its_ack(caplog):
    from astralight.protocol import Batch

    fake = FakeTrainerClient(timeout_s=30.0)
    dm = RolloutDataModule("http://127.0.0.1:1", batch_size=GROUP)
    dm.client = fake
    batch = Batch(batch_id="b1", model_id="policy", policy_version=0, samples=[])
    dm._on_pull(batch)
    ka = dm._keepalive
    assert ka is not None and ka.interval_s == pytest.approx(10.0) and ka.held == ["b1"]
    fake.ack_answer = {"acked": True, "late": True, "trained_twice": 2, "taken_back": 0,
                       "warning": "batch b1 ... trained twice"}
    with caplog.at_level(logging.WARNING):
        dm.acknowledge("b1")
    assert ka.held == [] and fake.acks == ["b1"]
    assert any("trained twice" in r.getMessage() for r in caplog.records)
    thread = ka._thread
    dm.teardown("fit")
    assert dm._keepalive is None and ka._stop.is_set()
    assert thread is None or not thread.is_alive()

    off = RolloutDataModule("http://127.0.0.1:1", batch_size=GROUP, keepalive_interval_s=0)
    off.client = FakeTrainerClient(timeout_s=30.0)
    off._on_pull(batch)
    assert off._keepalive is None
    fixed = RolloutDataModule("http://127.0.0.1:1", batch_size=GROUP, keepalive_interval_s=1.5)
    fixed.client = FakeTrainerClient(timeout_s=None)
    fixed._on_pull(batch)
    assert fixed._keepalive.interval_s == 1.5
    fixed.teardown("fit")
    with pytest.raises(ValueError, match="keepalive_interval_s"):
        RolloutDataModule("http://127.0.0.1:1", keepalive_interval_s=-1)
