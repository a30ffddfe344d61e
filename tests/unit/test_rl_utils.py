"""GRPO advantages, KL estimators and token log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from astralight.rl.advantages import (
    batch_normalize,
    broadcast_to_tokens,
    group_normalized_advantages,
)
from astralight.rl.kl import kl_k3, kl_penalty, masked_mean
from astralight.rl.logprobs import causal_lm_logprobs, token_logprobs


def test_group_advantages_by_group_id():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5])
    groups = ["a", "a", "b", "b", "b", "c", "d"]
    adv = group_normalized_advantages(rewards, groups, eps=0.0)
    # group a: mean .5, std .5 -> +1, -1 ; group b: mean 2/3, std sqrt(2/9)
    assert adv[:2].tolist() == pytest.approx([1.0, -1.0])
    std_b = math.sqrt(((0 - 2 / 3) ** 2 + 2 * (1 - 2 / 3) ** 2) / 3)
    assert adv[2:5].tolist() == pytest.approx([-2 / 3 / std_b, 1 / 3 / std_b, 1 / 3 / std_b])
    assert adv[5] == 0 and adv[6] == 0  # singletons have no baseline
    same = group_normalized_advantages(torch.ones(4), [0, 0, 1, 1])
    assert torch.count_nonzero(same) == 0  # all-equal groups carry no signal
    unbiased = group_normalized_advantages(rewards[:2], ["a", "a"], eps=0.0, unbiased_std=True)
    assert unbiased.tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)])
    dr = group_normalized_advantages(rewards[:2], torch.tensor([3, 3]), scale_by_std=False)
    assert dr.tolist() == pytest.approx([0.5, -0.5])


def test_batch_normalize_and_broadcast():
    adv = torch.tensor([1.0, 2.0, 3.0, 6.0])
    out = batch_normalize(adv)
    assert float(out.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(out.std(unbiased=False)) == pytest.approx(1.0, rel=1e-5)
    mask = torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 0]])
    tok = broadcast_to_tokens(adv, mask)
    assert tok.tolist() == [[0, 1, 1], [0, 0, 2], [3, 3, 3], [0, 0, 0]]
    with pytest.raises(ValueError, match="advantages"):
        broadcast_to_tokens(adv[:3], mask)


def test_kl_k3():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    assert torch.count_nonzero(kl_k3(logp, logp)) == 0
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = ref - logp
    assert kl_k3(logp, ref).tolist() == pytest.approx((torch.exp(d) - d - 1).tolist())
    assert bool((kl_k3(logp, ref) >= 0).all())
    mask = torch.tensor([1, 1, 0])
    loss, metrics = kl_penalty(logp, ref, mask, 0.1)
    assert float(loss) == pytest.approx(0.1 * float(kl_k3(logp, ref)[:2].mean()))
    assert float(metrics["kl_k3"]) == pytest.approx(float(kl_k3(logp, ref)[:2].mean()))
    assert float(masked_mean(torch.tensor([float("nan"), 2.0]), torch.tensor([0, 1]))) == 2.0


@pytest.mark.parametrize("temperature,chunk", [(1.0, None), (0.7, 3), (1.3, 1)])
def test_token_logprobs_matches_log_softmax(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64).requires_grad_(True)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    out = token_logprobs(logits, targets, temperature, chunk)
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref.float())
    (g1,) = torch.autograd.grad(out.sum(), logits)
    (g2,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_bf16_gradient_and_saved_memory(temperature):
    """bf16 logits (bf16-mixed training): values and a weighted gradient match float64, and the
    backward keeps only the logits as they came plus O(tokens): not float32 upcasts of them
    (twice the bf16 bytes; 9.7 GB for 16k tokens of Qwen3's vocabulary)."""
    g = torch.Generator().manual_seed(1)
    logits64 = torch.randn(2, 7, 50, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, 50, (2, 7), generator=g)
    weights = torch.randn(2, 7, generator=g)
    logits = logits64.to(torch.bfloat16).requires_grad_(True)
    saved: list[int] = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = token_logprobs(logits, targets, temperature, chunk_tokens=3)
    base = logits.detach().double().requires_grad_(True)
    ref = torch.log_softmax(base / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=0, atol=1e-4)
    (got,) = torch.autograd.grad((out * weights).sum(), logits)
    (want,) = torch.autograd.grad((ref * weights.double()).sum(), base)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=0.02, atol=2e-3)
    n = targets.numel()
    logits_bytes = logits.numel() * logits.element_size()
    assert sum(saved) <= logits_bytes + n * (8 + 4)  # logits + int64 targets + float32 lse
    assert token_logprobs(logits[:, :0], targets[:, :0]).shape == (2, 0)


def test_causal_lm_logprobs_alignment(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([[2, 10, 11, 12, 13, 1]])
    out = causal_lm_logprobs(model, ids, torch.ones_like(ids))
    logits = model(input_ids=ids).logits
    manual = torch.log_softmax(logits[0, 2].float(), -1)[ids[0, 3]]
    assert out.shape == (1, 5)
    assert float(out[0, 2].detach()) == pytest.approx(float(manual.detach()), abs=1e-5)
