"""Pool membership over HTTP against the real dataflow service process (clients only, no RaaS):
register with capacity units, the drain route and the heartbeat's drain flag, returning tasks,
deregistering and registering again, bad fields, and a restart on the same state folder that
keeps every instance's counters and the balance report's times."""

from __future__ import annotations

import signal

import httpx
import pytest

from astralight.dataflow.client import DataflowError
from astralight.protocol import encode
from tests.integration.service_helpers import make_samples, model_stats, publish_version


def instances(c) -> dict[str, dict]:
    return {r["instance_id"]: r for r in c.stats()["instances"]}


def test_drain_return_deregister_and_register_again_over_http(tmp_path, dataflow_service,
                                                              client_for):
    url, _, _ = dataflow_service(tmp_path, group_size=2, lease_seconds=60.0)
    c = client_for(url)
    a = c.register(["policy"], 3, instance_id="a", capacity_units=2.0)["instance_id"]
    b = c.register(["policy"], 4, instance_id="b")["instance_id"]
    t1, t2, t3 = c.lease(a, 8)  # capacity 3
    assert c.lease(a, 8) == []
    hb = c.heartbeat(a, in_flight=3)
    assert hb["drain"] is False and hb["instance_id"] == "a" and hb["lease_seconds"] == 60.0
    row = instances(c)["a"]
    assert (row["capacity_units"], row["in_flight"], row["reported_in_flight"]) == (2.0, 3, 3)
    assert (row["state"], row["status"]) == ("active", "healthy")

    # the drain route: no new task, the heartbeat says drain, running tasks may still be pushed
    assert c.drain(a) == {"instance_id": "a", "state": "draining", "in_flight": 3}
    assert c.heartbeat(a, in_flight=3)["drain"] is True
    assert c.lease(a, 1) == []
    assert c.push(a, t1.task_id, make_samples(t1, [1.0, 0.0]))["accepted"] == 2
    # one returned as not started, one as failed: both leasable at once by b
    assert c.return_tasks(a, [t2.task_id]) == {"returned": 1}
    assert c.return_tasks(a, [t3.task_id, t2.task_id], failed=True) == {"returned": 1}
    assert [t.task_id for t in c.lease(b, 2)] == [t2.task_id, t3.task_id]
    row = instances(c)["a"]
    assert (row["status"], row["in_flight"], row["tasks_done"]) == ("draining", 0, 1)
    assert (row["tasks_returned"], row["tasks_failed"], row["fail_streak"]) == (2, 1, 1)
    assert model_stats(c)["tasks_returned"] == 2
    assert c.deregister(a) == {"returned": 0}
    row = instances(c)["a"]
    assert (row["state"], row["status"], row["live"]) == ("left", "left", False)
    assert row["left_at"] is not None and row["alive_s"] >= 0
    report = c.balance("policy", window=1)
    assert (report["live_instances"], report["capacity_units"]) == (1, 1.0)

    # b leaves holding two tasks: deregister returns them
    assert c.deregister(b) == {"returned": 2}
    assert instances(c)["b"]["tasks_returned"] == 2

    # registering again makes a active with its counters kept
    c.register(["policy"], 3, instance_id="a", capacity_units=2.0)
    assert c.heartbeat(a)["drain"] is False
    row = instances(c)["a"]
    assert (row["state"], row["left_at"], row["tasks_done"], row["samples_pushed"]) == \
        ("active", None, 1, 2)
    assert [t.task_id for t in c.lease(a, 3)][:2] == [t2.task_id, t3.task_id]


def test_membership_routes_name_bad_fields(tmp_path, dataflow_service, client_for):
    url, _, _ = dataflow_service(tmp_path, group_size=2)
    c = client_for(url)
    iid = c.register(["policy"], 2)["instance_id"]
    with pytest.raises(DataflowError) as err:
        c.register(["policy"], 2, capacity_units=0)
    assert err.value.status == 422 and err.value.field == "capacity_units"
    with pytest.raises(DataflowError) as err:
        c.heartbeat(iid, in_flight=-1)
    assert err.value.status == 422 and err.value.field == "in_flight"
    for call in (lambda: c.drain("ghost"), lambda: c.deregister("ghost"),
                 lambda: c.return_tasks("ghost", ["x"]), lambda: c.heartbeat("ghost")):
        with pytest.raises(DataflowError) as err:
            call()
        assert err.value.status == 404 and err.value.field == "instance_id"
    http = httpx.Client(base_url=url, timeout=10)
    bad = [({"instance_id": iid, "task_ids": "t"}, "task_ids"),
           ({"instance_id": iid, "task_ids": [1]}, "task_ids[0]"),
           ({"instance_id": iid, "task_ids": [], "failed": "yes"}, "failed"),
           ({"task_ids": []}, "instance_id")]
    for body, name in bad:
        r = http.post("/v1/return", content=encode(body),
                      headers={"Content-Type": "application/msgpack"})
        assert r.status_code == 422 and r.json()["field"] == name
    r = http.post("/v1/register", content=encode({"model_ids": ["policy"],
                                                  "capacity_units": "2"}),
                  headers={"Content-Type": "application/msgpack"})
    assert r.status_code == 422 and r.json()["field"] == "capacity_units"
    http.close()
    assert c.lease(iid, 1)  # nothing above broke the instance


def test_a_restarted_service_keeps_instances_counters_and_version_times(tmp_path,
                                                                       dataflow_service,
                                                                       client_for):
    url, proc, _ = dataflow_service(tmp_path, group_size=2)
    c = client_for(url)
    iid = c.register(["policy"], 4, instance_id="r1", capacity_units=1.5)["instance_id"]
    tasks = c.lease(iid, 3)
    for t in tasks[:2]:
        c.push(iid, t.task_id, make_samples(t, [1.0, 0.0]))
    publish_version(c, 1)
    publish_version(c, 2)
    before = c.balance("policy", window=1)  # version 1: from its publication to that of 2
    assert before["versions"] == [1, 1] and before["wall_s"] > 0
    first_window = c.balance("policy", window=2)
    assert first_window["versions"] == [0, 1] and first_window["produced"] == 4
    row = instances(c)["r1"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0

    url2, _, _ = dataflow_service(tmp_path, group_size=2)  # same state_dir
    c2 = client_for(url2)
    assert c2.heartbeat(iid)["drain"] is False  # still known: the heartbeat is answered
    c2.register(["policy"], 4, instance_id=iid, capacity_units=1.5)  # the RaaS rejoins
    again = instances(c2)["r1"]
    for key in ("tasks_leased", "tasks_done", "samples_pushed", "registered_at",
                "capacity_units"):
        assert again[key] == row[key], key
    assert again["in_flight"] == 1  # its third lease is still valid
    c2.push(iid, tasks[2].task_id, make_samples(tasks[2], [0.0, 1.0]))
    assert instances(c2)["r1"]["tasks_done"] == 3
    after = c2.balance("policy", window=1)
    assert after["wall_s"] == before["wall_s"]  # publication times are durable
    window2 = c2.balance("policy", window=2)
    assert window2["wall_s"] == first_window["wall_s"] and window2["produced"] == 4
    assert window2["capacity_units"] == 1.5
    assert window2["throughput_per_capacity_unit"] == pytest.approx(
        4 / window2["wall_s"] / 1.5, rel=1e-2)
