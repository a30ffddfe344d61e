"""The long-polling lease (``POST /v1/lease`` with ``wait_s``), in process: the real app and core
on real SQLite through :func:`tests.fakes.app_client`.

A lease that finds no room waits for it: every route that can make room (a pull served, a push,
tasks returned, an ack, a publish, a deregistration) wakes it, and it is tried again then, so a
RaaS starts the next tasks as soon as the trainer makes room instead of at its next poll. A lease
that can be granted, or asks for nothing, answers at once; ``wait_s`` is checked and named.
"""

from __future__ import annotations

import hashlib
import threading

import pytest
from fastapi.testclient import TestClient

from astralight.dataflow.app import create_app
from astralight.dataflow.client import DataflowError
from astralight.dataflow.config import DataflowConfig
from astralight.protocol import WeightManifest
from tests.fakes import app_client
from tests.unit.batch_ack_flow import GROUP, samples


@pytest.fixture
def full(tmp_path):
    """``(client, app, iid)``: an instance whose one task filled the buffer (2 samples queued,
    ``max_buffered_samples=2``), so no lease can be granted until the trainer pulls."""
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=GROUP,
                                    max_buffered_samples=GROUP, lease_seconds=3600), token="")
    with TestClient(app, base_url="http://127.0.0.1") as http:
        client = app_client(http)
        iid = client.register(["policy"], capacity=8)["instance_id"]
        [task] = client.lease(iid, 8)
        assert client.push(iid, task.task_id, samples(task))["accepted"] == GROUP
        assert client.lease(iid, 8) == []  # no room: the queue holds max_buffered_samples
        yield client, app, iid


def _waiting_lease(app, client, iid: str) -> tuple[threading.Thread, list]:
    """Start a 60 s long-poll lease and return once the route has tried it and found no room
    (the core's lease is wrapped to say so)."""
    core = app.state.dataflow
    tried = threading.Event()
    real = core.lease

    def lease(*args, **kwargs):
        tasks = real(*args, **kwargs)
        if not tasks:
            tried.set()
        return tasks

    core.lease = lease
    out: list = []
    thread = threading.Thread(target=lambda: out.append(client.lease(iid, 8, wait_s=60.0)),
                              daemon=True)
    thread.start()
    assert tried.wait(30), "the long-poll lease never reached the core"
    core.lease = real
    return thread, out


def test_a_waiting_lease_is_granted_once_a_pull_makes_room(full):
    client, app, iid = full
    thread, out = _waiting_lease(app, client, iid)
    assert thread.is_alive()  # no room yet: it waits instead of answering []
    assert client.pull_batch("policy", GROUP, timeout_s=0) is not None
    thread.join(30)
    assert not thread.is_alive() and len(out[0]) == 1  # granted: the new task's samples fit


@pytest.mark.parametrize("route", ["pull", "push", "return", "ack", "publish", "deregister"])
def test_every_route_that_can_make_room_wakes_waiting_leases(full, route):
    """The room event is set by each route that changes what a lease may grant, and only after
    its work is done (the waiter then tries again and sees the change)."""
    client, app, iid = full
    wake = app.state.wakeups
    if route == "push":  # a second task to push: room comes from a pull first
        batch = client.pull_batch("policy", GROUP, timeout_s=0)
        client.ack(batch.batch_id)
        [task] = client.lease(iid, 1)
    elif route == "return":
        client.ack(client.pull_batch("policy", GROUP, timeout_s=0).batch_id)
        [task] = client.lease(iid, 1)
    elif route == "ack":
        batch = client.pull_batch("policy", GROUP, timeout_s=0)
    room = wake.room()
    assert not room.is_set()
    if route == "pull":
        client.pull_batch("policy", GROUP, timeout_s=0)
    elif route == "push":
        client.push(iid, task.task_id, samples(task))
    elif route == "return":
        assert client.return_tasks(iid, [task.task_id]) == {"returned": 1}
    elif route == "ack":
        client.ack(batch.batch_id)
    elif route == "publish":
        data = b"weights v1"
        client.upload_weight_file("policy", 1, "model.safetensors", data)
        client.publish(WeightManifest(model_id="policy", version=1, kind="full", files={
            "model.safetensors": {"sha256": hashlib.sha256(data).hexdigest(),
                                  "bytes": len(data)}}))
    elif route == "deregister":
        client.deregister(iid)
    assert room.is_set()
    assert wake.room() is not room  # the next waiter waits for the next change


def test_a_pull_that_finds_nothing_does_not_wake_leases(full):
    client, app, _ = full
    client.pull_batch("policy", GROUP, timeout_s=0)  # takes the only batch
    room = app.state.wakeups.room()
    assert client.pull_batch("policy", GROUP, timeout_s=0) is None
    assert not room.is_set()


def test_a_lease_that_can_be_granted_or_asks_for_nothing_answers_at_once(tmp_path):
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=GROUP),
                     token="")
    with TestClient(app, base_url="http://127.0.0.1") as http:
        client = app_client(http)
        iid = client.register(["policy"], capacity=8)["instance_id"]
        # (a 60 s wait would hang this test if either waited)
        assert len(client.lease(iid, 3, wait_s=60.0)) == 3
        assert client.lease(iid, 0, wait_s=60.0) == []


@pytest.mark.parametrize("wait_s", [-1.0, float("nan"), "soon"])
def test_a_bad_wait_s_is_refused_naming_the_field(full, wait_s):
    client, _, iid = full
    with pytest.raises(DataflowError) as info:
        client._call("POST", "/v1/lease", {"instance_id": iid, "max_tasks": 1, "wait_s": wait_s},
                     instance_id=iid)
    assert (info.value.status, info.value.field) == (422, "wait_s")
