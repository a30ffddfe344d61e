"""Security of the real dataflow service process on loopback: the bearer token on every route,
no public bind without a token, TLS with the client, pickle / extension / oversized payloads
refused, weight files verified before use."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
import torch
import yaml
from fastapi.routing import APIRoute

from astralight.dataflow.app import create_app
from astralight.dataflow.client import DataflowClient, DataflowError
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.service import check_bind, check_tls_files
from astralight.protocol import Sample, WeightManifest, encode
from tests.conftest import free_port

TOKEN = "integration-token-abcdefghijklmnop"
READY = "dataflow serving on "


def _start(tmp_path: Path, token: str | None, wait_ready: bool = True, **overrides):
    """Run ``python -m astralight.dataflow.service`` (ASTRALIGHT_TOKEN only if ``token``);
    returns (url, proc) once the ready line (http or https) is printed."""
    config = {"host": "127.0.0.1", "port": free_port(), "state_dir": str(tmp_path / "state"),
              "log_level": "INFO", "group_size": 2, **overrides}
    cfg = tmp_path / f"dataflow-{config['port']}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("ASTRALIGHT_TOKEN", "ASTRALIGHT_CA_FILE")}
    if token:
        env["ASTRALIGHT_TOKEN"] = token
    log = tmp_path / f"dataflow-{config['port']}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "astralight.dataflow.service", "--config",
                                 str(cfg)], stdout=out, stderr=subprocess.STDOUT, env=env)
    if not wait_ready:
        return log, proc
    deadline = time.monotonic() + 60
    while READY not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"service not ready:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)
    return log.read_text().split(READY, 1)[1].split()[0], proc


@pytest.fixture
def services():
    procs = []

    def start(*a, **kw):
        url, proc = _start(*a, **kw)
        procs.append(proc)
        return url, proc

    yield start
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def _app_routes(tmp_path) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, read from the app itself."""
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "routes")), token="x")
    try:
        return sorted((m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods)
    finally:
        app.state.dataflow.close()


def _fill(path: str) -> str:
    return (path.replace("{model_id}", "policy").replace("{version}", "1")
            .replace("{name}", "model.safetensors").replace("{instance_id}", "nobody"))


def test_every_route_needs_the_right_bearer_token(tmp_path, services):
    routes = _app_routes(tmp_path)
    assert len(routes) >= 20 and ("PUT", "/v1/weights/{model_id}/{version}/{name}") in routes
    url, proc = services(tmp_path, TOKEN)
    wrong = [None, "Bearer wrong", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", TOKEN,
             f"Basic {TOKEN}"]
    with httpx.Client(base_url=url, timeout=10) as http:
        for method, path in routes + [("GET", "/v1/no-such-route")]:
            body = b"x" if method == "PUT" else encode({}) if method == "POST" else None
            for header in wrong:
                headers = {} if header is None else {"Authorization": header}
                r = http.request(method, _fill(path), content=body, headers=headers)
                assert r.status_code == 401, (method, path, header, r.status_code)
                assert r.json()["field"] == "authorization"
                assert r.headers["www-authenticate"] == "Bearer"
            r = http.request(method, _fill(path), content=body,
                             headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code not in (401, 403) and r.status_code < 500, (method, path, r.text)
        stats = http.get("/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    me = stats["clients"]["127.0.0.1"]
    assert me["auth_failures"] == len(wrong) * (len(routes) + 1)
    assert me["failures_5xx"] == 0
    assert proc.poll() is None
    # the client sends the token from its argument or ASTRALIGHT_TOKEN
    with DataflowClient(url, token=TOKEN, retry_s=5) as good:
        assert good.info()["model_ids"] == ["policy"]
    with DataflowClient(url, token="nope", retry_s=5) as bad, pytest.raises(DataflowError) as info:
        bad.current_version("policy")
    assert info.value.status == 401 and info.value.field == "authorization"


def test_a_public_bind_without_a_token_is_refused_before_binding(tmp_path):
    log, proc = _start(tmp_path, None, wait_ready=False, host="0.0.0.0")
    assert proc.wait(timeout=60) == 2
    text = log.read_text()
    assert READY not in text
    assert "'0.0.0.0'" in text and "ASTRALIGHT_TOKEN" in text
    assert "allow_insecure_public_bind" in text


def test_check_bind_rules(caplog):
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        check_bind(host, None)  # loopback: no token needed
    for host in ("0.0.0.0", "::", "10.1.2.3", "dataflow.example.org", ""):
        with pytest.raises(ValueError, match="ASTRALIGHT_TOKEN"):
            check_bind(host, None)
        with pytest.raises(ValueError, match="ASTRALIGHT_TOKEN"):
            check_bind(host, "")
        check_bind(host, TOKEN, tls=True)  # a token makes it acceptable
    with pytest.raises(ValueError, match="ASTRALIGHT_TOKEN: the token is only 5 bytes"):
        check_bind("0.0.0.0", "short", tls=False)  # refused on a public bind, not only warned
    with caplog.at_level(logging.WARNING, logger="astralight.dataflow"):
        check_bind("0.0.0.0", None, allow_insecure_public_bind=True)
        check_bind("0.0.0.0", TOKEN, tls=False)
    text = caplog.text
    assert "WITHOUT a bearer token" in text
    assert "clear text" in text


# ----------------------------------------------------------------------------- TLS


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost signed by it."""
    crypto = pytest.importorskip("cryptography")  # noqa: F841 (installed in this environment)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "astralight test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    ca_file, cert_file, key_file = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    ca_file.write_bytes(ca.public_bytes(pem))
    cert_file.write_bytes(cert.public_bytes(pem))
    key_file.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_file, cert_file, key_file


def _group(task, version: int = 0) -> list[Sample]:
    return [Sample(task_id=task.task_id, sample_index=i, model_id="policy",
                   token_ids=np.arange(6, dtype=np.int32), logprobs=np.array([0, 0, 0, -1, -1, -1],
                                                                           np.float32),
                   loss_mask=np.array([0, 0, 0, 1, 1, 1], np.uint8),
                   versions=np.array([-1, -1, -1, version, version, version], np.int32),
                   reward=float(i), prompt_len=3) for i in range(task.n)]


def test_tls_round_trip_with_the_client(tmp_path, services, monkeypatch):
    ca_file, cert_file, key_file = _certificates(tmp_path)
    url, proc = services(tmp_path, TOKEN, tls_certfile=str(cert_file), tls_keyfile=str(key_file))
    assert url.startswith("https://127.0.0.1:")
    with DataflowClient(url, token=TOKEN, ca_file=str(ca_file), retry_s=10) as c:
        iid = c.register(["policy"], capacity=2)["instance_id"]
        [task] = c.lease(iid, 1)
        assert c.push(iid, task.task_id, _group(task))["accepted"] == 2
        batch = c.pull_batch("policy", 2, timeout_s=0)
        assert batch is not None and len(batch.samples) == 2
        c.ack(batch.batch_id)
        data = b"weights over TLS"
        c.upload_weight_file("policy", 1, "model.safetensors", data)
        c.publish(WeightManifest(model_id="policy", version=1, kind="full", files={
            "model.safetensors": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}))
        assert c.download_weight_file("policy", 1, "model.safetensors") == data
    # the CA from the environment: what RaaS, trainers and callbacks use without any argument
    monkeypatch.setenv("ASTRALIGHT_CA_FILE", str(ca_file))
    monkeypatch.setenv("ASTRALIGHT_TOKEN", TOKEN)
    with DataflowClient(url, retry_s=10) as c:
        assert c.current_version("policy") == 1
    # an untrusted certificate is an immediate error naming ca_file, not a retry loop
    monkeypatch.delenv("ASTRALIGHT_CA_FILE")
    with DataflowClient(url, retry_s=600) as c, pytest.raises(DataflowError) as info:
        c.info()
    assert info.value.field == "ca_file" and info.value.status is None
    # plain HTTP to the TLS port gets no answer from the app
    with pytest.raises(httpx.HTTPError):
        r = httpx.get(url.replace("https://", "http://") + "/v1/info",
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
        r.raise_for_status()
    assert proc.poll() is None


def test_tls_settings_are_checked_before_serving(tmp_path):
    ca_file, cert_file, key_file = _certificates(tmp_path)
    with pytest.raises(ValueError, match="tls_certfile, tls_keyfile: set both"):
        DataflowConfig(state_dir=str(tmp_path / "s"), tls_certfile=str(cert_file))
    with pytest.raises(ValueError, match="^tls_keyfile: .* not a readable file"):
        check_tls_files(DataflowConfig(state_dir=str(tmp_path / "s"), tls_certfile=str(cert_file),
                                       tls_keyfile=str(tmp_path / "missing.key")))
    with pytest.raises(ValueError, match="cannot load"):  # the CA's cert does not match this key
        check_tls_files(DataflowConfig(state_dir=str(tmp_path / "s"), tls_certfile=str(ca_file),
                                       tls_keyfile=str(key_file)))
    with pytest.raises(ValueError, match="^ca_file: "):
        DataflowClient("https://127.0.0.1:1", ca_file=str(tmp_path / "nope.pem"))


# ----------------------------------------------------------------------------- payloads


def test_pickle_extension_and_oversized_payloads_get_a_4xx(tmp_path, services):
    url, proc = services(tmp_path, TOKEN, max_body_bytes=64 * 1024,
                         max_weight_file_bytes=128 * 1024)
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/msgpack"}
    c = DataflowClient(url, token=TOKEN, retry_s=10)
    iid = c.register(["policy"], capacity=1)["instance_id"]
    [task] = c.lease(iid, 1)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "PWNED"),))

    payloads = {
        "pickle": pickle.dumps(Evil()),
        "pickle_in_field": encode({"instance_id": pickle.dumps(Evil()), "max_tasks": 1}),
        "ext_type": msgpack.packb({"schema": 1, "body": {"instance_id": msgpack.ExtType(1, b"x")}}),
        "timestamp": msgpack.packb({"schema": 1, "body": {"x": msgpack.Timestamp(1, 0)}},
                                   datetime=False),
        "object_array": msgpack.packb({"schema": 1, "body": {"x": {
            "__nd__": True, "dtype": "object", "shape": [1],
            "data": pickle.dumps(np.array([Evil()], dtype=object))}}}, use_bin_type=True),
        "oversized": encode({"instance_id": iid}) + bytes(64 * 1024),
    }
    body_routes = [p for m, p in _app_routes(tmp_path) if m == "POST" and "{" not in p]
    assert {"/v1/push", "/v1/push_many", "/v1/publish"} <= set(body_routes)
    with httpx.Client(base_url=url, timeout=10) as http:
        for name, data in payloads.items():
            for path in body_routes:
                r = http.post(path, content=data, headers=auth)
                want = 413 if name == "oversized" else 422
                assert r.status_code == want, (name, path, r.status_code, r.text)
                assert r.json()["field"]
        # a push whose sample arrays are object arrays, and one far over the body limit
        env = msgpack.unpackb(encode({"instance_id": iid, "task_id": task.task_id,
                                      "samples": _group(task)}), raw=False)
        env["body"]["samples"][0]["token_ids"] = {"__nd__": True, "dtype": "O", "shape": [6],
                                                  "data": pickle.dumps([Evil()] * 6)}
        r = http.post("/v1/push", content=msgpack.packb(env, use_bin_type=True), headers=auth)
        assert r.status_code == 422 and r.json()["field"] == "body.samples[0].token_ids.dtype"
        big = encode({"instance_id": iid, "task_id": task.task_id,
                      "samples": _group(task) * 400})
        assert len(big) > 64 * 1024
        assert http.post("/v1/push", content=big, headers=auth).status_code == 413
        # weight uploads: declared too big, and streamed (chunked) too big
        put = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/octet-stream"}
        r = http.put("/v1/weights/policy/1/a.bin", content=bytes(128 * 1024 + 1), headers=put)
        assert r.status_code == 413 and "max_weight_file_bytes" in r.json()["error"]
        r = http.put("/v1/weights/policy/1/b.bin", headers=put,
                     content=iter([bytes(64 * 1024)] * 3))
        assert r.status_code == 413
    assert not (tmp_path / "PWNED").exists()
    assert proc.poll() is None
    # nothing was accepted; the task can still be pushed once with valid samples
    stats = c.stats()
    assert stats["models"]["policy"]["samples_accepted"] == 0
    assert stats["clients"]["127.0.0.1"]["failures_4xx"] >= len(payloads) * len(body_routes) + 4
    assert c.push(iid, task.task_id, _group(task))["accepted"] == 2
    assert not list((tmp_path / "state" / "weights").rglob("*.bin"))  # no partial upload kept
    c.close()


# ----------------------------------------------------------------------------- weights


def test_weight_files_are_verified_before_use(tmp_path, services):
    """The client checks each download against the manifest's sha256, and RaaS applies a version
    only through WeightState, which verifies every file and tensor checksum."""
    from astralight.raas import weight_sync
    from astralight.weights.artifacts import ArtifactBuilder, WeightState, WeightVerificationError

    assert weight_sync.WeightState is WeightState  # the RaaS sync goes through the verifier
    url, _ = services(tmp_path, TOKEN)
    c = DataflowClient(url, token=TOKEN, retry_s=10)
    g = torch.Generator().manual_seed(0)
    art = ArtifactBuilder("policy", full_every=1).build(1, {"w": torch.randn(4, 8, generator=g)})
    for name, data in art.files.items():
        c.upload_weight_file("policy", 1, name, data)
    c.publish(art.manifest)
    [name] = art.files
    stored = tmp_path / "state" / "weights" / "policy" / "1" / name
    tampered = bytearray(stored.read_bytes())
    tampered[-1] ^= 0xFF
    stored.write_bytes(bytes(tampered))  # corrupted at rest (or in transit)
    with pytest.raises(DataflowError) as info:
        c.download_weight_file("policy", 1, name)
    assert info.value.field == "sha256"
    dest = tmp_path / "dl" / name
    dest.parent.mkdir()
    with pytest.raises(DataflowError):
        c.download_weight_file_to("policy", 1, name, dest)
    assert not dest.exists() and not dest.with_name(name + ".part").exists()
    manifest = c.manifest("policy", 1)
    with pytest.raises(WeightVerificationError, match="sha256"):
        WeightState().apply(manifest, {name: bytes(tampered)})
    state = WeightState()
    state.apply(manifest, art.files)  # the genuine bytes pass
    assert state.version == 1
    c.close()
