"""What a web page could do to a dataflow service (in-process app): bodies that are not msgpack
(text/plain, forms, multipart: what a page sends without a CORS preflight) get a 415, requests
with an ``Origin`` a 403, and without a token a ``Host`` that is not loopback or the configured
host a 403 (DNS rebinding); blank tokens are refused, and short ones on a public bind."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from astralight.dataflow.app import create_app
from astralight.dataflow.auth import host_allowed
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.service import check_bind, serve
from astralight.protocol import encode

TOKEN = "browser-guard-token-0123456789"
REGISTER = encode({"model_ids": ["policy"], "capacity": 1, "instance_id": "evil"})
FORM = b"model_ids=policy&capacity=1"
MULTIPART = (b"--x\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n" + REGISTER
             + b"\r\n--x--\r\n")


def _instances(http, headers=None) -> list:
    return http.get("/v1/stats", headers=headers or {}).json()["instances"]


@pytest.fixture
def open_app(tmp_path):
    """No token, loopback (the default)."""
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "state")), token="")
    with TestClient(app, base_url="http://127.0.0.1:8400") as http:
        yield http


def test_a_body_that_is_not_msgpack_gets_a_415(open_app):
    http = open_app
    for ctype, body in (("text/plain", REGISTER), ("text/plain;charset=UTF-8", REGISTER),
                        ("application/x-www-form-urlencoded", FORM),
                        ("multipart/form-data; boundary=x", MULTIPART),
                        ("application/json", b'{"model_ids": ["policy"]}'), (None, REGISTER)):
        headers = {"Content-Type": ctype} if ctype else {}
        r = http.post("/v1/register", content=body, headers=headers)
        assert r.status_code == 415, (ctype, r.status_code, r.text)
        assert r.json()["field"] == "content-type" and "application/msgpack" in r.json()["error"]
    # the same with chunked bodies (no Content-Length)
    r = http.post("/v1/register", content=iter([REGISTER]), headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert _instances(http) == []  # nothing registered
    # weight uploads: raw bytes only
    r = http.put("/v1/weights/policy/1/a.bin", content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/octet-stream" in r.json()["error"]
    ok = http.put("/v1/weights/policy/1/a.bin", content=b"x",
                  headers={"Content-Type": "application/octet-stream"})
    assert ok.status_code == 200, ok.text
    # msgpack is served; a POST without a body needs no type (drain); a declared text type does
    r = http.post("/v1/register", content=REGISTER, headers={"Content-Type": "application/msgpack"})
    assert r.status_code == 200
    assert http.post("/v1/instances/evil/drain").status_code == 200
    r = http.post("/v1/instances/evil/drain", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415


def test_a_request_with_an_origin_is_refused(open_app, tmp_path):
    http = open_app
    for origin in ("http://evil.example", "null", "http://127.0.0.1:8400"):
        r = http.post("/v1/register", content=REGISTER,
                      headers={"Content-Type": "application/msgpack", "Origin": origin})
        assert r.status_code == 403 and r.json()["field"] == "origin", origin
        assert http.get("/v1/stats", headers={"Origin": origin}).status_code == 403
    assert _instances(http) == []
    # with a token too
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "tok")), token=TOKEN)
    with TestClient(app) as tok:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = tok.get("/v1/info", headers={**auth, "Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["field"] == "origin"
        assert tok.get("/v1/info", headers=auth).status_code == 200  # any Host, with a token


def test_without_a_token_only_loopback_or_the_configured_host_is_answered(open_app, tmp_path):
    http = open_app
    for host in ("rebound.evil.example", "rebound.evil.example:8400", "127.0.0.1.evil.example",
                 "10.1.2.3:8400", "localhost.evil.example"):
        r = http.get("/v1/stats", headers={"Host": host})
        assert r.status_code == 403 and r.json()["field"] == "host", host
        assert "127.0.0.1" in r.json()["error"]
    r = http.post("/v1/register", content=REGISTER,
                  headers={"Content-Type": "application/msgpack", "Host": "rebound.evil.example"})
    assert r.status_code == 403 and _instances(http) == []
    for host in ("127.0.0.1", "127.0.0.1:8400", "localhost", "LOCALHOST:8400", "[::1]:8400",
                 "127.0.0.2"):
        assert http.get("/v1/stats", headers={"Host": host}).status_code == 200, host
    stats = http.get("/v1/stats").json()
    assert stats["clients"]["testclient"]["auth_failures"] == 6
    assert stats["clients"]["testclient"]["last_failure"]["field"] == "host"
    # a configured host is answered by its name too
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "named"), host="Dataflow.Lan",
                                    allow_insecure_public_bind=True), token="")
    with TestClient(app, base_url="http://dataflow.lan:8400") as named:
        assert named.get("/v1/info").status_code == 200
        assert named.get("/v1/info", headers={"Host": "evil.example"}).status_code == 403


def test_host_names_a_service_without_a_token_answers():
    assert host_allowed("10.0.0.5:8400", "10.0.0.5")
    assert not host_allowed("10.0.0.6:8400", "10.0.0.5")
    assert host_allowed("192.168.1.9:8400", "0.0.0.0")  # wildcard: any address ...
    assert host_allowed("[fe80::1]:8400", "::")
    assert not host_allowed("evil.example:8400", "0.0.0.0")  # ... but no name (rebinding)
    assert not host_allowed("", "127.0.0.1")


def test_blank_tokens_are_refused_and_short_ones_on_a_public_bind(tmp_path, monkeypatch, caplog):
    cfg = DataflowConfig(state_dir=str(tmp_path / "state"))
    for blank in (" ", "\t\n"):
        with pytest.raises(ValueError, match="^ASTRALIGHT_TOKEN: .*empty or whitespace"):
            create_app(cfg, token=blank)
        monkeypatch.setenv("ASTRALIGHT_TOKEN", blank)
        with pytest.raises(ValueError, match="^ASTRALIGHT_TOKEN: .*empty or whitespace"):
            serve(cfg)  # refused before anything binds
    monkeypatch.setenv("ASTRALIGHT_TOKEN", "")  # set but empty: refused too (not "no auth")
    with pytest.raises(ValueError, match="^ASTRALIGHT_TOKEN: "):
        serve(cfg)
    monkeypatch.delenv("ASTRALIGHT_TOKEN")
    monkeypatch.setenv("ASTRALIGHT_ROLLOUT_TOKEN", "short-rollout")
    with pytest.raises(ValueError, match="^ASTRALIGHT_ROLLOUT_TOKEN: the token is only 13 bytes"):
        serve(DataflowConfig(state_dir=str(tmp_path / "state"), host="0.0.0.0"))
    for short in ("x", "a" * 15):
        with pytest.raises(ValueError, match="^ASTRALIGHT_TOKEN: .* at least 16"):
            check_bind("0.0.0.0", short, tls=True)
    with caplog.at_level(logging.WARNING, logger="astralight.dataflow"):
        check_bind("10.1.2.3", "a" * 16, tls=True)  # 16 bytes: accepted
        check_bind("127.0.0.1", "x")  # loopback: any length
    assert not caplog.records
