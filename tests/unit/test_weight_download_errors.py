"""``GET /v1/weights/{model_id}/{version}/{name}`` on a weight store that fails: a file system
error other than a missing file (permission denied, an I/O error, a name the file system
refuses) is answered like the upload and publish routes answer it
(:func:`astralight.dataflow.weightfiles.fs_error`: 507 naming the weight store, 422 naming the
name), never a 500 -- and never a 200 whose body then breaks off. A missing file stays 410."""

from __future__ import annotations

import builtins
import errno
import hashlib
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from astralight.dataflow.app import create_app
from astralight.dataflow.config import DataflowConfig
from astralight.protocol import WeightManifest, encode

TOKEN = "download-errors-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NAME = "model.safetensors"
DATA = b"weights of version 1"
URL = f"/v1/weights/policy/1/{NAME}"


@pytest.fixture
def served(tmp_path):
    """The app with version 1 of policy published (one file), and that file's path."""
    cfg = DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2)
    app = create_app(cfg, token=TOKEN)
    with TestClient(app, raise_server_exceptions=False) as http:
        r = http.put(URL, content=DATA,
                     headers={**AUTH, "Content-Type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        m = WeightManifest(model_id="policy", version=1, kind="full", files={
            NAME: {"sha256": hashlib.sha256(DATA).hexdigest(), "bytes": len(DATA)}})
        r = http.post("/v1/publish", content=encode(m),
                      headers={**AUTH, "Content-Type": "application/msgpack"})
        assert r.status_code == 200, r.text
        path = tmp_path / "state" / "weights" / "policy" / "1" / NAME
        assert path.read_bytes() == DATA
        yield http, path


def _failing(monkeypatch, target: Path, exc: OSError, where: str) -> None:
    """Make ``os.stat`` (what ``Path.stat``/``is_file`` and FileResponse call) or ``open`` of
    ``target`` raise ``exc``; every other path is untouched."""
    target = os.fspath(target)
    real = {"stat": os.stat, "open": builtins.open}[where]

    def fake(path, *args, **kwargs):
        if isinstance(path, (str, os.PathLike)) and os.fspath(path) == target:
            raise exc
        return real(path, *args, **kwargs)

    if where == "stat":
        monkeypatch.setattr(os, "stat", fake)
    else:
        monkeypatch.setattr(builtins, "open", fake)


def _still_serving(http, answered_507: int) -> None:
    """The app answers, and its only 5xx answers were the 507s (no 500 among them)."""
    assert http.get("/v1/info", headers=AUTH).status_code == 200
    me = http.get("/v1/stats", headers=AUTH).json()["clients"]["testclient"]
    assert me["failures_5xx"] == answered_507, me


@pytest.mark.parametrize("where", ["stat", "open"])
@pytest.mark.parametrize("exc", [PermissionError(errno.EACCES, "Permission denied"),
                                 OSError(errno.EIO, "Input/output error")],
                         ids=["EACCES", "EIO"])
def test_a_store_that_cannot_be_read_is_a_507_naming_the_weight_store(served, monkeypatch,
                                                                      where, exc):
    http, path = served
    _failing(monkeypatch, path, exc, where)
    r = http.get(URL, headers=AUTH)
    assert r.status_code == 507, (r.status_code, r.text[:300])
    body = r.json()
    assert body["field"] == "disk"
    assert "weight store" in body["error"] and exc.strerror in body["error"]
    # a resumed download (Range) gets the same answer, not a broken 206
    r = http.get(URL, headers={**AUTH, "Range": "bytes=3-"})
    assert r.status_code == 507 and r.json()["field"] == "disk"
    monkeypatch.undo()
    _still_serving(http, answered_507=2)
    r = http.get(URL, headers=AUTH)  # the store is readable again: served whole
    assert r.status_code == 200 and r.content == DATA
    assert r.headers["x-sha256"] == hashlib.sha256(DATA).hexdigest()
    assert int(r.headers["content-length"]) == len(DATA)


def test_a_name_the_file_system_refuses_is_a_422_naming_the_name(served, monkeypatch):
    http, path = served
    _failing(monkeypatch, path, OSError(errno.ENAMETOOLONG, "File name too long"), "stat")
    r = http.get(URL, headers=AUTH)
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert r.json()["field"] == "name" and NAME in r.json()["error"]
    monkeypatch.undo()
    _still_serving(http, answered_507=0)


def test_a_missing_file_or_a_folder_in_its_place_is_still_a_410(served):
    http, path = served
    path.unlink()
    r = http.get(URL, headers=AUTH)
    assert r.status_code == 410 and r.json()["field"] == "name"
    path.mkdir()  # not a regular file
    r = http.get(URL, headers=AUTH)
    assert r.status_code == 410 and r.json()["field"] == "name"
    _still_serving(http, answered_507=0)


def test_ranges_are_still_served(served):
    http, _ = served
    r = http.get(URL, headers={**AUTH, "Range": "bytes=3-"})
    assert r.status_code == 206 and r.content == DATA[3:]
    assert r.headers["content-range"] == f"bytes 3-{len(DATA) - 1}/{len(DATA)}"
