"""The dataflow client, its in-process adapter and every scripted fake keep one contract.

:class:`tests.fakes.DataflowAPI` names what the components call on a dataflow client. A method
renamed or a parameter added, renamed or given another default on
:class:`~astralight.dataflow.client.DataflowClient` fails here until the protocol, the adapter
and the fakes follow (compared with :func:`inspect.signature`: names, kinds, defaults). The
adapter is also driven through one session of every call beside a real client talking to the
real app in-process, and must answer the same types and shapes (values such as ids and times
differ).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect

import numpy as np
import pytest
from fastapi.testclient import TestClient

from astralight.dataflow.app import create_app
from astralight.dataflow.client import DataflowClient
from astralight.dataflow.config import DataflowConfig
from astralight.protocol import Batch, WeightManifest
from tests.fakes import (FAKES, PARTS, DataflowAPI, InProcessDataflow, TrainerAPI, app_client,
                         contract_methods)
from tests.unit.batch_ack_flow import GROUP, samples

#: public DataflowClient methods no component calls through the contract, and why
CLIENT_ONLY = {
    "instance_secret": "the secret this process holds for an instance: the client's own state",
}


def parameters(func) -> list[tuple[str, object, object]]:
    """``(name, kind, default)`` of every parameter but ``self`` (annotations left out)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()
            if p.name != "self"]


def drift(cls: type, names: list[str], required: bool = True) -> list[str]:
    """How ``cls`` differs from the contract on ``names`` (missing ones only if ``required``)."""
    out = []
    for name in names:
        impl = getattr(cls, name, None)
        if impl is None:
            if required:
                out.append(f"{cls.__name__}.{name}: missing")
            continue
        contract = getattr(DataflowAPI, name)
        if parameters(impl) != parameters(contract):
            out.append(f"{cls.__name__}.{name}{inspect.signature(impl)}: the contract has "
                       f"{name}{inspect.signature(contract)}")
    return out


def test_the_client_keeps_the_contract():
    assert drift(DataflowClient, contract_methods(DataflowAPI)) == []
    public = {n for n, v in vars(DataflowClient).items() if callable(v) and not n.startswith("_")}
    unclassified = public - set(contract_methods(DataflowAPI)) - set(CLIENT_ONLY)
    assert not unclassified, (f"DataflowClient methods {sorted(unclassified)} are not in "
                              "tests.fakes.DataflowAPI: add them to the part of the callers that "
                              "use them (and to InProcessDataflow), or to CLIENT_ONLY")
    assert "batch_ack_timeout_s" in TrainerAPI.__annotations__
    client = DataflowClient("http://127.0.0.1:1", token="")
    try:
        assert client.batch_ack_timeout_s is None
    finally:
        client.close()


def test_the_adapter_keeps_the_whole_contract(tmp_path):
    assert drift(InProcessDataflow, contract_methods(DataflowAPI)) == []
    assert InProcessDataflow.in_folder(tmp_path).batch_ack_timeout_s is None


def test_every_fake_keeps_the_contract_it_implements():
    assert FAKES, "no fake registered (tests.fakes.dataflow_fake)"
    found = []
    for fake, parts in FAKES.items():
        assert set(parts) <= set(PARTS), fake
        found += drift(fake, contract_methods(*parts))  # its whole parts, exactly
        found += drift(fake, contract_methods(DataflowAPI), required=False)  # anything else
        assert any(hasattr(fake, n) for n in contract_methods(DataflowAPI)), fake
    assert found == []


# ----------------------------------------------------------------------------- same answers


def shape(x):
    """The types of ``x`` all the way down: dict keys, list lengths, dataclass fields, array
    dtypes, an exception's type, status and field; not the values."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in sorted(x.items())}
    if isinstance(x, (list, tuple)):
        return [type(x).__name__] + [shape(v) for v in x]
    if isinstance(x, BaseException):
        return (type(x).__name__, getattr(x, "status", None), getattr(x, "field", None))
    if dataclasses.is_dataclass(x):
        return (type(x).__name__,
                {f.name: shape(getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape)
    return type(x).__name__


def session(api, tmp_path) -> dict:
    """One pass over every call of the contract (refusals included), answers by step."""
    out: dict = {}

    def step(name, call):
        try:
            out[name] = call()
        except Exception as exc:  # noqa: BLE001 - the refusal is the answer compared
            out[name] = exc
        return out[name]

    step("info", api.info)
    iid = step("register", lambda: api.register(["policy"], 4, "raas-a",
                                                {"workflow": "single_turn"},
                                                limits={"policy": {"vocab_size": 96}}))
    iid = iid["instance_id"]  # (a refusal here fails the session at once)
    step("register_other_workflow", lambda: api.register(["policy"], 1, "raas-b",
                                                         {"workflow": "nope"}))
    step("heartbeat", lambda: api.heartbeat(iid, in_flight=0, stats={"weight_pause_s": 1}))
    tasks = step("lease", lambda: api.lease(iid, 3))
    assert len(tasks) == 3, tasks
    first, second, third = tasks[:3]
    step("push", lambda: api.push(iid, first.task_id, samples(first)))
    step("push_again", lambda: api.push(iid, first.task_id, samples(first)))
    step("push_many", lambda: api.push_many(iid, [(second.task_id, samples(second)),
                                                  ("no-such-task", samples(second))]))
    step("push_many_none", lambda: api.push_many(iid, []))
    step("pull_unknown_model", lambda: api.pull_batch("nobody", GROUP, timeout_s=0))
    batch = step("pull_batch", lambda: api.pull_batch("policy", 2 * GROUP, timeout_s=5,
                                                      trainer_id="trainer-0"))
    assert isinstance(batch, Batch) and len(batch.samples) == 2 * GROUP, batch
    out["batch_ack_timeout_s"] = api.batch_ack_timeout_s
    step("pull_nothing", lambda: api.pull_batch("policy", GROUP, timeout_s=0))
    step("extend_batch", lambda: api.extend_batch(batch.batch_id))
    step("ack", lambda: api.ack(batch.batch_id, wait_s=0.5, step_s=1.0, step=1))
    step("ack_again", lambda: api.ack(batch.batch_id))
    step("extend_acked", lambda: api.extend_batch(batch.batch_id))
    step("trainer_resumed", lambda: api.trainer_resumed("policy", 0))
    step("current_version", lambda: api.current_version("policy"))
    step("latest_manifest_none", lambda: api.latest_manifest("policy"))
    data = b"weights of version 1"
    digest = hashlib.sha256(data).hexdigest()
    step("upload_weight_file", lambda: api.upload_weight_file("policy", 1, "model.safetensors",
                                                              data))
    manifest = WeightManifest(model_id="policy", version=1, kind="full",
                              files={"model.safetensors": {"sha256": digest}})
    step("publish", lambda: api.publish(manifest))
    step("current_version_1", lambda: api.current_version("policy"))
    step("latest_manifest", lambda: api.latest_manifest("policy"))
    step("manifest", lambda: api.manifest("policy", 1))
    step("manifest_missing", lambda: api.manifest("policy", 7))
    step("download_weight_file", lambda: api.download_weight_file("policy", 1,
                                                                  "model.safetensors"))
    step("download_not_a_file", lambda: api.download_weight_file("policy", 1, "other.bin"))
    step("download_weight_file_to", lambda: api.download_weight_file_to(
        "policy", 1, "model.safetensors", tmp_path / "model.safetensors").read_bytes())
    step("return_tasks", lambda: api.return_tasks(iid, [third.task_id], failed=True))
    stats = step("stats", api.stats)
    out["stats_client_tables"] = [type(stats.pop(k)).__name__ for k in
                                  ("clients", "client_instances", "clients_evicted")]
    step("balance", lambda: api.balance("policy", window=2, last=1))
    step("balance_bad_last", lambda: api.balance("policy", window=2, last=9))
    step("counters", lambda: api.counters("policy"))
    step("eval_results", lambda: api.eval_results("policy"))
    step("eval_completions", lambda: api.eval_completions("policy", 0, limit=2))
    step("request_eval", lambda: api.request_eval("policy", 1))
    step("unknown_model", lambda: api.counters("nobody"))
    step("drain", lambda: api.drain(iid))
    step("heartbeat_draining", lambda: api.heartbeat(iid))
    step("deregister", lambda: api.deregister(iid))
    return out


def test_the_adapter_answers_what_the_client_answers(tmp_path):
    def config(name):
        return DataflowConfig(state_dir=str(tmp_path / name / "state"), group_size=GROUP,
                              batch_ack_timeout_s=30.0)

    app = create_app(config("http"), token="")
    with TestClient(app, base_url="http://127.0.0.1") as http:  # no token: a loopback Host
        client = app_client(http)  # the real client, its requests answered by the real app
        (tmp_path / "client").mkdir()
        over_http = session(client, tmp_path / "client")
    adapter = InProcessDataflow.in_folder(tmp_path / "adapter", group_size=GROUP,
                                          batch_ack_timeout_s=30.0)
    (tmp_path / "in_process").mkdir()
    try:
        in_process = session(adapter, tmp_path / "in_process")
    finally:
        adapter.close()
    assert list(in_process) == list(over_http)
    differ = {name: (shape(over_http[name]), shape(in_process[name])) for name in over_http
              if shape(over_http[name]) != shape(in_process[name])}
    assert not differ, differ
    assert in_process["register_other_workflow"].status == 409  # the route's workflow check
    assert in_process["download_weight_file"] == over_http["download_weight_file"]
    assert in_process["batch_ack_timeout_s"] == over_http["batch_ack_timeout_s"] == 30.0


@pytest.mark.parametrize("name", ["info", "stats"])
def test_the_adapter_answers_json_routes_with_string_keys(tmp_path, name):
    adapter = InProcessDataflow.in_folder(tmp_path)
    try:
        answer = getattr(adapter, name)()
    finally:
        adapter.close()
    assert all(isinstance(k, str) for k in answer)
