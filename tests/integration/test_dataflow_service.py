"""The real dataflow service process over HTTP on 127.0.0.1: leases, durability across kill -9,
bad input, batches, staleness, weights, evals and auth."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import msgpack
import pytest

from astralight.dataflow.client import DataflowError
from astralight.protocol import WeightManifest, encode
from tests.integration.service_helpers import make_samples, model_stats, publish_version

EVAL_SOURCE = {"class_path": "astralight.tasks.arithmetic.ArithmeticSource",
               "init_args": {"split": "eval", "eval_size": 3}}


def test_expired_lease_is_reissued_once_and_the_late_push_is_a_duplicate(tmp_path, dataflow_service,
                                                                         client_for):
    url, _, _ = dataflow_service(tmp_path, lease_seconds=1.0, max_inflight_tasks=1, group_size=2)
    c = client_for(url)
    a = c.register(["policy"], capacity=1)["instance_id"]
    b = c.register(["policy"], capacity=1)["instance_id"]
    [task] = c.lease(a, 4)
    assert task.kind == "train" and task.n == 2 and task.metadata["answer"]
    assert c.lease(b, 4) == []  # max_inflight_tasks reached, lease still valid
    time.sleep(max(0.0, task.lease_deadline - time.time()) + 0.3)
    [again] = c.lease(b, 4)
    assert again.task_id == task.task_id and again.prompt == task.prompt
    assert again.lease_deadline > task.lease_deadline
    assert c.lease(a, 4) == []  # re-issued once, not again while B holds a valid lease
    assert c.push(b, task.task_id, make_samples(task, [1.0, 0.0])) == {"accepted": 2, "filtered": 0,
                                                                        "duplicate": False}
    assert c.push(a, task.task_id, make_samples(task, [0.0, 0.0])) == {"accepted": 0, "filtered": 0,
                                                                        "duplicate": True}
    s = model_stats(c)
    assert (s["tasks_issued"], s["tasks_reissued"]) == (1, 1)
    assert (s["samples_accepted"], s["duplicates_ignored"], s["queue_depth"]) == (2, 1, 2)
    batch = c.pull_batch("policy", 2, timeout_s=1)
    assert sorted(x.reward for x in batch.samples) == [0.0, 1.0]  # B's push won, A's was ignored
    instances = {i["instance_id"]: i for i in c.stats()["instances"]}
    assert instances[b]["samples_pushed"] == 2 and instances[a]["samples_pushed"] == 0


def test_kill9_after_push_loses_no_accepted_sample(tmp_path, dataflow_service, client_for):
    url, proc, _ = dataflow_service(tmp_path, group_size=2)
    c = client_for(url)
    iid = c.register(["policy"], capacity=3)["instance_id"]
    tasks = c.lease(iid, 3)
    sent = {}
    for t, rewards in zip(tasks, ([1.0, 0.0], [0.5, 0.5], [0.0, 1.0])):
        for s in make_samples(t, rewards):
            sent[(s.task_id, s.sample_index)] = s
        assert c.push(iid, t.task_id, make_samples(t, rewards))["accepted"] == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    # the client waits for the service to come back (retries refused connections) ...
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault(
        "batch", c.pull_batch("policy", 6, timeout_s=5)))
    waiter.start()
    port = int(url.rsplit(":", 1)[1])
    url2, proc2, _ = dataflow_service(tmp_path, group_size=2, port=port)  # same state_dir
    waiter.join(timeout=60)
    c2 = client_for(url2)
    # ... and every accepted sample is still there
    batch = result["batch"]
    assert batch is not None and len(batch.samples) == 6
    for s in batch.samples:
        orig = sent[(s.task_id, s.sample_index)]
        assert s.token_ids.tobytes() == orig.token_ids.tobytes()
        assert s.logprobs.tobytes() == orig.logprobs.tobytes()
        assert s.reward == orig.reward
    by_key = {(s.task_id, s.sample_index): s for s in batch.samples}
    assert by_key[(tasks[0].task_id, 0)].advantage == pytest.approx(1.0, abs=1e-4)
    assert by_key[(tasks[0].task_id, 1)].advantage == pytest.approx(-1.0, abs=1e-4)
    assert by_key[(tasks[1].task_id, 0)].advantage == 0.0  # equal rewards: zero advantage
    assert by_key[(tasks[1].task_id, 0)].group_mean == 0.5
    # leases, pushes and the source cursor survived too
    assert c2.push(iid, tasks[0].task_id, make_samples(tasks[0], [1.0, 1.0]))["duplicate"] is True
    [fresh] = c2.lease(iid, 1)
    assert fresh.task_id not in {t.task_id for t in tasks}
    assert model_stats(c2)["samples_accepted"] == 6
    proc2.send_signal(signal.SIGTERM)
    assert proc2.wait(timeout=20) == 0  # clean shutdown on SIGTERM


def test_bad_requests_get_4xx_naming_the_field_and_the_server_keeps_serving(tmp_path,
                                                                            dataflow_service,
                                                                            client_for):
    url, proc, _ = dataflow_service(tmp_path, group_size=2, max_body_bytes=64 * 1024)
    c = client_for(url)
    iid = c.register(["policy"], capacity=1)["instance_id"]
    [task] = c.lease(iid, 1)
    http = httpx.Client(base_url=url, timeout=10)

    def post(path, content):
        r = http.post(path, content=content, headers={"Content-Type": "application/msgpack"})
        return r.status_code, r.json()

    status, err = post("/v1/push", b"\xc1garbage")
    assert status == 422 and err["field"] == "body" and "msgpack" in err["error"]

    status, err = post("/v1/push", b"\x00" * (64 * 1024 + 1))
    assert status == 413 and err["field"] == "body" and "max_body_bytes" in err["error"]

    env = msgpack.unpackb(encode({"instance_id": iid, "task_id": task.task_id,
                                  "samples": make_samples(task, [1.0, 0.0])}), raw=False)
    env["body"]["samples"][1]["reward"] = float("nan")
    status, err = post("/v1/push", msgpack.packb(env, use_bin_type=True))
    assert status == 422 and err["field"] == "body.samples[1].reward"

    env = msgpack.unpackb(encode({"instance_id": iid}), raw=False)
    env["schema"] = 99
    status, err = post("/v1/heartbeat", msgpack.packb(env, use_bin_type=True))
    assert status == 422 and err["field"] == "schema"

    status, err = post("/v1/lease", encode({"instance_id": iid}))
    assert status == 422 and err["field"] == "max_tasks"
    status, err = post("/v1/lease", encode({"instance_id": iid, "max_tasks": "3"}))
    assert status == 422 and err["field"] == "max_tasks"

    with pytest.raises(DataflowError) as info:
        c.push(iid, task.task_id, make_samples(task, [1.0, 0.0], model_id="ghost"))
    assert info.value.status == 422 and info.value.field == "samples[0].model_id"
    assert "ghost" in info.value.message
    with pytest.raises(DataflowError) as info:
        c.pull_batch("ghost", 2, timeout_s=0)
    assert info.value.status == 404 and info.value.field == "model_id"
    with pytest.raises(DataflowError) as info:
        c.register(["ghost"], capacity=1)
    assert info.value.status == 404 and "ghost" in info.value.message
    with pytest.raises(DataflowError) as info:
        c.push(iid, "no-such-task", make_samples(task, [1.0]))
    assert info.value.status == 404 and info.value.field == "task_id"
    with pytest.raises(DataflowError) as info:
        c.push(iid, task.task_id, make_samples(task, [1.0, 0.0], version=7))
    assert info.value.status == 422 and info.value.field == "samples[0].versions"
    with pytest.raises(DataflowError) as info:
        c.pull_batch("policy", 10_000, timeout_s=0)
    assert info.value.status == 422 and info.value.field == "size"
    with pytest.raises(DataflowError) as info:
        c.lease("raas-unknown", 1)
    assert info.value.status == 404 and info.value.field == "instance_id"
    assert http.get("/v1/manifest/policy/notanint").status_code == 422

    # nothing above was accepted, and the server still serves valid requests
    assert proc.poll() is None
    assert c.info()["model_ids"] == ["policy"]
    assert c.push(iid, task.task_id, make_samples(task, [1.0, 0.0])) == {"accepted": 2, "filtered": 0,
                                                                        "duplicate": False}
    assert model_stats(c)["samples_accepted"] == 2
    http.close()


def test_pull_ack_round_trip_and_unacked_batch_is_served_again(tmp_path, dataflow_service,
                                                               client_for):
    url, _, _ = dataflow_service(tmp_path, group_size=2, batch_ack_timeout_s=1.0)
    c = client_for(url)
    iid = c.register(["policy"], capacity=4)["instance_id"]
    tasks = c.lease(iid, 3)
    for t in tasks[:2]:
        c.push(iid, t.task_id, make_samples(t, [1.0, 0.0]))

    first = c.pull_batch("policy", 3, timeout_s=1, trainer_id="trainer-0")
    assert first is not None and len(first.samples) == 3 and first.policy_version == 0
    assert c.pull_batch("policy", 2, timeout_s=0) is None  # exactly `size` or nothing
    c.ack(first.batch_id)
    c.ack(first.batch_id)  # acking twice is harmless

    # a long-poll is answered once the last task's samples arrive
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault(
        "batch", c.pull_batch("policy", 3, timeout_s=30)))
    waiter.start()
    time.sleep(0.3)
    c.push(iid, tasks[2].task_id, make_samples(tasks[2], [0.0, 1.0]))
    waiter.join(timeout=60)
    second = result["batch"]
    assert second is not None and len(second.samples) == 3
    keys = {(s.task_id, s.sample_index) for s in second.samples}

    # never acked: served again after batch_ack_timeout_s, same samples, new batch id
    third = c.pull_batch("policy", 3, timeout_s=30)
    assert third is not None and third.batch_id != second.batch_id
    assert {(s.task_id, s.sample_index) for s in third.samples} == keys
    c.ack(third.batch_id)
    s = model_stats(c)
    assert (s["batches_served"], s["batches_acked"], s["batches_requeued"]) == (3, 2, 1)
    assert (s["samples_acked"], s["queue_depth"], s["batches_outstanding"]) == (6, 0, 0)
    with pytest.raises(DataflowError) as info:
        c.ack("no-such-batch")
    assert info.value.status == 404 and info.value.field == "batch_id"


def test_stale_samples_are_dropped_and_counted(tmp_path, dataflow_service, client_for):
    url, _, _ = dataflow_service(tmp_path, group_size=2, max_staleness=1, queue_order="edf")
    c = client_for(url)
    iid = c.register(["policy"], capacity=4)["instance_id"]
    old, mid = c.lease(iid, 2)
    c.push(iid, old.task_id, make_samples(old, [1.0, 0.0], version=0))
    publish_version(c, 1)
    c.push(iid, mid.task_id, make_samples(mid, [1.0, 0.0], version=1))
    publish_version(c, 2)  # version 0 samples are now 2 behind: stale; version 1 ones are not
    [new] = c.lease(iid, 1)
    c.push(iid, new.task_id, make_samples(new, [0.0, 1.0], version=2))
    batch = c.pull_batch("policy", 4, timeout_s=1)
    assert batch is not None and batch.policy_version == 2
    assert [s.task_id for s in batch.samples] == [mid.task_id] * 2 + [new.task_id] * 2  # EDF
    s = model_stats(c)
    assert (s["stale_dropped"], s["samples_served"], s["queue_depth"]) == (2, 4, 0)
    assert s["current_version"] == 2


def test_weight_upload_publish_download_and_versions_only_move_forward(tmp_path, dataflow_service,
                                                                      client_for):
    url, _, _ = dataflow_service(tmp_path)
    c = client_for(url)
    assert c.current_version("policy") == 0 and c.latest_manifest("policy") is None
    payload = bytes(range(256)) * 1000
    manifest = publish_version(c, 1, payload)
    assert c.current_version("policy") == 1 and c.info()["versions"] == {"policy": 1}
    assert c.latest_manifest("policy") == c.manifest("policy", 1)
    assert c.latest_manifest("policy").files == manifest.files
    assert c.download_weight_file("policy", 1, "model.safetensors") == payload

    # HTTP Range, and a resumed download from a partial file
    r = httpx.get(f"{url}/v1/weights/policy/1/model.safetensors", headers={"Range": "bytes=100-199"})
    assert r.status_code == 206 and r.content == payload[100:200]
    dest = tmp_path / "dl" / "model.safetensors"
    dest.parent.mkdir()
    (dest.parent / "model.safetensors.part").write_bytes(payload[:12345])
    c.download_weight_file_to("policy", 1, "model.safetensors", dest)
    assert dest.read_bytes() == payload

    with pytest.raises(DataflowError) as info:  # equal version
        c.publish(manifest)
    assert info.value.status == 409 and info.value.field == "manifest.version"
    with pytest.raises(DataflowError) as info:  # older version
        c.publish(WeightManifest(model_id="policy", version=0, kind="full", files=manifest.files))
    assert info.value.status == 409
    with pytest.raises(DataflowError) as info:  # published files are immutable
        c.upload_weight_file("policy", 1, "model.safetensors", b"evil")
    assert info.value.status == 409

    c.upload_weight_file("policy", 2, "model.safetensors", b"v2 weights")
    bad = WeightManifest(model_id="policy", version=2, kind="full",
                         files={"model.safetensors": {"sha256": "0" * 64}})
    with pytest.raises(DataflowError) as info:
        c.publish(bad)
    assert info.value.status == 422 and info.value.field == "manifest.files[model.safetensors].sha256"
    missing = WeightManifest(model_id="policy", version=2, kind="full",
                             files={"other.bin": {"sha256": "0" * 64}})
    with pytest.raises(DataflowError) as info:
        c.publish(missing)
    assert info.value.status == 422 and "not uploaded" in info.value.message
    assert c.current_version("policy") == 1  # refused publications changed nothing
    with pytest.raises(DataflowError) as info:
        c.download_weight_file("policy", 2, "model.safetensors")  # not published
    assert info.value.status == 404
    with pytest.raises(DataflowError) as info:
        c.upload_weight_file("policy", 3, "..secret", b"x")
    assert info.value.status == 422 and info.value.field == "name"

    # the client verifies what it downloads against the manifest
    (tmp_path / "state" / "weights" / "policy" / "1" / "model.safetensors").write_bytes(b"corrupt")
    with pytest.raises(DataflowError, match="sha256"):
        c.download_weight_file("policy", 1, "model.safetensors")


def test_eval_tasks_at_version_zero_and_every_n_versions(tmp_path, dataflow_service, client_for):
    url, _, _ = dataflow_service(tmp_path, group_size=2,
                                 eval={"source": EVAL_SOURCE, "every": 2, "k": 2})
    c = client_for(url)
    iid = c.register(["policy"], capacity=8)["instance_id"]
    tasks = c.lease(iid, 5)
    assert [t.kind for t in tasks] == ["eval"] * 3 + ["train"] * 2  # eval leased first
    evals = tasks[:3]
    assert all(t.eval_version == 0 and t.n == 2 and "answer" in t.metadata for t in evals)
    assert len({t.prompt for t in evals}) == 3

    c.push(iid, evals[0].task_id, make_samples(evals[0], [1.0, 0.0]))
    c.push(iid, evals[1].task_id, make_samples(evals[1], [0.0, 0.0]))
    partial = c.eval_results("policy")[0]
    assert partial["complete"] is False and partial["n_reported"] == 2 and partial["n_prompts"] == 3
    c.push(iid, evals[2].task_id, make_samples(evals[2], [1.0, 1.0]))
    r0 = c.eval_results("policy")[0]
    assert r0["complete"] is True and r0["k"] == 2
    assert r0["avg_at_k"] == pytest.approx(3 / 6) and r0["pass_at_k"] == pytest.approx(2 / 3)
    assert (r0["min_version"], r0["max_version"]) == (0, 0)
    s = model_stats(c)
    assert s["queue_depth"] == 0 and s["samples_accepted"] == 0  # eval samples never train
    assert s["eval_samples_accepted"] == 6

    publish_version(c, 1)
    assert c.lease(iid, 1)[0].kind == "train"  # 1 % 2 != 0: no eval
    publish_version(c, 2)
    new_evals = c.lease(iid, 3)
    assert [(t.kind, t.eval_version) for t in new_evals] == [("eval", 2)] * 3
    for t, rewards in zip(new_evals, ([0.0, 0.0], [0.0, 0.25], [1.0, 0.0])):
        c.push(iid, t.task_id, make_samples(t, rewards, gen_versions=[1, 2, 2]))
    results = c.eval_results("policy")
    assert sorted(results) == [0, 2]
    r2 = results[2]
    assert r2["complete"] and r2["pass_at_k"] == pytest.approx(1 / 3)
    assert r2["avg_at_k"] == pytest.approx(1.25 / 6)
    assert (r2["min_version"], r2["max_version"]) == (1, 2)  # versions that generated the tokens
    # a publisher that fell behind skips version 4: version 5 is evaluated in its place
    publish_version(c, 3)
    assert c.lease(iid, 1)[0].kind == "train"
    publish_version(c, 5)
    assert [(t.kind, t.eval_version) for t in c.lease(iid, 3)] == [("eval", 5)] * 3


def test_bearer_token_guards_every_route(tmp_path, dataflow_service, client_for):
    url, _, _ = dataflow_service(tmp_path, token="s3cret")
    assert httpx.get(f"{url}/v1/info").status_code == 401
    r = httpx.get(f"{url}/v1/stats", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["field"] == "authorization"
    assert httpx.post(f"{url}/v1/register", content=encode({"model_ids": ["policy"]})).status_code == 401
    assert httpx.get(f"{url}/v1/weights/policy/1/x").status_code == 401
    assert httpx.get(f"{url}/v1/info", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    good = client_for(url, token="s3cret")
    assert good.info()["schema"] == 1
    assert good.register(["policy"], capacity=1)["instance_id"]
    with pytest.raises(DataflowError) as info:
        client_for(url, token="nope").stats()
    assert info.value.status == 401


def test_a_long_poll_lease_waits_for_room_and_gets_it_when_the_trainer_pulls(
        tmp_path, dataflow_service, client_for):
    """The buffer is full (one task's group of 2 fills max_buffered_samples=2): a plain lease
    answers [], a lease with wait_s stays open and is granted a task once a pull makes room."""
    url, _, _ = dataflow_service(tmp_path, group_size=2, max_buffered_samples=2)
    c = client_for(url)
    iid = c.register(["policy"], capacity=4)["instance_id"]
    [task] = c.lease(iid, 4)
    assert c.push(iid, task.task_id, make_samples(task, [1.0, 0.0]))["accepted"] == 2
    assert c.lease(iid, 4) == []  # no room, answered at once
    waiter = client_for(url)
    out: list = []
    thread = threading.Thread(target=lambda: out.append(waiter.lease(iid, 4, wait_s=120.0)),
                              daemon=True)
    thread.start()
    time.sleep(0.5)  # (lets the lease reach the service first; not needed for correctness)
    assert thread.is_alive()  # no room yet: it waits instead of answering []
    assert c.pull_batch("policy", 2, timeout_s=1) is not None
    thread.join(60)
    assert not thread.is_alive() and len(out[0]) == 1
    assert out[0][0].task_id != task.task_id and out[0][0].kind == "train"
