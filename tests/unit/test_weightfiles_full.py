"""A weight upload that hits a full volume is refused with 507 naming the weight store, and leaves
no temp file behind (the integration scenario on a real full tmpfs is in
tests/integration/test_faults.py)."""

from __future__ import annotations

import asyncio
import errno
import io

import pytest

from astralight.dataflow import weightfiles
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.weightfiles import WeightFiles


class FullFile(io.BytesIO):
    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")


async def chunks():
    yield b"x" * 1024


def test_enospc_during_upload_is_a_507_naming_the_store(tmp_path, monkeypatch):
    files = WeightFiles(tmp_path / "weights")
    real_open = open

    def fake_open(path, mode="r", *a, **kw):
        if "w" in mode:
            real_open(path, mode).close()  # the temp file exists, as on a real disk
            return FullFile()
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(weightfiles, "open", fake_open, raising=False)
    with pytest.raises(ServiceError) as info:
        asyncio.run(files.receive("policy", 1, "model.safetensors", chunks(), 1 << 20))
    assert info.value.status == 507 and info.value.field == "disk"
    assert str(tmp_path / "weights") in str(info.value) and "full" in str(info.value)
    assert list((tmp_path / "weights" / "policy" / "1").iterdir()) == []  # temp file removed


def test_other_os_errors_are_not_reported_as_a_full_disk(tmp_path, monkeypatch):
    files = WeightFiles(tmp_path / "weights")

    class Broken(io.BytesIO):
        def write(self, data):
            raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(weightfiles, "open", lambda *a, **kw: Broken(), raising=False)
    with pytest.raises(ServiceError) as info:  # never an unhandled OSError (a 500)
        asyncio.run(files.receive("policy", 1, "model.safetensors", chunks(), 1 << 20))
    # a 507 naming the store and the real error, not "full"
    assert info.value.status == 507 and info.value.field == "disk"
    assert "I/O error" in info.value.message and "full" not in info.value.message
