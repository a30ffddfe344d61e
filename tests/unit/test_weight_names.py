"""The weight store's file names and versions (issue 18, defects 1, 4 and 5): a long or odd name
is a 422 naming the field, never a 500; one manifest cannot move a policy to a version no
trainer reaches; the temp file of an upload a kill -9 interrupted is removed at the next start."""

from __future__ import annotations

import asyncio
import errno
import hashlib

import pytest
from fastapi.testclient import TestClient

from astralight.dataflow import weightfiles
from astralight.dataflow.app import create_app
from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.weightfiles import MAX_FILE_NAME_BYTES, WeightFiles, check_file_name
from astralight.protocol import WeightManifest, encode
from tests.unit.dataflow_fakes import publish

TOKEN = "weight-names-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
UPLOAD = {**AUTH, "Content-Type": "application/octet-stream"}
MSGPACK = {**AUTH, "Content-Type": "application/msgpack"}


async def _chunks(*parts: bytes):
    for p in parts:
        yield p


def _flow(tmp_path, **kw) -> Dataflow:
    return Dataflow(DataflowConfig(state_dir=str(tmp_path / "state"), **kw))


# ----------------------------------------------------------------------------- defect 1


@pytest.mark.parametrize("name", ["a" * 218, "a" * 255, "é" * 128, "😀" * 64])
def test_names_longer_than_the_byte_bound_are_a_422_naming_the_field(name):
    """218..255 ASCII characters, or more than 255 UTF-8 bytes in fewer characters: the
    temporary upload name would exceed the file system's 255 bytes (it was an ENAMETOOLONG 500)."""
    assert len(name.encode()) > MAX_FILE_NAME_BYTES
    with pytest.raises(ServiceError) as info:
        check_file_name(name, "manifest.files[x]")
    assert info.value.status == 422 and info.value.field == "manifest.files[x]"
    assert f"{MAX_FILE_NAME_BYTES} bytes" in info.value.message


def test_the_longest_allowed_name_uploads_and_publishes(tmp_path):
    """A name of exactly MAX_FILE_NAME_BYTES bytes fits, temp name included."""
    flow = _flow(tmp_path)
    name = "b" * MAX_FILE_NAME_BYTES
    flow.check_upload("policy", 1, name)
    tmp, sha, size = asyncio.run(flow.weights.receive("policy", 1, name, _chunks(b"w1"), 1 << 20))
    flow.commit_upload(tmp, "policy", 1, name, sha)
    out = flow.publish(WeightManifest(model_id="policy", version=1, kind="full",
                                      files={name: {"sha256": sha, "bytes": size}}))
    assert out["version"] == 1 and flow.weight_file("policy", 1, name)[0].read_bytes() == b"w1"
    flow.close()


@pytest.mark.parametrize("name", ["a\nb", "a\rb", "tab\there", "nul\x00", "del\x7f", "c1\x85x"])
def test_control_characters_in_a_name_are_refused(tmp_path, name):
    flow = _flow(tmp_path)
    with pytest.raises(ServiceError) as info:
        flow.check_upload("policy", 1, name)
    assert info.value.status == 422 and info.value.field == "name"
    assert "control characters" in info.value.message
    assert not (tmp_path / "state" / "weights" / "policy" / "1").exists()  # nothing created
    flow.close()


def test_over_long_upload_and_publish_over_http_are_4xx_and_the_connection_stays(tmp_path):
    """The drill's requests: PUT of a 218-character name, and a publish whose manifest names a
    file of more than 255 bytes (stat() raised ENAMETOOLONG), through the app. Both are a 422
    naming the field, and the same client keeps being served."""
    app = create_app(DataflowConfig(state_dir=str(tmp_path / "state")), token=TOKEN)
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as http:
        r = http.put(f"/v1/weights/policy/10/{'a' * 218}", content=b"weights", headers=UPLOAD)
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "name" and "bytes" in r.json()["error"]
        r = http.put("/v1/weights/policy/10/a%0Ab", content=b"weights", headers=UPLOAD)
        assert r.status_code == 422 and "control characters" in r.json()["error"], r.text
        long = "é" * 200  # 400 bytes in 200 characters: within the protocol's name length
        manifest = WeightManifest(model_id="policy", version=1, kind="full",
                                  files={long: {"sha256": "0" * 64, "bytes": 1}})
        r = http.post("/v1/publish", content=encode(manifest), headers=MSGPACK)
        assert r.status_code == 422, r.text
        assert r.json()["field"].startswith("manifest.files[")
        assert http.get("/v1/info", headers=AUTH).status_code == 200
    assert not list((tmp_path / "state" / "weights").rglob("*.tmp"))


def test_a_file_system_error_on_publish_is_a_4xx_or_507_not_a_500(tmp_path, monkeypatch):
    """Whatever stat() raises: a name the file system refuses is the request's 422, anything
    else the store's 507, each naming a field."""
    flow = _flow(tmp_path)
    manifest = WeightManifest(model_id="policy", version=1, kind="full",
                              files={"model.safetensors": {"sha256": "0" * 64}})
    real_stat = weightfiles.Path.stat

    for code, status, field in ((errno.ENAMETOOLONG, 422, "manifest.files[model.safetensors]"),
                                (errno.EACCES, 507, "disk"), (errno.EIO, 507, "disk")):
        def stat(self, *a, _code=code, **kw):
            if self.name == "model.safetensors":
                raise OSError(_code, "refused")
            return real_stat(self, *a, **kw)

        monkeypatch.setattr(weightfiles.Path, "stat", stat)
        with pytest.raises(ServiceError) as info:
            flow.publish(manifest)
        assert (info.value.status, info.value.field) == (status, field)
    monkeypatch.setattr(weightfiles.Path, "stat", real_stat)
    flow.close()


def test_a_file_system_error_during_an_upload_is_a_422_naming_the_name(tmp_path, monkeypatch):
    """An ENAMETOOLONG the byte bound does not foresee (a file system with a shorter NAME_MAX)
    is still a 422 naming ``name``, and no temp file stays."""
    files = WeightFiles(tmp_path / "weights")

    def refuse(*a, **kw):
        raise OSError(errno.ENAMETOOLONG, "File name too long")

    monkeypatch.setattr(weightfiles, "open", refuse, raising=False)
    with pytest.raises(ServiceError) as info:
        asyncio.run(files.receive("policy", 1, "model.safetensors", _chunks(b"x"), 1 << 20))
    assert (info.value.status, info.value.field) == (422, "name")
    assert not list((tmp_path / "weights").rglob("*.tmp"))


# ----------------------------------------------------------------------------- defect 4


def test_a_version_far_ahead_is_refused_naming_the_field_and_the_fix(tmp_path):
    """2^53-1 was accepted and locked the policy (every later publish 409, every sample stale)."""
    flow = _flow(tmp_path, max_version_jump=5)
    data = b"w"
    digest = hashlib.sha256(data).hexdigest()
    for version in (2 ** 53 - 1, 7):
        with pytest.raises(ServiceError) as info:
            flow.publish(WeightManifest(model_id="policy", version=version, kind="full",
                                        files={"model.safetensors": {"sha256": digest}}))
        assert (info.value.status, info.value.field) == (422, "manifest.version")
        assert "max_version_jump=5" in info.value.message
        with pytest.raises(ServiceError) as info:  # no file can even be stored for it
            flow.check_upload("policy", version, "model.safetensors")
        assert (info.value.status, info.value.field) == (422, "version")
    assert flow.current_version("policy") == 0
    publish(flow, 5)  # a jump within the bound (a publisher that fell behind) is fine
    publish(flow, 6)  # and the next one still is: nothing is locked
    assert flow.current_version("policy") == 6
    flow.close()


def test_max_version_jump_is_validated_and_defaults_to_a_documented_bound():
    assert DataflowConfig().max_version_jump == 1000
    with pytest.raises(ValueError, match="max_version_jump: must be an int >= 1"):
        DataflowConfig(max_version_jump=0)


# ----------------------------------------------------------------------------- defect 5


def test_a_temp_file_left_by_a_killed_upload_is_removed_at_start(tmp_path):
    """A kill -9 mid-upload leaves ``.{name}.{uuid}.tmp``; it survived restarts and later
    uploads. The next start removes it (and only it)."""
    flow = _flow(tmp_path)
    publish(flow, 1)
    flow.close()
    version_dir = tmp_path / "state" / "weights" / "policy" / "2"
    version_dir.mkdir(parents=True)
    left = version_dir / f".model.safetensors.{'a' * 32}.tmp"
    left.write_bytes(b"half an upload")
    kept = tmp_path / "state" / "weights" / "policy" / "1" / "model.safetensors"
    assert kept.is_file()
    again = _flow(tmp_path)
    assert not left.exists()
    assert kept.is_file() and again.weight_file("policy", 1, "model.safetensors")[0] == kept
    again.close()
