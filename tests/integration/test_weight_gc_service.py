"""Weight GC in the real dataflow service over HTTP: the previous chain stays downloadable for
``weights_keep_s``, then the service's sweeper removes it without any new publication; a newcomer
still reconstructs the latest version from the kept full version and deltas."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import torch

from astralight.dataflow.client import DataflowClient, DataflowError
from astralight.weights import ArtifactBuilder, WeightState


def test_sweeper_collects_after_grace_period_and_newcomer_still_syncs(tmp_path, dataflow_service):
    url, _, _ = dataflow_service(tmp_path, weights_keep_s=1.0)
    client = DataflowClient(url, retry_s=30)
    builder = ArtifactBuilder("policy", full_every=2)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=gen) * 0.02
    states = {}
    for version in (1, 2, 3, 4):  # full, delta, full, delta
        states[version] = w.to(torch.bfloat16)
        art = builder.build(version, {"w": states[version]})
        for name, data in art.files.items():
            client.upload_weight_file("policy", version, name, data)
        client.publish(art.manifest)
        w = w + 1e-4 * torch.randn(w.shape, generator=gen)
    assert client.manifest("policy", 2).kind == "delta"  # within the grace period: still there

    deadline = time.monotonic() + 60
    while True:  # no publication happens: only the sweeper can collect (raw GET: the client
        r = httpx.get(f"{url}/v1/manifest/policy/1")  # caches manifests, versions are immutable)
        if r.status_code != 200:
            assert r.status_code == 404 and "garbage-collected" in r.text, r.text
            break
        assert time.monotonic() < deadline, "versions 1-2 were never collected"
        time.sleep(0.2)
    with pytest.raises(DataflowError) as info:
        client.download_weight_file("policy", 2, "delta.bin")
    assert info.value.status == 404
    stats = client.stats()["models"]["policy"]
    assert stats["weight_versions_removed"] == 2 and stats["weight_oldest_version"] == 3

    ws = WeightState()  # a RaaS joining now: latest full (3) then the delta onto it (4)
    latest = client.latest_manifest("policy")
    assert (latest.version, latest.kind, latest.base_version) == (4, "delta", 3)
    for m in (client.manifest("policy", 3), latest):
        ws.apply(m, {n: client.download_weight_file("policy", m.version, n) for n in m.files})
    assert np.array_equal(ws.state["w"], states[4].view(torch.int16).numpy().view(np.uint16))
    client.close()
