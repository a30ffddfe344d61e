"""Engine-side helpers that need no engine: sampling spec checks, context clamping, and the
safetensors blob VLLMEngine.update_weights sends to its workers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from astralight.engine import Completion, SamplingSpec, clamp_max_tokens
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


def test_request_seeds_differ_per_request_and_per_task():
    spec = SamplingSpec(seed=5)
    assert spec.for_request(0) is spec and spec.for_request(3).seed == 8
    a0, a1 = spec.for_request(0, "task-a").seed, spec.for_request(1, "task-a").seed
    b0 = spec.for_request(0, "task-b").seed
    assert a1 == a0 + 1 and len({a0, b0, 5}) == 3  # stable per task, distinct across tasks
    assert spec.for_request(0, "task-a").seed == a0  # deterministic
    assert SamplingSpec().for_request(4, "task-a").seed is None  # unseeded stays unseeded


def test_completion_versions_per_token():
    c = Completion([1, 2, 3], [-0.1, -0.2, -0.3], "stop", versions=[4, 4, 5])
    assert c.version == 4 and c.spans_versions and c.token_versions(0) == [4, 4, 5]
    d = Completion([1, 2], [-0.1, -0.2], "length", version=7)
    assert d.versions == [7, 7] and not d.spans_versions
    assert Completion([1], [-0.1], "stop").token_versions(3) == [3]
    with pytest.raises(ValueError, match="versions"):
        Completion([1, 2], [-0.1, -0.2], "stop", versions=[1])


def test_batched_engine_groups_unseeded_requests_and_runs_updates_between_batches():
    from astralight.raas.engine import BatchedEngine

    class Recorder(BatchedEngine):
        def __init__(self):
            self.version, self.batches = 0, []

        def _generate(self, prompts, params):
            self.batches.append(len(prompts))
            return [Completion([9], [-1.0], "stop") for _ in prompts]

    engine = Recorder()
    out = engine.generate_batch([[1]] * 5, SamplingSpec())
    assert sum(engine.batches) == 5 and all(c.versions == [0] for c in out)
    engine.call(lambda: setattr(engine, "version", 3))
    seeded = engine.generate_batch([[1]] * 3, SamplingSpec(seed=1))
    assert engine.batches[-3:] == [1, 1, 1]  # a seeded request is a batch of its own
    assert all(c.versions == [3] for c in seeded)
    engine.close()
