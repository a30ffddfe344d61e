"""A weight file larger than the client's upload slice travels whole and verified.

The client sends raw bodies above ``UPLOAD_CHUNK_BYTES`` as memoryview slices with an explicit
Content-Length (one bytes body made httpcore copy the unsent rest after every socket send: a
1.2 GB full version uploaded at ~20 MB/s on the GPU check). This checks the sliced path end to
end against a real service: odd sizes, the sha256 the service computed, the published file
downloaded back byte for byte, and a retry of the same upload (a fresh iterator) refused only
because the version was published. Speed is measured by tests/benchmarks, not asserted here.
"""

import hashlib
import os

import pytest

from astralight.dataflow.client import UPLOAD_CHUNK_BYTES, DataflowError, _chunks
from astralight.protocol import WeightManifest


def test_chunks_cover_the_body_without_copies():
    data = os.urandom(3 * 1000 + 7)
    parts = list(_chunks(data, size=1000))
    assert [len(p) for p in parts] == [1000, 1000, 1000, 7]
    assert all(isinstance(p, memoryview) and p.obj is data for p in parts)
    assert b"".join(parts) == data


def test_sliced_upload_publishes_and_downloads_intact(tmp_path, dataflow_service, client_for):
    url, _, _ = dataflow_service(tmp_path)
    c = client_for(url)
    data = os.urandom(3 * UPLOAD_CHUNK_BYTES + 12345)  # several slices and a ragged tail
    sha = hashlib.sha256(data).hexdigest()
    c.upload_weight_file("policy", 1, "model.safetensors", data)
    c.publish(WeightManifest(model_id="policy", version=1, kind="full",
                             files={"model.safetensors": {"sha256": sha, "bytes": len(data)}}))
    assert c.download_weight_file("policy", 1, "model.safetensors") == data
    target = c.download_weight_file_to("policy", 1, "model.safetensors", tmp_path / "w.bin")
    assert target.read_bytes() == data
    with pytest.raises(DataflowError) as info:  # published files are immutable
        c.upload_weight_file("policy", 1, "model.safetensors", data)
    assert info.value.status == 409
