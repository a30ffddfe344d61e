"""Engine-side helpers that need no engine: sampling spec checks, context clamping, and the
safetensors blob VLLMEngine.update_weights sends to its workers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from astralight.raas.engine import Completion, SamplingSpec, clamp_max_tokens
from astralight.raas.vllm_engine import safetensors_blob


def test_sampling_spec_and_completion_refuse_bad_values():
    with pytest.raises(ValueError, match="temperature"):
        SamplingSpec(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingSpec(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingSpec(max_tokens=0)
    with pytest.raises(ValueError, match="logprobs"):
        Completion([1, 2], [-0.1], "stop")


def test_clamp_max_tokens_keeps_prompt_plus_completion_in_context():
    assert clamp_max_tokens(10, 64, 128) == 64
    assert clamp_max_tokens(100, 64, 128) == 28
    assert clamp_max_tokens(100, 64, None) == 64
    with pytest.raises(ValueError, match="max_model_len=128"):
        clamp_max_tokens(128, 4, 128)


def test_blob_casts_to_the_engine_dtype_and_unties_shared_storage():
    emb = torch.randn(6, 4)
    named = {"embed.weight": emb, "lm_head.weight": emb, "half": emb[:3], "steps": torch.arange(3)}
    out = load(safetensors_blob(named, "bfloat16"))
    assert set(out) == set(named)
    assert out["embed.weight"].dtype == torch.bfloat16 and out["steps"].dtype == torch.int64
    assert torch.equal(out["lm_head.weight"], emb.to(torch.bfloat16))
    assert torch.equal(out["half"], emb[:3].to(torch.bfloat16))
    kept = load(safetensors_blob({"a": emb, "b": emb}, "auto"))  # no cast, still untied
    assert kept["a"].dtype == torch.float32 and torch.equal(kept["b"], emb)
