"""HFEngine's batched path (left padding + KV cache), checked against its exact per-request path.

The GPU check uses the batched path where vLLM is not installed, so its rollouts must be the
same sequences the per-request path would produce: greedy decoding of prompts of different
lengths (padding, positions and the cache all matter there) must agree token for token.
"""

import math

import pytest

from astralight.engine import SamplingSpec
from astralight.raas.hf_engine import HFEngine

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [20]]


def test_batched_greedy_equals_per_request_greedy(tiny_model_dir):
    exact = HFEngine(str(tiny_model_dir), seed=0)
    batched = HFEngine(str(tiny_model_dir), seed=0, batch_size=3)
    spec = SamplingSpec(temperature=0.0, max_tokens=12)
    want = exact.generate_batch(PROMPTS, spec)
    got = batched.generate_batch(PROMPTS, spec)  # batches of at most 3
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    for g, w in zip(got, want):
        assert len(g.logprobs) == len(g.token_ids)
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(g.logprobs, w.logprobs))


def test_batched_sampling_respects_budget_stops_and_seed(tiny_model_dir):
    engine = HFEngine(str(tiny_model_dir), seed=0, batch_size=4, max_model_len=16)
    spec = SamplingSpec(temperature=1.0, max_tokens=12, seed=3)
    first = engine.generate_batch(PROMPTS, spec)
    again = engine.generate_batch(PROMPTS, spec)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]  # seeded per batch
    for prompt, c in zip(PROMPTS, first):
        assert 1 <= len(c.token_ids) <= min(12, 16 - len(prompt))  # max_model_len clamps
        assert all(lp <= 0.0 for lp in c.logprobs)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in engine.eos_token_ids
        else:
            assert engine.eos_token_ids.isdisjoint(c.token_ids)


def test_per_request_path_refuses_other_devices(tiny_model_dir):
    with pytest.raises(ValueError, match="batch_size"):
        HFEngine(str(tiny_model_dir), dtype="bfloat16")
    with pytest.raises(ValueError, match="batch_size"):
        HFEngine(str(tiny_model_dir), batch_size=0)


def test_sampling_logprobs_cut_to_the_nucleus_like_vllm():
    import torch

    from astralight.raas.hf_engine import sampling_logprobs

    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.25, 0.25, 0.5]]))
    assert torch.allclose(sampling_logprobs(logits, 1.0), torch.log_softmax(logits, -1))
    # 0.6: the mass before 0.3 is 0.5 < 0.6, before 0.2 it is 0.8: {0.5, 0.3} renormalised
    got = sampling_logprobs(logits, 1.0, top_p=0.6).exp()
    assert torch.allclose(got[0], torch.tensor([0.0, 0.625, 0.375]))
    # {0.5, one of the tied 0.25s}: the mass before the second 0.25 is 0.75
    assert torch.isclose(got[1][2], torch.tensor(2 / 3))
    assert torch.allclose(got[1][:2].sort().values, torch.tensor([0.0, 1 / 3]))
    only_first = sampling_logprobs(logits, 1.0, top_p=0.45)  # below the top token's 0.5
    assert only_first[0].tolist() == [float("-inf"), 0.0, float("-inf")]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_tiny_nucleus_samples_the_greedy_tokens_with_log_prob_zero(tiny_model_dir, batch_size):
    engine = HFEngine(str(tiny_model_dir), seed=0, batch_size=batch_size)
    greedy = engine.generate_batch(PROMPTS, SamplingSpec(temperature=0.0, max_tokens=8))
    nucleus = engine.generate_batch(PROMPTS, SamplingSpec(temperature=1.0, top_p=1e-6,
                                                          max_tokens=8))
    assert [c.token_ids for c in nucleus] == [c.token_ids for c in greedy]
    assert all(lp == 0.0 for c in nucleus for lp in c.logprobs)
