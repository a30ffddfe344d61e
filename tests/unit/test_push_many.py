"""Batched pushes (``POST /v1/push_many``, :meth:`DataflowClient.push_many`) and group commit
(:mod:`astralight.dataflow.durability`), in process: the real app and core on real SQLite.

push_many: per-item replies in order for mixed good / duplicate / bad items, each exactly what
``push`` of that item alone answers or raises (status, field, message); idempotency (a repeat is
all duplicates, nothing added); the size limits (items per request, body bytes: the client splits
a 413 in halves), strict fields at both levels, a request whose every item is refused answered
4xx with every item's answer, and a body that does not decode because of one item (the client
then pushes item by item). Group commit: one fsync covers every commit made before it, commits
go on during an fsync, an fsync failure refuses every later confirmation, and the core's lock
waits for durability at its outermost release (once per batched request).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from astralight.dataflow import routes_tasks as app_module
from astralight.dataflow.app import create_app
from astralight.dataflow.client import DataflowClient, DataflowError
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.durability import DurableLock, GroupSync
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.store import Store
from astralight.protocol import Sample, decode, encode
from tests.fakes import app_client

GROUP = 2


def group(task_id: str, rewards=(1.0, 0.0), model_id: str = "policy") -> list[Sample]:
    """A valid group for ``task_id``: 3 prompt tokens, 3 generated at version 0."""
    return [Sample(task_id=task_id, sample_index=i, model_id=model_id,
                   token_ids=np.arange(10 * i, 10 * i + 6, dtype=np.int32),
                   logprobs=np.array([0, 0, 0, -0.5, -0.25, -0.125], np.float32),
                   loss_mask=np.array([0, 0, 0, 1, 1, 1], np.uint8),
                   versions=np.array([-1, -1, -1, 0, 0, 0], np.int32),
                   reward=float(r), prompt_len=3) for i, r in enumerate(rewards)]


@pytest.fixture
def service(tmp_path):
    """``(client, core, iid, tasks)``: the app with a registered instance holding 8 leases."""
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=GROUP,
                                    max_body_bytes=64 * 1024, lease_seconds=3600), token="")
    with TestClient(app, base_url="http://127.0.0.1") as http:  # no token: a loopback Host
        client = app_client(http)
        iid = client.register(["policy"], capacity=8)["instance_id"]
        tasks = client.lease(iid, 8)
        assert len(tasks) == 8
        yield client, app.state.dataflow, iid, [t.task_id for t in tasks], http


def _model(client) -> dict:
    return client.stats()["models"]["policy"]


def _error_of(fn) -> DataflowError:
    with pytest.raises(DataflowError) as info:
        fn()
    return info.value


def _same_error(a: Exception, b: Exception) -> tuple:
    assert isinstance(a, DataflowError) and isinstance(b, DataflowError), (a, b)
    return (a.status, a.field, a.message) == (b.status, b.field, b.message)


# ----------------------------------------------------------------------------- push_many


def test_mixed_items_get_their_own_replies_in_order(service):
    client, _, iid, t, _ = service
    assert client.push(iid, t[0], group(t[0]))["accepted"] == GROUP  # accepted before
    wrong_model = group(t[2], model_id="ghost")
    huge_reward = group(t[3], rewards=(1e12, 0.0))
    items = [(t[1], group(t[1])), (t[0], group(t[0], (0.0, 0.0))), (t[2], wrong_model),
             ("no-such-task", group("no-such-task")), (t[3], huge_reward),
             (t[4], group(t[4], (0.5, 0.5))), (t[1], group(t[1], (0.0, 0.0)))]
    out = client.push_many(iid, items)
    assert len(out) == len(items)
    assert out[0] == {"accepted": GROUP, "filtered": 0, "duplicate": False}
    assert out[1] == {"accepted": 0, "filtered": 0, "duplicate": True}  # accepted earlier
    assert isinstance(out[2], DataflowError) and (out[2].status, out[2].field) == \
        (422, "samples[0].model_id")
    assert (out[3].status, out[3].field) == (404, "task_id")
    assert (out[4].status, out[4].field) == (422, "samples[0].reward")
    assert out[5] == {"accepted": GROUP, "filtered": 0, "duplicate": False}
    assert out[6] == {"accepted": 0, "filtered": 0, "duplicate": True}  # earlier in this batch
    s = _model(client)
    assert (s["samples_accepted"], s["duplicates_ignored"], s["queue_depth"]) == (3 * GROUP, 2,
                                                                                 3 * GROUP)
    batch = client.pull_batch("policy", 3 * GROUP, timeout_s=0)
    by_task = {(x.task_id, x.sample_index): x.reward for x in batch.samples}
    assert by_task[(t[1], 0)] == 1.0  # the first push of t1 won, the repeat was ignored
    # each refusal is exactly what push of that item alone raises
    for i in (2, 3, 4):
        alone = _error_of(lambda: client.push(iid, *items[i]))
        assert _same_error(out[i], alone), (out[i], alone)
    # the refused tasks are still open: fixed groups are accepted later
    assert client.push_many(iid, [(t[2], group(t[2])), (t[3], group(t[3]))]) == \
        [{"accepted": GROUP, "filtered": 0, "duplicate": False}] * 2


def test_a_repeated_batch_is_all_duplicates_and_adds_nothing(service):
    client, _, iid, t, _ = service
    items = [(tid, group(tid)) for tid in t[:4]]
    assert [r["accepted"] for r in client.push_many(iid, items)] == [GROUP] * 4
    before = _model(client)
    again = client.push_many(iid, [(tid, group(tid, (0.0, 1.0))) for tid in t[:4]])
    assert again == [{"accepted": 0, "filtered": 0, "duplicate": True}] * 4
    after = _model(client)
    assert after["samples_accepted"] == before["samples_accepted"] == 4 * GROUP
    assert after["queue_depth"] == 4 * GROUP
    assert after["duplicates_ignored"] == before["duplicates_ignored"] + 4
    assert client.push(iid, t[0], group(t[0]))["duplicate"] is True  # push agrees


def test_every_item_refused_is_a_4xx_carrying_every_answer(service):
    client, _, iid, t, http = service
    out = client.push_many("ghost-instance", [(t[0], group(t[0])), (t[1], group(t[1]))])
    assert [(e.status, e.field) for e in out] == [(404, "instance_id")] * 2
    r = http.post("/v1/push_many", content=encode({"instance_id": iid, "items": [
        {"task_id": "nope", "samples": group("nope")}, {"task_id": t[0], "samples": []}]}),
        headers={"Content-Type": "application/msgpack"})
    assert r.status_code == 404 and r.json()["field"] == "items[0].task_id"
    assert [(x["status"], x["field"]) for x in r.json()["results"]] == [(404, "task_id"),
                                                                       (422, "samples")]
    assert _model(client)["samples_accepted"] == 0
    assert client.stats()["clients"]["testclient"]["failures_4xx"] >= 2  # counted as failures


def test_request_fields_and_item_fields_are_strict(service):
    client, _, iid, t, http = service

    def post(body):
        return http.post("/v1/push_many", content=encode(body),
                         headers={"Content-Type": "application/msgpack"})

    item = {"task_id": t[0], "samples": group(t[0])}
    for body, status, field in [
            ({"instance_id": iid, "items": [item], "extra": 1}, 422, "extra"),
            ({"instance_id": iid, "items": []}, 422, "items"),
            ({"instance_id": iid}, 422, "items"),
            ({"items": [item]}, 422, "instance_id"),
            ({"instance_id": iid, "items": item}, 422, "items"),
            ({"instance_id": 5, "items": [item]}, 422, "instance_id"),
            ({"instance_id": iid, "items": [{**item, "instance_id": iid}]}, 422,
             "items[0].instance_id"),
            ({"instance_id": iid, "items": [[t[0], group(t[0])]]}, 422, "items[0]"),
            ({"instance_id": iid, "items": [{"samples": group(t[0])}]}, 422, "items[0].task_id"),
            ({"instance_id": iid, "items": [{"task_id": "x" * 300, "samples": []}]}, 422,
             "items[0].task_id")]:
        r = post(body)
        assert (r.status_code, r.json()["field"]) == (status, field), (body.keys(), r.text)
    # an unknown field inside one item refuses that item only, as push refuses it
    r = post({"instance_id": iid, "items": [{**item, "extra": 1},
                                            {"task_id": t[1], "samples": group(t[1])}]})
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
    results = decode(r.content)["results"]
    assert (results[0]["status"], results[0]["field"]) == (422, "extra")
    assert results[1] == {"status": 200, "reply": {"accepted": GROUP, "filtered": 0,
                                                   "duplicate": False}}
    assert _model(client)["samples_accepted"] == GROUP


def test_size_limits_items_per_request_and_body_bytes(service, monkeypatch):
    client, _, iid, t, http = service
    monkeypatch.setattr(app_module, "MAX_PUSH_ITEMS", 3)
    body = encode({"instance_id": iid, "items": [{"task_id": x, "samples": group(x)}
                                                 for x in t[:4]]})
    r = http.post("/v1/push_many", content=body, headers={"Content-Type": "application/msgpack"})
    assert r.status_code == 422 and r.json()["field"] == "items"
    assert "1..3" in r.json()["error"] and "split" in r.json()["error"]
    monkeypatch.undo()
    # one group of ~18 KB fits the 64 KB body limit, eight of them do not: the request is
    # refused with a 413 and the client splits it in halves until each part fits
    big = {tid: group(tid) for tid in t}
    for samples in big.values():
        for s in samples:
            n = 700
            s.token_ids = np.arange(n, dtype=np.int32)
            s.logprobs = np.concatenate([np.zeros(3, np.float32), -np.ones(n - 3, np.float32)])
            s.loss_mask = np.concatenate([np.zeros(3, np.uint8), np.ones(n - 3, np.uint8)])
            s.versions = np.concatenate([-np.ones(3, np.int32), np.zeros(n - 3, np.int32)])
    assert len(encode({"instance_id": iid, "items": [{"task_id": x, "samples": big[x]}
                                                     for x in t]})) > 64 * 1024
    out = client.push_many(iid, list(big.items()))
    assert out == [{"accepted": GROUP, "filtered": 0, "duplicate": False}] * len(t)
    assert _model(client)["samples_accepted"] == len(t) * GROUP
    # one item too big on its own gets push's own 413
    huge = group("whatever")
    huge[0].token_ids = np.arange(40_000, dtype=np.int32)
    huge[0].logprobs = np.zeros(40_000, np.float32)
    huge[0].loss_mask = np.zeros(40_000, np.uint8)
    huge[0].versions = -np.ones(40_000, np.int32)
    [err] = client.push_many(iid, [(t[0], huge)])
    assert isinstance(err, DataflowError) and (err.status, err.field) == (413, "body")


def test_an_item_that_does_not_decode_is_refused_alone(service):
    """A positive log-prob fails decoding the whole body (field ``body.items[1]...``); the client
    pushes the items one by one, so the others are accepted and the bad one gets push's error."""
    client, _, iid, t, _ = service
    bad = group(t[1])
    bad[0].logprobs[-1] = 0.5
    out = client.push_many(iid, [(t[0], group(t[0])), (t[1], bad), (t[2], group(t[2]))])
    assert out[0]["accepted"] == GROUP and out[2]["accepted"] == GROUP
    assert (out[1].status, out[1].field) == (422, "body.samples[0].logprobs")
    assert _same_error(out[1], _error_of(lambda: client.push(iid, t[1], bad)))
    assert _model(client)["samples_accepted"] == 2 * GROUP


def test_bad_arguments_raise_before_sending(service):
    client, _, iid, t, _ = service
    assert client.push_many(iid, []) == []
    with pytest.raises(TypeError, match=r"^items\[1\]: expected a \(task_id, samples\) pair"):
        client.push_many(iid, [(t[0], group(t[0])), "oops"])
    with pytest.raises(TypeError, match=r"^items\[0\]: task_id must be a str"):
        client.push_many(iid, [(7, group(t[0]))])
    assert _model(client)["samples_accepted"] == 0


def test_an_unreachable_service_is_every_item_s_exception():
    from tests.conftest import free_port

    with DataflowClient(f"http://127.0.0.1:{free_port()}", retry_s=0.2) as client:
        out = client.push_many("raas", [("a", group("a")), ("b", group("b"))])
    assert len(out) == 2 and all(isinstance(e, DataflowError) and e.status is None for e in out)


# ----------------------------------------------------------------------------- group commit


class _Gate:
    """An fsync stand-in that blocks until released, counting calls."""

    def __init__(self):
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self):
        self.calls += 1
        self.entered.set()
        assert self.release.wait(30), "the test never released the fsync"


def _join(*threads: threading.Thread) -> None:
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a waiter hung"


def test_one_fsync_covers_every_commit_before_it(tmp_path):
    sync = GroupSync(tmp_path / "db-wal", tmp_path / "db", enabled=True)
    (tmp_path / "db-wal").write_bytes(b"x")
    for _ in range(5):
        sync.committed()
    sync.wait()
    assert sync.counters() == {"group_commit": True, "commits": 5, "fsyncs": 1, "durable": 5}
    sync.wait(3)  # already durable: no fsync
    assert sync.fsyncs == 1


def test_commits_go_on_during_an_fsync_and_the_next_one_covers_them(tmp_path):
    sync = GroupSync(tmp_path / "db-wal", tmp_path / "db", enabled=True)
    gate = _Gate()
    sync._fsync = gate
    first = sync.committed()
    leader = threading.Thread(target=sync.wait, args=(first,))
    leader.start()
    assert gate.entered.wait(30)
    later = [sync.committed() for _ in range(3)]  # not blocked by the fsync under way
    followers = [threading.Thread(target=sync.wait, args=(n,)) for n in later]
    for f in followers:
        f.start()
    gate.release.set()
    _join(leader, *followers)
    # the leader's fsync covered only the first commit; one more covered the three later ones
    assert gate.calls == 2 and sync.counters()["durable"] == 4


def test_an_fsync_failure_refuses_every_later_confirmation(tmp_path):
    sync = GroupSync(tmp_path / "db-wal", tmp_path / "db", enabled=True)
    (tmp_path / "db-wal").write_bytes(b"x")
    done = sync.committed()
    sync.wait(done)

    def broken():
        raise OSError(5, "Input/output error")

    sync._fsync = broken
    n = sync.committed()
    for _ in range(2):  # and it stays refused: a later fsync could lie
        with pytest.raises(ServiceError) as info:
            sync.wait(n)
        assert info.value.status == 503 and info.value.field == "state_dir"
        assert "restart" in info.value.message
    sync.wait(done)  # what was confirmed before stays confirmed


def test_without_group_commit_every_commit_is_its_own_fsync(tmp_path):
    store = Store(tmp_path / "db.sqlite", group_commit=False)
    for _ in range(3):
        with store.tx():
            store.set_meta("k", 1)
    assert store.durability.counters() == {"group_commit": False, "commits": 3, "fsyncs": 3,
                                           "durable": 3}
    assert store.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    store.close()


def test_the_core_lock_waits_at_its_outermost_release_and_once_when_deferred(tmp_path):
    store = Store(tmp_path / "db.sqlite", group_commit=True)
    assert store.conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL: fsync is ours
    lock = DurableLock(store.durability)
    sync = store.durability
    with lock:
        with lock, store.tx():
            store.set_meta("a", 1)
        assert sync.counters()["durable"] < sync.last  # an inner release does not wait
    assert sync.counters()["durable"] == sync.last
    fsyncs = sync.fsyncs
    with lock.deferred():
        for k in "bcd":
            with lock, store.tx():
                store.set_meta(k, 1)
            assert sync.counters()["durable"] < sync.last
    assert sync.counters()["durable"] == sync.last and sync.fsyncs == fsyncs + 1
    store.close()


def test_push_and_push_many_answer_only_durable_state(tmp_path):
    flow = Dataflow(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=GROUP))
    iid = flow.register(["policy"], 4, "raas-a", {})["instance_id"]
    t = [x.task_id for x in flow.lease(iid, 4)]
    sync = flow.store.durability
    fsyncs = sync.fsyncs
    flow.push(iid, t[0], group(t[0]))
    assert sync.counters()["durable"] == sync.last and sync.fsyncs == fsyncs + 1
    out = flow.push_many(iid, [(x, group(x)) for x in t[1:]] + [("nope", group("nope"))])
    assert [r["accepted"] for r in out[:3]] == [GROUP] * 3 and isinstance(out[3], ServiceError)
    # three tasks, three commits, one fsync for the request
    assert sync.counters()["durable"] == sync.last and sync.fsyncs == fsyncs + 2
    flow.close()
