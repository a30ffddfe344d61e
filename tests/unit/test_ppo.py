"""PPO-clip (GRPO token-mean) against a per-token loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from astralight.rl.ppo import ppo_clip_loss


def reference_ppo(logp, logp_b, adv, mask, eps_low, eps_high):
    total, clipped, n = 0.0, 0, 0
    for p in map(tuple, mask.nonzero().tolist()):
        r, a = math.exp(float(logp[p] - logp_b[p])), float(adv[p])
        unclipped = -a * r
        clip_term = -a * min(max(r, 1 - eps_low), 1 + eps_high)
        total += max(unclipped, clip_term)
        clipped += clip_term > unclipped
        n += 1
    return total / max(n, 1), clipped / max(n, 1)


@pytest.mark.parametrize("seed,eps_high", [(0, None), (1, 0.28), (2, None), (3, 0.5)])
def test_ppo_clip_matches_reference(seed, eps_high):
    g = torch.Generator().manual_seed(seed)
    logp_b = -torch.rand(5, 9, generator=g, dtype=torch.float64) * 2
    logp = (logp_b + torch.randn(5, 9, generator=g, dtype=torch.float64) * 0.4).requires_grad_(True)
    mask = torch.rand(5, 9, generator=g) < 0.8
    adv = torch.randn(5, generator=g, dtype=torch.float64)[:, None] * mask
    loss, metrics = ppo_clip_loss(logp, logp_b, adv, mask, 0.2, eps_high)
    ref, ref_clip = reference_ppo(logp.detach(), logp_b, adv, mask, 0.2,
                                  0.2 if eps_high is None else eps_high)
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-12)
    assert float(metrics["clip_fraction"]) == pytest.approx(ref_clip)
    assert 0 < ref_clip < 1  # the batch exercises both branches
    # gradient is zero exactly where the clipped term is active, -A r / n elsewhere
    loss.backward()
    r = torch.exp(logp.detach() - logp_b)
    hi = 1 + (0.2 if eps_high is None else eps_high)
    active = mask & (((adv > 0) & (r > hi)) | ((adv < 0) & (r < 0.8)))
    expected = torch.where(mask & ~active, -adv * r / mask.sum(), 0.0)
    torch.testing.assert_close(logp.grad, expected)


def test_ppo_on_policy_is_policy_gradient():
    """At r = 1 nothing is clipped and the loss is -mean(A)."""
    logp = torch.full((2, 3), -1.0)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    loss, metrics = ppo_clip_loss(logp, logp.clone(), adv, mask)
    assert float(loss) == pytest.approx(-(3 - 4) / 5)
    assert float(metrics["clip_fraction"]) == 0.0
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0)


def test_ppo_normaliser_for_micro_batches():
    g = torch.Generator().manual_seed(5)
    logp_b = -torch.rand(6, 4, generator=g)
    logp = logp_b + torch.randn(6, 4, generator=g) * 0.3
    mask = torch.ones(6, 4, dtype=torch.bool)
    adv = torch.randn(6, 1, generator=g).expand(6, 4)
    full, _ = ppo_clip_loss(logp, logp_b, adv, mask)
    parts = sum(ppo_clip_loss(logp[s], logp_b[s], adv[s], mask[s], n_tokens=24)[0]
                for s in (slice(0, 2), slice(2, 6)))
    assert float(parts) == pytest.approx(float(full), rel=1e-6)
