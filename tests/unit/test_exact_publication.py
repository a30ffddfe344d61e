"""Float32 publication (astralight/weights/exact.py): split into two bf16-typed halves, moved
by the bf16 pipeline (real artifacts, full and delta), joined bit for bit before the engine."""

from __future__ import annotations

import pytest
import torch

from astralight.raas.weight_sync import WeightSync
from astralight.weights.artifacts import ArtifactBuilder
from astralight.weights.exact import (LO_SUFFIX, join_fp32, split_fp32, weight_names,
                                      with_low_halves)
from callbacks.weight_publisher import WeightPublisher
from tests.fakes import FakeStore


def _special() -> torch.Tensor:
    """Values whose halves are awkward: negatives, subnormals, infinities, a NaN, and low
    halves of every sign bit (0x8000 and above read as negative int16)."""
    return torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, float("inf"), float("-inf"),
                         float("nan"), 3.1415927, -2.7182817, 1 + 2**-23, 65504.0, 1e38,
                         -1e-3 + 2**-30], dtype=torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_split_then_join_gives_back_every_bit():
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 33, generator=g) * 0.02, "special": _special(),
             "ids": torch.arange(5)}
    halves = split_fp32(state)
    assert set(halves) == {"w", "w" + LO_SUFFIX, "special", "special" + LO_SUFFIX, "ids"}
    assert all(halves[n].dtype == torch.bfloat16 for n in halves if n != "ids")
    assert torch.equal(halves["ids"], state["ids"])  # integer tensors pass through
    joined = join_fp32(halves)
    assert set(joined) == {"w", "special", "ids"}
    for name in ("w", "special"):
        assert joined[name].dtype == torch.float32
        assert torch.equal(_bits(joined[name]), _bits(state[name])), name
    # the upper half is the bf16 value truncated (not rounded): within one bf16 step below
    w, hi = state["w"], halves["w"].float()
    assert torch.all((w - hi).abs() <= w.abs() * 2**-7)
    assert not torch.equal(hi, w.to(torch.bfloat16).float())  # so not bf16 rounding


def test_a_bf16_tensor_passes_join_unchanged_and_a_lone_low_half_is_refused():
    t = torch.randn(4).to(torch.bfloat16)
    assert join_fp32({"a": t})["a"] is t
    with pytest.raises(ValueError, match="without its upper half"):
        join_fp32({"a" + LO_SUFFIX: t})
    with pytest.raises(ValueError, match="reserved"):
        split_fp32({"a" + LO_SUFFIX: torch.zeros(2)})
    with pytest.raises(ValueError, match="shape"):
        join_fp32({"a": t, "a" + LO_SUFFIX: torch.zeros(3, dtype=torch.bfloat16)})
    names = ["a", "a" + LO_SUFFIX, "b"]
    assert weight_names(names) == ["a", "b"]
    assert with_low_halves(["a", "b"], dict.fromkeys(names)) == names


def test_the_publisher_refuses_an_unknown_precision_naming_the_choices():
    with pytest.raises(ValueError, match=r"precision: must be one of \('bf16', 'fp32'\)"):
        WeightPublisher(precision="fp16", worker="thread")


class RecordingEngine:
    """Records what it was given, and groups names as a fused engine does (q/k/v together)."""

    def __init__(self):
        self.version = 0
        self.loaded = []

    def update_weights(self, named_tensors, version, partial=False):
        self.loaded.append((version, {k: v.clone() for k, v in named_tensors.items()}, partial))
        self.version = version

    def weight_update_names(self, changed, all_names):
        assert not any(LO_SUFFIX in n for n in [*changed, *all_names])  # engine names only
        groups = [{"q", "k"}]
        out = set(changed)
        for g in groups:
            if out & g:
                out |= g
        return [n for n in all_names if n in out]


def test_float32_versions_reach_the_engine_exactly_through_full_and_delta_artifacts():
    g = torch.Generator().manual_seed(1)
    v1 = {n: torch.randn(16, 8, generator=g) for n in ("q", "k", "mlp", "norm")}
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["q"] += 1e-7 * torch.randn(16, 8, generator=g)  # far below a bf16 step: rounds away
    v2["mlp"][0, 0] += 2**-20  # one element, in the lower half only
    assert torch.equal(v2["q"].to(torch.bfloat16), v1["q"].to(torch.bfloat16))
    store, engine = FakeStore(), RecordingEngine()
    builder = ArtifactBuilder("policy", full_every=10)
    sync = WeightSync(lambda: store, "policy", engine, check_interval_s=0.0, background=False)
    for version, state in ((1, v1), (2, v2)):
        store.add(builder.build(version, split_fp32(state)))
        sync.refresh()
        loaded_version, tensors, partial = engine.loaded[-1]
        assert loaded_version == version
        for name, t in tensors.items():
            assert t.dtype == torch.float32 and torch.equal(_bits(t), _bits(state[name])), name
    assert store.manifests[2].kind == "delta"
    # v1 went whole; v2 only what changed (the low halves of q and mlp), q with its fused k
    assert set(engine.loaded[0][1]) == set(v1) and not engine.loaded[0][2]
    assert set(engine.loaded[1][1]) == {"q", "k", "mlp"} and engine.loaded[1][2]
