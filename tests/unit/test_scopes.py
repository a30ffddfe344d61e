"""Scoped credentials of the dataflow app (in-process, FastAPI TestClient): every route against
every scope, trainer tokens bound to a model_id, instances bound to their secret, the
single-token mode unchanged, the token hand-off of the launcher and the autoscaler, and the
process-wide instance secrets that let a RaaS talk through several clients."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from astralight.dataflow import auth
from astralight.dataflow.app import create_app
from astralight.dataflow.auth import Credentials, handoff_env, trainer_token
from astralight.dataflow.client import DataflowClient
from astralight.dataflow.config import DataflowConfig
from astralight.protocol import Sample, WeightManifest, decode, encode
from tests.fakes import app_client

R_TOKEN = "rollout-token-0123456789abcdef"
T_TOKEN = "trainer-token-0123456789abcdef"
A_TOKEN = "admin-token-0123456789abcdefgh"
ALL_TOKEN = "single-token-0123456789abcdef"
ENV = {"ASTRALIGHT_ROLLOUT_TOKEN": R_TOKEN, "ASTRALIGHT_TRAINER_TOKEN": T_TOKEN,
       "ASTRALIGHT_ADMIN_TOKEN": A_TOKEN, "ASTRALIGHT_TOKEN": ALL_TOKEN}
MODELS = ["policy", "other"]
URL = "http://127.0.0.1"
MSGPACK = "application/msgpack"
R, T, A = "rollout", "trainer", "admin"

#: the decision for every route, written out here on its own (not read from auth.ROUTES): a
#: route added to the app without a line here and in auth.ROUTES fails test_every_route_...
EXPECTED = {
    ("GET", "/v1/info"): {R, T, A},
    ("GET", "/v1/stats"): {T, A},
    ("GET", "/v1/eval/{model_id}"): {T, A},
    ("GET", "/v1/eval/{model_id}/{version}/completions"): {T, A},
    ("POST", "/v1/eval"): {T, A},
    ("GET", "/v1/balance/{model_id}"): {T, A},
    ("GET", "/v1/counters/{model_id}"): {T, A},
    ("POST", "/v1/register"): {R, A},
    ("POST", "/v1/heartbeat"): {R, A},
    ("POST", "/v1/instances/{instance_id}/drain"): {R, A},
    ("POST", "/v1/return"): {R, A},
    ("POST", "/v1/deregister"): {R, A},
    ("POST", "/v1/lease"): {R, A},
    ("POST", "/v1/push"): {R, A},
    ("POST", "/v1/push_many"): {R, A},
    ("POST", "/v1/pull"): {T, A},
    ("POST", "/v1/ack"): {T, A},
    ("POST", "/v1/trainer/resumed"): {T, A},
    ("POST", "/v1/batches/extend"): {T, A},
    ("GET", "/v1/version/{model_id}"): {R, T, A},
    ("PUT", "/v1/weights/{model_id}/{version}/{name}"): {T, A},
    ("GET", "/v1/weights/{model_id}/{version}/{name}"): {R, T, A},
    ("POST", "/v1/publish"): {T, A},
    ("GET", "/v1/manifest/{model_id}/latest"): {R, T, A},
    ("GET", "/v1/manifest/{model_id}/{version}"): {R, T, A},
}
#: the callers of the matrix: (name, token, the scope it holds)
CALLERS = [("rollout", R_TOKEN, R), ("trainer", T_TOKEN, T),
           ("trainer bound to policy", trainer_token(T_TOKEN, "policy"), T),
           ("admin", A_TOKEN, A), ("ASTRALIGHT_TOKEN", ALL_TOKEN, A)]


def _group(task_id: str, model_id: str, n: int = 2) -> list[Sample]:
    return [Sample(task_id=task_id, sample_index=i, model_id=model_id,
                   token_ids=np.arange(6, dtype=np.int32) + 3,
                   logprobs=np.array([0, 0, 0, -0.5, -0.5, -0.5], np.float32),
                   loss_mask=np.array([0, 0, 0, 1, 1, 1], np.uint8),
                   versions=np.array([-1, -1, -1, 0, 0, 0], np.int32),
                   reward=float(i % 2), prompt_len=3) for i in range(n)]


class Caller:
    """Requests to the in-process app as one token (and optionally one instance secret)."""

    def __init__(self, http: TestClient, token: str | None, secret: str | None = None):
        self.http, self.token, self.secret = http, token, secret

    def __call__(self, method: str, path: str, body=None, raw: bytes | None = None,
                 headers: dict | None = None, secret: str | None = None):
        hdr = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        content = None
        if body is not None:
            content, hdr["Content-Type"] = encode(body), MSGPACK
        elif raw is not None:
            content, hdr["Content-Type"] = raw, "application/octet-stream"
        if secret or self.secret:
            hdr[auth.INSTANCE_SECRET_HEADER] = secret or self.secret
        hdr.update(headers or {})
        return self.http.request(method, path, content=content, headers=hdr)


def _ok(r) -> dict:
    assert r.status_code == 200, (r.status_code, r.text)
    return r.json() if r.headers["content-type"].startswith("application/json") \
        else decode(r.content)


@pytest.fixture
def flow(tmp_path):
    """The app with scoped tokens, two registered instances (``a`` holding two pushed tasks and
    one open task, ``b`` one open task), a pulled batch per policy and version 1 of policy."""
    cfg = DataflowConfig(state_dir=str(tmp_path / "state"), model_ids=MODELS, group_size=2,
                         lease_seconds=3600, max_inflight_tasks=8)
    app = create_app(cfg, credentials=Credentials.from_env(MODELS, env=ENV))
    with TestClient(app, base_url=URL) as http:
        rollout, admin = Caller(http, R_TOKEN), Caller(http, A_TOKEN)
        ctx = {"http": http, "app": app, "tmp_path": tmp_path, "config": cfg}
        for name in ("a", "b"):
            reply = _ok(rollout("POST", "/v1/register", {"model_ids": MODELS, "capacity": 8,
                                                         "instance_id": f"raas-{name}"}))
            assert reply["instance_id"] == f"raas-{name}" and len(reply["instance_secret"]) >= 32
            ctx[f"secret_{name}"] = reply["instance_secret"]
        tasks = _ok(rollout("POST", "/v1/lease", {"instance_id": "raas-a", "max_tasks": 3},
                            secret=ctx["secret_a"]))["tasks"]
        [task_b] = _ok(rollout("POST", "/v1/lease", {"instance_id": "raas-b", "max_tasks": 1},
                               secret=ctx["secret_b"]))["tasks"]
        assert len(tasks) == 3
        for t in tasks[:2]:
            body = {"instance_id": "raas-a", "task_id": t.task_id,
                    "samples": _group(t.task_id, "policy") + _group(t.task_id, "other")}
            assert _ok(rollout("POST", "/v1/push", body, secret=ctx["secret_a"]))["accepted"] == 4
        ctx.update(pushed=tasks[0].task_id, open_a=tasks[2].task_id, open_b=task_b.task_id)
        for m in MODELS:
            batch = _ok(admin("POST", "/v1/pull", {"model_id": m, "size": 2}))
            ctx[f"batch_{m}"] = batch.batch_id
        data = b"weights v1"
        _ok(admin("PUT", "/v1/weights/policy/1/model.safetensors", raw=data))
        ctx["manifest"] = WeightManifest(model_id="policy", version=1, kind="full", files={
            "model.safetensors": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}})
        _ok(admin("POST", "/v1/publish", ctx["manifest"]))
        yield ctx


def _request(route: tuple[str, str], ctx: dict) -> dict:
    """A well-formed request for ``route`` (aimed at policy and instance raas-a)."""
    method, path = route
    push = {"instance_id": "raas-a", "task_id": ctx["pushed"],
            "samples": _group(ctx["pushed"], "policy")}
    bodies = {
        "/v1/register": {"model_ids": MODELS, "capacity": 8, "instance_id": "raas-a"},
        "/v1/heartbeat": {"instance_id": "raas-a"},
        "/v1/return": {"instance_id": "raas-a", "task_ids": []},
        "/v1/deregister": {"instance_id": "raas-a"},
        "/v1/lease": {"instance_id": "raas-a", "max_tasks": 0},
        "/v1/push": push,
        "/v1/push_many": {"instance_id": "raas-a", "items": [
            {"task_id": push["task_id"], "samples": push["samples"]}]},
        "/v1/pull": {"model_id": "policy", "size": 2, "timeout_s": 0},
        "/v1/ack": {"batch_id": ctx["batch_policy"]},
        "/v1/trainer/resumed": {"model_id": "policy", "step": 0},
        "/v1/batches/extend": {"batch_id": ctx["batch_policy"]},
        "/v1/eval": {"model_id": "policy", "version": 1},
        "/v1/publish": ctx["manifest"],
    }
    filled = (path.replace("{model_id}", "policy").replace("{instance_id}", "raas-a")
              .replace("{name}", "model.safetensors")
              .replace("{version}", "2" if method == "PUT" else "1"))
    if method == "PUT":
        return {"method": method, "path": filled, "raw": b"weights v2"}
    return {"method": method, "path": filled, "body": bodies.get(path)}


def test_every_route_has_a_scope_decision(flow):
    app = flow["app"]
    routes = {(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}
    assert routes == set(EXPECTED), routes ^ set(EXPECTED)  # a new route needs a line here ...
    assert set(auth.ROUTES) == routes, set(auth.ROUTES) ^ routes  # ... and in auth.ROUTES
    for route, rule in auth.ROUTES.items():
        assert rule.scopes | {A} == EXPECTED[route], route


def test_every_route_against_every_scope(flow):
    http = flow["http"]
    for route in sorted(EXPECTED):
        req = _request(route, flow)
        for name, token, scope in CALLERS:
            r = Caller(http, token, flow["secret_a"])(**req)
            where = (name, route, r.status_code, r.text[:300])
            if scope in EXPECTED[route]:
                assert r.status_code not in (401, 403) and r.status_code < 500, where
            else:
                assert r.status_code == 403 and r.json()["field"] == "authorization", where
                error = r.json()["error"]  # names the scopes that may call it, and this one
                assert all(f"{s} " in error.split(";")[0] for s in EXPECTED[route]), where
                assert f"this token has the {scope} scope" in error, where
        for token in (None, "wrong-token-0123456789abcdef", R_TOKEN + "x"):
            r = Caller(http, token)(**req)
            assert r.status_code == 401 and r.json()["field"] == "authorization", (route, token)
    # an unknown path: refused to every scope but admin (404 then)
    for name, token, scope in CALLERS:
        r = Caller(http, token)("GET", "/v1/no-such-route")
        assert r.status_code == (404 if scope == A else 403), (name, r.status_code)


def test_a_trainer_token_bound_to_a_model_id_acts_on_it_only(flow):
    http = flow["http"]
    other = Caller(http, trainer_token(T_TOKEN, "other"))
    refused = [
        ("POST", "/v1/pull", {"model_id": "policy", "size": 2}, "model_id"),
        ("POST", "/v1/ack", {"batch_id": flow["batch_policy"]}, "batch_id"),
        ("POST", "/v1/batches/extend", {"batch_id": flow["batch_policy"]}, "batch_id"),
        ("POST", "/v1/trainer/resumed", {"model_id": "policy", "step": 0}, "model_id"),
        ("POST", "/v1/publish", WeightManifest(model_id="policy", version=2, kind="full",
                                               files={}), "model_id"),
        ("GET", "/v1/eval/policy", None, "model_id"),
        ("GET", "/v1/eval/policy/0/completions", None, "model_id"),
        ("POST", "/v1/eval", {"model_id": "policy", "version": 1}, "model_id"),
        ("GET", "/v1/balance/policy", None, "model_id"),
        ("GET", "/v1/counters/policy", None, "model_id"),
    ]
    for method, path, body, field_name in refused:
        r = other(method, path, body)
        assert r.status_code == 403 and r.json()["field"] == field_name, (path, r.text)
        assert "bound to model_id 'other'" in r.json()["error"]
    r = other("PUT", "/v1/weights/policy/2/model.safetensors", raw=b"x")
    assert r.status_code == 403 and r.json()["field"] == "model_id"
    # nothing happened to policy: its batch is still unacked and extendable by its own trainer
    mine = Caller(http, trainer_token(T_TOKEN, "policy"))
    assert _ok(mine("POST", "/v1/batches/extend", {"batch_id": flow["batch_policy"]}))["extended"]
    assert _ok(mine("POST", "/v1/ack", {"batch_id": flow["batch_policy"]}))["already"] is False
    # ... and the bound token does act on its own model_id
    assert _ok(other("POST", "/v1/ack", {"batch_id": flow["batch_other"]}))["acked"] is True
    assert _ok(other("GET", "/v1/counters/other"))["model_id"] == "other"
    # the unbound trainer token acts on every model_id
    assert _ok(Caller(http, T_TOKEN)("GET", "/v1/eval/policy")) == {}


def test_an_instance_acts_only_with_its_secret(flow):
    http, a, b = flow["http"], flow["secret_a"], flow["secret_b"]
    rollout = Caller(http, R_TOKEN)
    body = {"instance_id": "raas-a", "max_tasks": 0}
    for secret, why in ((None, "missing"), ("x" * 43, "wrong"), (b, "another instance's")):
        for method, path, msg in (("POST", "/v1/heartbeat", {"instance_id": "raas-a"}),
                                  ("POST", "/v1/lease", body),
                                  ("POST", "/v1/return", {"instance_id": "raas-a",
                                                          "task_ids": [flow["open_a"]]}),
                                  ("POST", "/v1/deregister", {"instance_id": "raas-a"}),
                                  ("POST", "/v1/instances/raas-a/drain", None),
                                  ("POST", "/v1/push", {
                                      "instance_id": "raas-a", "task_id": flow["open_a"],
                                      "samples": _group(flow["open_a"], "policy")}),
                                  ("POST", "/v1/push_many", {"instance_id": "raas-a", "items": [
                                      {"task_id": flow["open_a"],
                                       "samples": _group(flow["open_a"], "policy")}]})):
            r = rollout(method, path, msg, secret=secret)
            assert r.status_code == 403 and r.json()["field"] == "instance_secret", (why, path)
            assert auth.INSTANCE_SECRET_HEADER in r.json()["error"]
    stats = _ok(Caller(http, A_TOKEN)("GET", "/v1/stats"))
    inst = {i["instance_id"]: i for i in stats["instances"]}["raas-a"]
    assert inst["state"] == "active" and inst["tasks_returned"] == 0  # nothing happened to it
    assert stats["models"]["policy"]["samples_accepted"] == 4
    # a live instance cannot be registered again without its secret ...
    reg = {"model_ids": MODELS, "capacity": 8, "instance_id": "raas-a"}
    r = rollout("POST", "/v1/register", reg, secret=b)
    assert r.status_code == 403 and r.json()["field"] == "instance_secret"
    # ... with it, it keeps the secret
    assert _ok(rollout("POST", "/v1/register", reg, secret=a))["instance_secret"] == a
    # an instance pushes only the tasks leased to it
    push = {"instance_id": "raas-a", "task_id": flow["open_b"],
            "samples": _group(flow["open_b"], "policy")}
    r = rollout("POST", "/v1/push", push, secret=a)
    assert r.status_code == 409 and r.json()["field"] == "task_id"
    assert "leased to another instance" in r.json()["error"]
    many = {"instance_id": "raas-a", "items": [
        {"task_id": flow["open_b"], "samples": _group(flow["open_b"], "policy")},
        {"task_id": flow["open_a"], "samples": _group(flow["open_a"], "policy")}]}
    out = _ok(rollout("POST", "/v1/push_many", many, secret=a))["results"]
    assert out[0]["status"] == 409 and out[0]["field"] == "task_id"
    assert out[1] == {"status": 200, "reply": {"accepted": 2, "filtered": 0, "duplicate": False}}
    # returning another instance's task returns nothing; b still holds and pushes it
    assert _ok(rollout("POST", "/v1/return", {"instance_id": "raas-a",
                                              "task_ids": [flow["open_b"]]}, secret=a)) == {
        "returned": 0}
    assert _ok(rollout("POST", "/v1/push", {**push, "instance_id": "raas-b"},
                       secret=b))["accepted"] == 2
    # the admin scope acts as any instance without its secret
    assert _ok(Caller(http, A_TOKEN)("POST", "/v1/instances/raas-b/drain"))["state"] == "draining"
    # once an instance has left, its id may be registered again: a new secret, the old one void
    assert _ok(rollout("POST", "/v1/deregister", {"instance_id": "raas-b"}, secret=b))
    fresh = _ok(rollout("POST", "/v1/register", {**reg, "instance_id": "raas-b"}))
    assert fresh["instance_secret"] not in (a, b)
    r = rollout("POST", "/v1/heartbeat", {"instance_id": "raas-b"}, secret=b)
    assert r.status_code == 403
    assert _ok(rollout("POST", "/v1/heartbeat", {"instance_id": "raas-b"},
                       secret=fresh["instance_secret"]))["drain"] is False


def test_an_unknown_or_unbound_instance_is_told_to_register(flow):
    http, core = flow["http"], flow["app"].state.dataflow
    rollout = Caller(http, R_TOKEN)
    r = rollout("POST", "/v1/heartbeat", {"instance_id": "raas-nobody"}, secret="s" * 43)
    assert r.status_code == 404 and r.json()["field"] == "instance_id"  # a RaaS then rejoins
    core.register(MODELS, 2, "raas-legacy", {})  # registered without a secret (older state)
    r = rollout("POST", "/v1/lease", {"instance_id": "raas-legacy", "max_tasks": 1})
    assert r.status_code == 404 and "register it" in r.json()["error"]
    secret = _ok(rollout("POST", "/v1/register", {"model_ids": MODELS, "capacity": 2,
                                                  "instance_id": "raas-legacy"}))["instance_secret"]
    assert _ok(rollout("POST", "/v1/heartbeat", {"instance_id": "raas-legacy"}, secret=secret))


def test_instance_secrets_survive_a_restart_of_the_service(flow):
    secret, cfg = flow["secret_a"], flow["config"]
    flow["http"].__exit__(None, None, None)  # stop the first app (closes its state)
    app = create_app(cfg, credentials=Credentials.from_env(MODELS, env=ENV))
    with TestClient(app, base_url=URL) as http:
        rollout = Caller(http, R_TOKEN)
        r = rollout("POST", "/v1/heartbeat", {"instance_id": "raas-a"}, secret=secret)
        assert r.status_code == 200, r.text
        r = rollout("POST", "/v1/heartbeat", {"instance_id": "raas-a"}, secret=flow["secret_b"])
        assert r.status_code == 403
        # stored as a digest only: the secret itself is nowhere in the state
        db = (flow["tmp_path"] / "state" / "dataflow.db").read_bytes()
        assert secret.encode() not in db
        assert hashlib.sha256(secret.encode()).hexdigest().encode() in db


def test_single_token_mode_grants_every_scope_without_instance_secrets(tmp_path):
    cfg = DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2)
    app = create_app(cfg, token=ALL_TOKEN)  # exactly the behaviour before scopes
    with TestClient(app, base_url=URL) as http:
        c = Caller(http, ALL_TOKEN)
        reply = _ok(c("POST", "/v1/register", {"model_ids": ["policy"], "capacity": 2,
                                               "instance_id": "raas-x"}))
        assert reply["instance_secret"]
        assert _ok(c("POST", "/v1/heartbeat", {"instance_id": "raas-x"}))["drain"] is False
        [task] = _ok(c("POST", "/v1/lease", {"instance_id": "raas-x", "max_tasks": 1}))["tasks"]
        assert _ok(c("POST", "/v1/push", {"instance_id": "raas-x", "task_id": task.task_id,
                                          "samples": _group(task.task_id, "policy")}))[
            "accepted"] == 2
        assert _ok(c("GET", "/v1/stats"))["models"]["policy"]["samples_accepted"] == 2
        assert Caller(http, R_TOKEN)("GET", "/v1/info").status_code == 401


# ----------------------------------------------------------------------------- the client


def _client(http: TestClient, token: str) -> DataflowClient:
    return app_client(http, URL, token)


def _scoped_raas(client_factory, instance_id: str, out: io.StringIO | None = None):
    """A RaaS of one scripted engine (answers "82") reaching the app through ``client_factory``."""
    from astralight.engine import SamplingSpec
    from astralight.raas.config import RaaSConfig
    from astralight.raas.service import RaaSService
    from astralight.rewards.toy import ExactMatchReward
    from astralight.trainer.tinymodel import build_tokenizer
    from astralight.workflows.single_turn import SingleTurnWorkflow
    from tests.unit.engine_fakes import ScriptedEngine

    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(temperature=1.0, max_tokens=4))
    rcfg = RaaSConfig(dataflow=URL, engines={"policy": {"model_path": "unused"}}, workflow=wf,
                      model_ids=["policy"], max_concurrency=2, poll_interval_s=0.0,
                      progress_interval_s=1e9, weight_check_interval_s=3600.0,
                      instance_id=instance_id, heartbeat_interval_s=3600.0)
    return RaaSService(rcfg, client_factory=client_factory,
                       engines={"policy": ScriptedEngine(build_tokenizer(), ["82"], version=0)},
                       out=out or io.StringIO())


def test_the_raas_reaches_a_scoped_dataflow_through_many_clients(tmp_path):
    """What a RaaS does, each step through a client of its own (as its heartbeat, push and
    goodbye threads do): the secret of the registration reaches every one of them."""

    cfg = DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2, lease_seconds=3600)
    app = create_app(cfg, credentials=Credentials.from_env(["policy"], env=ENV))
    with TestClient(app, base_url=URL) as http:
        made: list[DataflowClient] = []

        def factory():
            made.append(_client(http, R_TOKEN))
            return made[-1]

        svc = _scoped_raas(factory, "raas-scoped")
        svc.start()
        try:
            assert svc.run_cycle() == 2  # lease + push (executor threads, clients of their own)
            assert svc.heartbeat_once(factory())["drain"] is False
            svc.leave()  # return what it holds, deregister
        finally:
            svc.close()
        assert len(made) >= 3
        assert all(c.instance_secret("raas-scoped") == made[0].instance_secret("raas-scoped")
                   for c in made)
        stats = _ok(Caller(http, A_TOKEN)("GET", "/v1/stats"))
        assert stats["models"]["policy"]["samples_accepted"] == 4
        [inst] = stats["instances"]
        assert inst["instance_id"] == "raas-scoped" and inst["state"] == "left"
        assert not any(v["auth_failures"] for v in stats["clients"].values())


def test_the_client_reads_its_token_from_a_file_and_refuses_a_blank_one(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text(R_TOKEN + "\n")
    monkeypatch.delenv("ASTRALIGHT_TOKEN", raising=False)
    monkeypatch.setenv("ASTRALIGHT_TOKEN_FILE", str(path))
    with DataflowClient(URL, retry_s=0) as c:
        assert c._http.headers["authorization"] == f"Bearer {R_TOKEN}"
    monkeypatch.setenv("ASTRALIGHT_TOKEN", "   ")
    with pytest.raises(ValueError, match="^ASTRALIGHT_TOKEN: .*empty or whitespace"):
        DataflowClient(URL, retry_s=0)
    with pytest.raises(ValueError, match="^token: .*empty or whitespace"):
        DataflowClient(URL, token=" \t", retry_s=0)


# ----------------------------------------------------------------------------- configuration


def test_credentials_from_the_environment_and_files(tmp_path):
    (tmp_path / "admin").write_text(A_TOKEN + "\n")
    creds = Credentials.from_env(MODELS, env={
        "ASTRALIGHT_ROLLOUT_TOKEN": R_TOKEN, "ASTRALIGHT_TRAINER_TOKEN": T_TOKEN,
        "ASTRALIGHT_ADMIN_TOKEN_FILE": str(tmp_path / "admin")})
    look = lambda t: creds.lookup(f"Bearer {t}".encode())  # noqa: E731
    assert look(R_TOKEN) == auth.Principal(R, source="ASTRALIGHT_ROLLOUT_TOKEN")
    assert look(A_TOKEN).admin and look(T_TOKEN).model_id is None
    assert look(trainer_token(T_TOKEN, "other")).model_id == "other"
    assert look(trainer_token(T_TOKEN, "nobody")) is None  # not a model_id of this service
    assert look(ALL_TOKEN) is None and look("") is None and creds.lookup(None) is None
    assert creds.scoped and not Credentials.single(ALL_TOKEN).scoped
    assert not Credentials.from_env(MODELS, env={}).enabled
    same = Credentials.from_env(MODELS, env={"ASTRALIGHT_TOKEN": A_TOKEN,
                                             "ASTRALIGHT_ADMIN_TOKEN": A_TOKEN})
    assert same.lookup(f"Bearer {A_TOKEN}".encode()).admin  # the same grant twice is fine
    for env, name in (({"ASTRALIGHT_TOKEN": ""}, "ASTRALIGHT_TOKEN"),
                      ({"ASTRALIGHT_ROLLOUT_TOKEN": " \t"}, "ASTRALIGHT_ROLLOUT_TOKEN"),
                      ({"ASTRALIGHT_ADMIN_TOKEN": "two words-0123456789"},
                       "ASTRALIGHT_ADMIN_TOKEN"),
                      ({"ASTRALIGHT_TRAINER_TOKEN_FILE": str(tmp_path / "none")},
                       "ASTRALIGHT_TRAINER_TOKEN_FILE"),
                      ({"ASTRALIGHT_ROLLOUT_TOKEN": R_TOKEN, "ASTRALIGHT_ADMIN_TOKEN": R_TOKEN},
                       "ASTRALIGHT_ADMIN_TOKEN")):
        with pytest.raises(ValueError, match=f"^{name}"):
            Credentials.from_env(MODELS, env=env)


def test_the_token_hand_off_gives_each_process_its_scope():
    base = {**ENV, "PATH": "/bin", "ASTRALIGHT_TOKEN_FILE": "/nowhere"}
    raas = handoff_env(base, R)
    assert raas["ASTRALIGHT_TOKEN"] == R_TOKEN and raas["PATH"] == "/bin"
    assert not {k for k in raas if k.startswith(("ASTRALIGHT_ROLLOUT", "ASTRALIGHT_TRAINER",
                                                 "ASTRALIGHT_ADMIN", "ASTRALIGHT_TOKEN_FILE"))}
    trainer = handoff_env(base, T, "policy")
    assert trainer["ASTRALIGHT_TOKEN"] == trainer_token(T_TOKEN, "policy")
    assert "ASTRALIGHT_TRAINER_TOKEN" not in trainer
    scaler = handoff_env(base, A)
    assert scaler["ASTRALIGHT_TOKEN"] == A_TOKEN
    assert scaler["ASTRALIGHT_ROLLOUT_TOKEN"] == R_TOKEN  # for the RaaS it starts
    assert handoff_env(scaler, R)["ASTRALIGHT_TOKEN"] == R_TOKEN  # (what its backend does)
    assert handoff_env(base, None) == base  # the dataflow gets them all
    single = {"ASTRALIGHT_TOKEN": ALL_TOKEN}
    assert handoff_env(single, R) == single  # no scoped tokens: as before
    # a scope without a token keeps ASTRALIGHT_TOKEN, or is an error naming the variable
    partial = {"ASTRALIGHT_ROLLOUT_TOKEN": R_TOKEN, "ASTRALIGHT_TOKEN": ALL_TOKEN}
    assert handoff_env(partial, T, "policy")["ASTRALIGHT_TOKEN"] == ALL_TOKEN
    with pytest.raises(ValueError, match="^ASTRALIGHT_TRAINER_TOKEN: "):
        handoff_env({"ASTRALIGHT_ROLLOUT_TOKEN": R_TOKEN}, T, "policy")


def test_a_bound_trainer_token_can_be_printed_for_a_trainer_started_by_hand(monkeypatch, capsys):
    monkeypatch.setenv("ASTRALIGHT_TRAINER_TOKEN", T_TOKEN)
    assert auth.main(["trainer-token", "verifier"]) == 0
    assert capsys.readouterr().out.strip() == trainer_token(T_TOKEN, "verifier")
    assert trainer_token(T_TOKEN, "verifier") != trainer_token(T_TOKEN, "policy")
    monkeypatch.delenv("ASTRALIGHT_TRAINER_TOKEN")
    assert auth.main(["trainer-token", "verifier"]) == 2
    assert "ASTRALIGHT_TRAINER_TOKEN: not set" in capsys.readouterr().err


def test_the_launcher_hands_each_component_its_token(tmp_path, monkeypatch):
    from astralight.launch import Component, build_components
    from astralight.launch.recipe import RecipeError

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    env_of = {name: Component(name, ["true"], tmp_path / "x.log").child_env()
              for name in ("dataflow", "raas-0", "trainer-policy", "trainer-other", "autoscale")}
    assert env_of["dataflow"]["ASTRALIGHT_ADMIN_TOKEN"] == A_TOKEN
    assert env_of["raas-0"]["ASTRALIGHT_TOKEN"] == R_TOKEN
    assert "ASTRALIGHT_ADMIN_TOKEN" not in env_of["raas-0"]
    assert env_of["trainer-policy"]["ASTRALIGHT_TOKEN"] == trainer_token(T_TOKEN, "policy")
    assert env_of["trainer-other"]["ASTRALIGHT_TOKEN"] == trainer_token(T_TOKEN, "other")
    assert env_of["autoscale"]["ASTRALIGHT_TOKEN"] == A_TOKEN
    assert auth.admin_token() == A_TOKEN  # the launcher's own progress view
    # a scope left without any token fails the launch before anything starts
    monkeypatch.delenv("ASTRALIGHT_TOKEN")
    monkeypatch.delenv("ASTRALIGHT_TRAINER_TOKEN")
    recipe = {"dataflow": {}, "raas": [{}], "trainers": [{"model": {"init_args": {
        "model_id": "policy"}}}], "stop": {"versions": 1}}
    with pytest.raises(RecipeError, match="trainer-policy: ASTRALIGHT_TRAINER_TOKEN"):
        build_components(recipe, tmp_path, "http://127.0.0.1:1", 1)


# ----------------------------------------------------------------------------- fuzz categories


def access_fuzz_requests(ctx: dict) -> list[tuple[str, dict, int, str]]:
    """Bad requests of the access model, ``(category, request, status, field)``: each must be
    refused with that status naming that field. Categories: ``scope`` (a token of a scope the
    route does not grant), ``instance_secret`` (missing / another instance's), ``foreign_task``
    (a push of a task leased to another instance), ``bound_model`` (a trainer token bound to
    another model_id)."""
    out = []
    for route, scopes in sorted(EXPECTED.items()):
        for name, token, scope in CALLERS:
            if scope not in scopes:
                out.append(("scope", {"token": token, "secret": ctx["secret_a"],
                                      **_request(route, ctx)}, 403, "authorization"))
    for secret in (None, ctx["secret_b"]):
        for path, body in (("/v1/heartbeat", {"instance_id": "raas-a"}),
                           ("/v1/deregister", {"instance_id": "raas-a"}),
                           ("/v1/lease", {"instance_id": "raas-a", "max_tasks": 1})):
            out.append(("instance_secret", {"token": R_TOKEN, "secret": secret, "method": "POST",
                                            "path": path, "body": body}, 403, "instance_secret"))
    out.append(("foreign_task", {"token": R_TOKEN, "secret": ctx["secret_a"], "method": "POST",
                                 "path": "/v1/push", "body": {
                                     "instance_id": "raas-a", "task_id": ctx["open_b"],
                                     "samples": _group(ctx["open_b"], "policy")}}, 409, "task_id"))
    out.append(("bound_model", {"token": trainer_token(T_TOKEN, "other"), "secret": None,
                                "method": "POST", "path": "/v1/pull",
                                "body": {"model_id": "policy", "size": 2}}, 403, "model_id"))
    return out


def test_access_fuzz_categories_are_refused_and_change_nothing(flow):
    http = flow["http"]
    admin = Caller(http, A_TOKEN)
    before = _ok(admin("GET", "/v1/stats"))
    cases = access_fuzz_requests(flow)
    assert {c for c, *_ in cases} == {"scope", "instance_secret", "foreign_task", "bound_model"}
    for category, req, status, field_name in cases:
        req = dict(req)
        caller = Caller(http, req.pop("token"), req.pop("secret"))
        r = caller(**req)
        assert (r.status_code, r.json().get("field")) == (status, field_name), (category, req)
    after = _ok(admin("GET", "/v1/stats"))
    for m in MODELS:
        for key in ("samples_accepted", "batches_acked", "current_version"):
            assert after["models"][m].get(key) == before["models"][m].get(key), (m, key)
    assert [(i["instance_id"], i["state"]) for i in after["instances"]] == \
        [(i["instance_id"], i["state"]) for i in before["instances"]]
    assert after["clients"]["testclient"]["failures_5xx"] == 0


def test_a_raas_restarted_under_its_fixed_id_waits_for_the_old_registration_to_lapse(tmp_path):
    """A RaaS started with a fixed ``instance_id`` and restarted within ``lease_seconds`` has
    lost its secret with its process: the dataflow refuses the new registration while the old
    one is live (403 ``instance_secret``), and the RaaS waits for it to lapse, saying so,
    instead of failing its start."""
    from astralight.dataflow.client import INSTANCE_SECRETS

    cfg = DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2, lease_seconds=3.0)
    app = create_app(cfg, credentials=Credentials.from_env(["policy"], env=ENV))
    with TestClient(app, base_url=URL) as http:
        out = io.StringIO()
        svc = _scoped_raas(lambda: _client(http, R_TOKEN), "raas-fixed", out)
        first = _client(http, R_TOKEN)
        old_secret = first.register(["policy"], 2, instance_id="raas-fixed")["instance_secret"]
        INSTANCE_SECRETS._table.pop((URL, "raas-fixed"))  # the old process, and its secret, died
        svc.start()  # refused, then registered once the old registration lapsed
        try:
            assert svc.instance_id == "raas-fixed"
            new_secret = INSTANCE_SECRETS.get(URL, "raas-fixed")
            assert new_secret and new_secret != old_secret
            assert "still registered and live" in out.getvalue()
            assert svc.run_cycle() == 2  # and it works under its new secret
        finally:
            svc.close()
