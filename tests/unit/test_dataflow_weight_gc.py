"""Weight-store GC of the dataflow core: keep the latest full version and the deltas after it,
keep the previous chain for ``weights_keep_s``, drop unpublishable uploads, survive restarts."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import torch

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.weights import ArtifactBuilder, WeightState


def make_core(tmp_path, **kw) -> Dataflow:
    return Dataflow(DataflowConfig(state_dir=str(tmp_path / "state"), **kw))


def upload(core: Dataflow, version: int, name: str, data: bytes, mid: str = "policy") -> None:
    """What the PUT route does: a temp file next to the target, then commit."""
    core.check_upload(mid, version, name)
    path = core.weights.path(mid, version, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{name}.test.tmp"
    tmp.write_bytes(data)
    core.commit_upload(tmp, mid, version, name, hashlib.sha256(data).hexdigest())


def states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """n consecutive bf16 states of a small model, ~1% of elements changing per step."""
    gen = torch.Generator().manual_seed(seed)
    w = {"a": torch.randn(64, 32, generator=gen) * 0.02, "b": torch.randn(100, generator=gen)}
    out = []
    for _ in range(n):
        out.append({k: v.to(torch.bfloat16) for k, v in w.items()})
        w = {k: v + 1e-5 * torch.randn(v.shape, generator=gen) for k, v in w.items()}
    return out


def publish_all(core, builder, seq, start=1):
    """Publish versions start.. of ``seq`` through the core; returns their artifacts."""
    arts = []
    for i, state in enumerate(seq):
        art = builder.build(start + i, state)
        for name, data in art.files.items():
            upload(core, art.manifest.version, name, data)
        core.publish(art.manifest)
        arts.append(art)
    return arts


def folders(core, mid="policy"):
    return core.weights.stored_versions(mid)


def test_keeps_latest_full_and_following_deltas(tmp_path):
    core = make_core(tmp_path, weights_keep_s=0)
    builder = ArtifactBuilder("policy", full_every=3)
    seq = states(6)
    arts = publish_all(core, builder, seq)  # fulls at 1 and 4
    assert [a.manifest.kind for a in arts] == ["full", "delta", "delta", "full", "delta", "delta"]
    assert folders(core) == [4, 5, 6]
    assert [v for v, _, _ in core.weight_index["policy"]] == [4, 5, 6]
    with pytest.raises(ServiceError) as info:
        core.manifest("policy", 2)
    assert info.value.status == 404 and "garbage-collected" in str(info.value.message)
    assert "latest full: 4" in str(info.value.message)
    with pytest.raises(ServiceError):
        core.weight_file("policy", 1, "model.safetensors")
    assert core.manifest("policy", 99) is None  # never published: plain None, as before
    stats = core.stats()["models"]["policy"]
    assert stats["weight_versions_removed"] == 3 and stats["weight_versions_stored"] == 3
    assert (stats["weight_oldest_version"], stats["weight_latest_full"]) == (4, 4)

    # a newcomer walks the kept chain back from the latest version and reconstructs it exactly
    ws = WeightState()
    chain, m = [], core.manifest("policy")
    while True:
        chain.append(m)
        if m.kind == "full":
            break
        m = core.manifest("policy", m.base_version)
    for m in reversed(chain):
        files = {n: core.weight_file("policy", m.version, n)[0] for n in m.files}
        ws.apply(m, files)
    assert ws.version == 6
    for name, t in seq[-1].items():
        assert np.array_equal(ws.state[name], t.view(torch.int16).numpy().view(np.uint16))
    core.close()


def test_grace_period_keeps_previous_chain_then_collects(tmp_path):
    core = make_core(tmp_path, weights_keep_s=100)
    builder = ArtifactBuilder("policy", full_every=2)
    publish_all(core, builder, states(4))  # full 1, delta 2, full 3, delta 4
    t_full3 = [t for v, _, t in core.weight_index["policy"] if v == 3][0]
    assert folders(core) == [1, 2, 3, 4]  # within the grace period: a RaaS may be on v1..v2
    assert not core.gc_due(t_full3 + 50)
    assert core.gc_weights(now=t_full3 + 50) == {"policy": []}
    assert core.gc_due(t_full3 + 100.5)
    assert core.gc_weights(now=t_full3 + 100.5) == {"policy": [1, 2]}
    assert folders(core) == [3, 4] and not core.gc_due(t_full3 + 200)
    core.close()


def test_unpublishable_uploads_are_removed_pending_ones_kept(tmp_path):
    core = make_core(tmp_path, weights_keep_s=0)
    builder = ArtifactBuilder("policy", full_every=10)
    seq = states(3)
    publish_all(core, builder, seq[:1])
    upload(core, 2, "delta.bin", b"abandoned upload of v2")  # the trainer crashed before publish
    upload(core, 9, "model.safetensors", b"upload in progress")  # a future version
    publish_all(core, ArtifactBuilder("policy", full_every=10), seq[1:2], start=3)  # full v3
    assert folders(core) == [3, 9]  # v1 collected (older than full v3), v2 can never be published
    core.close()


def test_delta_onto_a_collected_or_unpublished_base_is_refused(tmp_path):
    core = make_core(tmp_path, weights_keep_s=0)
    seq = states(3)
    b1 = ArtifactBuilder("policy", full_every=0)
    publish_all(core, b1, seq[:1])  # full v1
    publish_all(core, ArtifactBuilder("policy", full_every=0), seq[:1], start=2)  # full v2: v1 goes
    stale = b1.build(3, seq[1])  # a delta onto v1, which is collected
    assert stale.manifest.kind == "delta" and stale.manifest.base_version == 1
    for name, data in stale.files.items():
        upload(core, 3, name, data)
    with pytest.raises(ServiceError) as info:
        core.publish(stale.manifest)
    assert info.value.status == 422 and info.value.field == "manifest.base_version"
    assert core.current_version("policy") == 2
    core.close()


def test_a_delta_on_the_initial_model_is_refused_once_later_versions_are_out(tmp_path):
    """Issue 41, item 11: a delta on base version 0 was accepted at any current version, though
    no RaaS holds version 0 once it has moved on, so none could apply it."""
    core = make_core(tmp_path, weights_keep_s=3600)
    seq = states(3)
    on_init = ArtifactBuilder("policy", full_every=0)
    on_init.build(0, seq[0])  # the initial model, never published
    publish_all(core, ArtifactBuilder("policy", full_every=0), seq[:2])  # full v1, delta v2
    late = on_init.build(3, seq[2])
    assert late.manifest.kind == "delta" and late.manifest.base_version == 0
    for name, data in late.files.items():
        upload(core, 3, name, data)
    with pytest.raises(ServiceError) as info:
        core.publish(late.manifest)
    assert info.value.status == 422 and info.value.field == "manifest.base_version"
    assert "version 0, the initial model, only while it is current" in str(info.value)
    assert core.current_version("policy") == 2
    core.close()
    # while version 0 is current, a delta on it is the first publication and is accepted
    fresh = make_core(tmp_path / "fresh")
    first = ArtifactBuilder("policy", full_every=0)
    first.build(0, seq[0])
    art = first.build(1, seq[1])
    assert art.manifest.kind == "delta" and art.manifest.base_version == 0
    for name, data in art.files.items():
        upload(fresh, 1, name, data)
    fresh.publish(art.manifest)
    assert fresh.current_version("policy") == 1
    fresh.close()


def test_restart_rebuilds_the_index_collects_and_purges_trash(tmp_path):
    core = make_core(tmp_path, weights_keep_s=3600)
    publish_all(core, ArtifactBuilder("policy", full_every=2), states(4))  # fulls 1, 3
    core.close()
    leftover = tmp_path / "state" / "weights" / "policy" / ".trash-1-deadbeef"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"x")

    again = make_core(tmp_path, weights_keep_s=3600)  # still within the grace period
    assert [(v, k) for v, k, _ in again.weight_index["policy"]] == [
        (1, "full"), (2, "delta"), (3, "full"), (4, "delta")]
    assert not leftover.exists()
    again.close()
    time.sleep(0.01)
    last = make_core(tmp_path, weights_keep_s=0)  # collected at start
    assert folders(last) == [3, 4] and last.current_version("policy") == 4
    assert last.manifest("policy").version == 4
    last.close()


def test_gc_can_be_disabled(tmp_path):
    core = make_core(tmp_path, weights_gc=False, weights_keep_s=0)
    publish_all(core, ArtifactBuilder("policy", full_every=1), states(3))
    assert folders(core) == [1, 2, 3] and not core.gc_due()
    core.close()
    with pytest.raises(ValueError, match="weights_keep_s"):
        DataflowConfig(state_dir=str(tmp_path / "x"), weights_keep_s=-1)


def test_symlinks_planted_in_the_weight_store_are_refused_not_followed(tmp_path):
    """Issue 41, item 12: uploads and downloads followed symbolic links planted in the state
    folder, writing and reading outside it. Every part of a weight file's path below the store
    is now checked: a link is a 409 naming the field, and nothing outside is touched."""
    core = make_core(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"not a weight")
    root = core.weights.root
    (root / "policy").symlink_to(outside, target_is_directory=True)  # the model's folder
    with pytest.raises(ServiceError) as info:
        upload(core, 1, "model.safetensors", b"weights")
    assert info.value.status == 409 and "symbolic link" in str(info.value)
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]  # nothing written there
    (root / "policy").unlink()
    (root / "policy" / "1").mkdir(parents=True)
    (root / "policy" / "1" / "model.safetensors").symlink_to(outside / "secret")  # a file
    with pytest.raises(ServiceError) as info:
        core.weights.sha256("policy", 1, "model.safetensors", "manifest.files[model.safetensors]")
    assert info.value.status == 409 and info.value.field == "manifest.files[model.safetensors]"
    with pytest.raises(ServiceError):
        core.weights.path("policy", 1, "model.safetensors")
    core.close()
