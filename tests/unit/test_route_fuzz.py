"""Fuzzing every route of the dataflow app in-process (FastAPI TestClient, no network).

Hypothesis drives the bad-request generators of ``tests/benchmarks/bench_fuzz.py`` (garbage,
malformed msgpack, wrong types, unknown fields, huge arrays, negative sizes, unknown model_ids,
replayed pushes, out-of-order versions, pickle / extension types / object arrays, oversized
bodies, bad paths, bad samples, missing or wrong tokens, the drills of issue 18, and its access
model: scopes, instance secrets, foreign tasks, ``Origin`` headers, bodies that are not msgpack)
plus its own arbitrary msgpack values. The app has scoped tokens next to ``ASTRALIGHT_TOKEN``
and two registered instances. Properties: never a 5xx; a bad request is never answered 2xx (a
replayed push is answered ``duplicate`` with nothing accepted); an access request gets exactly
its status and field (403 ``authorization``, 403 ``instance_secret``, 409 ``task_id``, 403
``origin``, 415 ``content-type``); the app still answers ``/v1/info`` afterwards and its counters
and instances show nothing was accepted. A few hundred examples here (seconds); the benchmark
sends 10,000 to a real service process.
"""

from __future__ import annotations

import builtins
import pickle
import random
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astralight.dataflow import auth
from astralight.dataflow.app import create_app
from astralight.dataflow.auth import Credentials
from astralight.dataflow.config import DataflowConfig
from tests.benchmarks import bench_fuzz as fz

TOKEN = "unit-fuzz-token-0123456789"
SCOPED = {auth.ROLLOUT: "unit-fuzz-rollout-0123456789",
          auth.TRAINER: "unit-fuzz-trainer-0123456789",
          auth.ADMIN: "unit-fuzz-admin-0123456789"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """One app (``ASTRALIGHT_TOKEN`` and the scoped tokens, small limits) and the state the
    generators aim at."""
    state = tmp_path_factory.mktemp("fuzz") / "state"
    cfg = DataflowConfig(state_dir=str(state), group_size=2, lease_seconds=3600,
                         max_body_bytes=64 * 1024, max_weight_file_bytes=256 * 1024)
    env = {"ASTRALIGHT_TOKEN": TOKEN, **{auth.SCOPE_VARS[s]: t for s, t in SCOPED.items()}}
    app = create_app(cfg, credentials=Credentials.from_env(cfg.model_ids, env=env))
    with TestClient(app, raise_server_exceptions=False) as http:
        ctx = fz.prepare(http, token=TOKEN, max_body_bytes=cfg.max_body_bytes,
                         max_weight_file_bytes=cfg.max_weight_file_bytes, scoped=SCOPED)
        assert ctx.scoped and fz.available(ctx) == sorted(fz.CATEGORIES)
        yield app, http, ctx


def _model(http, ctx) -> dict:
    return http.get("/v1/stats", headers=ctx.auth()).json()["models"][ctx.model_id]


def _check(http, ctx, req: fz.BadRequest) -> fz.Outcome:
    out = fz.send(http, req, ctx, timeout=None)
    where = f"{req.category} {req.method} {req.path[:100]} -> {out.status} {out.detail}"
    assert out.status is not None and out.status < 500, where
    assert not out.accepted_bad, where
    assert 400 <= out.status < 500 or req.replay, where
    assert not out.unexpected, where  # an access request: exactly its status and field
    return out


def test_every_route_of_the_app_is_fuzzed(service):
    """A route added to the app without generators in bench_fuzz.ROUTES fails here."""
    app, _, _ = service
    routes = {(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}
    assert routes == set(fz.ROUTES), (routes ^ set(fz.ROUTES))
    for route, categories in fz.ROUTES.items():
        assert categories and set(categories) <= set(fz.CATEGORIES), route
    listed = {c for categories in fz.ROUTES.values() for c in categories}
    assert listed == set(fz.CATEGORIES), set(fz.CATEGORIES) - listed  # each names its routes


@pytest.mark.parametrize("category", sorted(fz.ACCESS_ROUTES))
def test_access_categories_reach_the_routes_they_list_and_no_other(service, category):
    """The access categories of issue 18 send to exactly the routes ROUTES lists them under
    (``origin`` and ``scope`` to every route they can reach), each with the status it must get."""
    _, _, ctx = service
    rng = random.Random(11)
    reached = set()
    for _ in range(400):
        req = fz.generate(rng, ctx, category)
        found = auth.route_rule(req.method, req.path.split("?", 1)[0])
        assert found is not None, (category, req.method, req.path)
        reached.add((req.method, found[0]))
        assert req.expect in (403, 409, 415) and req.expect_field, req
    listed = {route for route, cats in fz.ROUTES.items() if category in cats}
    assert reached == listed, (reached ^ listed)
    if category == "scope":  # every route but the five every scope may read
        assert len(listed) == len(fz.ROUTES) - 5


def test_without_scoped_tokens_the_scoped_categories_are_left_out(service):
    _, _, ctx = service
    single = fz.Context(**{**ctx.__dict__, "rollout_token": "", "trainer_token": ""})
    assert set(fz.available(ctx)) - set(fz.available(single)) == set(fz.SCOPED_CATEGORIES)
    assert {"origin", "content_type"} <= set(fz.available(single))
    rng = random.Random(5)
    assert all(fz.generate(rng, single).category not in fz.SCOPED_CATEGORIES
               for _ in range(300))


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(category=st.sampled_from(sorted(fz.CATEGORIES)), seed=st.integers(0, 2**32 - 1))
def test_generated_bad_requests_are_refused_with_a_4xx(service, category, seed):
    _, http, ctx = service
    _check(http, ctx, fz.generate(random.Random(seed), ctx, category))


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(fz.BODY_ROUTES), data=st.binary(max_size=512))
def test_arbitrary_bytes_are_refused(service, path, data):
    _, http, ctx = service
    if data[:1] and (0x80 <= data[0] <= 0x8f or data[0] in (0xde, 0xdf)):
        data = b"\xc1" + data  # keep it garbage: a random map could in principle be a request
    _check(http, ctx, fz.BadRequest("hypothesis_bytes", "POST", path, data, dict(fz.MSGPACK)))


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(sorted(fz.SCHEMAS)), data=st.data())
def test_arbitrary_values_in_known_fields_never_cause_a_5xx(service, path, data):
    """Random msgpack values in each route's own fields: a 4xx, or a 2xx only for a request that
    is in fact valid (then nothing may have been accepted from an unknown task or instance)."""
    _, http, ctx = service
    body = data.draw(st.fixed_dictionaries({}, optional={k: plain for k in fz.SCHEMAS[path]}))
    r = http.post(path, content=msgpack.packb({"schema": 1, "body": body}, use_bin_type=True),
                  headers={**fz.MSGPACK, **ctx.auth()})
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code < 300:  # random values cannot name the open task or the instance
        assert path in ("/v1/register", "/v1/pull"), (path, body, r.text)


def test_state_after_fuzzing_shows_nothing_accepted_and_the_app_answers(service):
    _, http, ctx = service
    stats = lambda: http.get("/v1/stats", headers=ctx.auth()).json()  # noqa: E731
    state = fz.state_of(stats(), ctx.model_id)
    before = _model(http, ctx)
    for iid in (ctx.instance_id, ctx.other_instance):
        assert state[f"instances.{iid}"]["state"] == "active", state
    rng = random.Random(7)
    for i in range(300):
        _check(http, ctx, fz.generate(rng, ctx, sorted(fz.CATEGORIES)[i % len(fz.CATEGORIES)]))
    after = _model(http, ctx)
    assert http.get("/v1/info", headers=ctx.auth()).status_code == 200
    assert fz.state_changes(state, fz.state_of(stats(), ctx.model_id)) == {}
    assert after["samples_accepted"] == before["samples_accepted"]
    assert after["current_version"] == ctx.version
    assert after["duplicates_ignored"] > before["duplicates_ignored"]  # replays were seen as such
    # the second instance still holds its task and its secret: it pushes it once
    push = fz.push_env(ctx, fz.valid_group(ctx, ctx.other_task), ctx.other_task)
    push["body"]["instance_id"] = ctx.other_instance
    r = http.post("/v1/push", content=fz.pack(push),
                  headers={**fz.MSGPACK, "Authorization": f"Bearer {ctx.rollout_token}",
                           auth.INSTANCE_SECRET_HEADER: ctx.other_secret})
    assert r.status_code == 200 and msgpack.unpackb(r.content)["body"]["accepted"] == 2, r.text
    # the open task can still be pushed once, with valid samples
    r = http.post("/v1/push", content=fz.pack(fz.push_env(ctx, fz.valid_group(ctx))),
                  headers={**fz.MSGPACK, **ctx.auth()})
    assert r.status_code == 200 and msgpack.unpackb(r.content)["body"]["accepted"] == 2


def test_client_failures_are_counted_per_address_and_instance(tmp_path):
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "s")), token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}", **fz.MSGPACK}
    with TestClient(app) as http:
        iid = msgpack.unpackb(http.post("/v1/register", content=fz.pack(fz.envelope(
            {"model_ids": ["policy"], "capacity": 1})), headers=auth).content)["body"]["instance_id"]
        assert http.get("/v1/info").status_code == 401
        assert http.get("/v1/info", headers={"Authorization": "Bearer nope"}).status_code == 401
        r = http.post("/v1/heartbeat", content=fz.pack(fz.envelope(
            {"instance_id": iid, "in_flight": -3})), headers=auth)
        assert r.status_code == 422
        assert http.post("/v1/lease", content=b"\xc1", headers=auth).status_code == 422
        stats = http.get("/v1/stats", headers=auth).json()
    me = stats["clients"]["testclient"]
    assert me["requests"] == 5 and me["failures_4xx"] == 4  # this stats call is counted after and me["auth_failures"] == 2
    assert me["failures_5xx"] == 0 and me["failures_last_60s"] == 4
    assert me["last_failure"]["path"] == "/v1/lease" and me["last_failure"]["field"] == "body"
    inst = stats["client_instances"][iid]
    assert inst["requests"] == 1 and inst["failures_4xx"] == 1
    assert inst["last_failure"]["field"] == "in_flight"


def test_client_table_is_bounded():
    from astralight.dataflow.app import ClientTracker

    t = ClientTracker(max_entries=3)
    for i in range(10):
        t.record("10.0.0.1", f"made-up-{i}", 404, "POST", "/v1/lease", "instance_id", now=100.0 + i)
    snap = t.snapshot(now=110.0)
    assert list(snap["instance"]) == ["made-up-7", "made-up-8", "made-up-9"]
    assert snap["evicted"] == 7 and snap["address"]["10.0.0.1"]["failures_4xx"] == 10
    assert t.snapshot(now=500.0)["address"]["10.0.0.1"]["failures_last_60s"] == 0


def test_no_route_unpickles_or_evaluates_client_data(service, monkeypatch):
    """Runtime: pickle loaders, eval and exec are trapped while pickle payloads, object arrays
    and extension types hit every body route; none is called and every request gets a 4xx."""
    _, http, ctx = service
    calls = []

    def trap(name, real=None):
        def f(*a, **k):
            calls.append(name)
            if real is not None:
                return real(*a, **k)
            raise AssertionError(f"{name} called while serving a request")
        return f

    monkeypatch.setattr(pickle, "loads", trap("pickle.loads"))
    monkeypatch.setattr(pickle, "load", trap("pickle.load"))
    monkeypatch.setattr(pickle, "Unpickler", trap("pickle.Unpickler"))
    monkeypatch.setattr(np, "load", trap("numpy.load"))
    monkeypatch.setattr(builtins, "eval", trap("eval", builtins.eval))
    monkeypatch.setattr(builtins, "exec", trap("exec", builtins.exec))
    rng = random.Random(3)
    for path in fz.BODY_ROUTES:
        for blob in (pickle.dumps({"instance_id": "x"}), fz.pickle_blob(rng)):
            _check(http, ctx, fz.BadRequest("pickle", "POST", path, blob, dict(fz.MSGPACK)))
        for _ in range(6):
            req = fz.gen_pickle(rng, ctx)
            _check(http, ctx, fz.BadRequest(req.category, "POST", path, req.body, req.headers))
    monkeypatch.undo()
    assert calls == []


_FORBIDDEN = [
    (re.compile(r"\bpickle\.(loads?|Unpickler)\b|^\s*(import|from)\s+(c?pickle|dill|cloudpickle|shelve|marshal)\b",
                re.M), "pickle-style deserialisation"),
    (re.compile(r"(?<![.\w])(eval|exec)\s*\("), "eval/exec"),
    (re.compile(r"(?<![\w.])torch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
    (re.compile(r"yaml\.load\((?![^)]*Loader\s*=\s*yaml\.SafeLoader)"), "yaml.load without SafeLoader"),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy allow_pickle=True"),
]


@pytest.mark.parametrize("folder", ["astralight/dataflow", "astralight/weights", "raas",
                                    "callbacks", "datamodules"])
def test_no_deserialisation_of_code_on_the_service_and_weight_paths(folder):
    """Static: the service, the weight store/codec, RaaS and the trainer-side helpers neither
    unpickle nor evaluate anything (astralight/protocol.py is checked too)."""
    files = sorted((REPO / folder).rglob("*.py"))
    if folder == "astralight/dataflow":
        files.append(REPO / "astralight/protocol.py")
    assert files
    found = []
    for f in files:
        text = f.read_text()
        for pattern, what in _FORBIDDEN:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{f.relative_to(REPO)}:{line}: {what}")
    assert not found, found
