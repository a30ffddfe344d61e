"""PPO-clip (GRPO token-mean) against a per-token loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from astralight.rl.ppo import ppo_clip_loss, truncated_is_ppo_loss


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


# ----------------------------------------------------------------------------- truncated IS


def test_truncated_is_ppo_is_the_capped_importance_weighted_policy_gradient():
    """At the update's start (logp == the proximal log-probs) the gradient per token is
    ``-min(pi_prox / pi_behaviour, cap) * A / n_tokens``: the sampler's mismatch corrected,
    its rare tokens' weight cut at the cap (issue 37)."""
    torch.manual_seed(0)
    prox = torch.randn(3, 5) - 1.0
    behaviour = prox + torch.tensor([0.0, 0.5, -0.5, 2.0, -2.0]).expand(3, 5)  # w = e^-d
    adv = torch.randn(3, 1).expand(3, 5).contiguous()
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    logp = prox.clone().requires_grad_(True)
    loss, metrics = truncated_is_ppo_loss(logp, prox, behaviour, adv, mask, is_cap=2.0)
    loss.backward()
    weight = torch.exp(prox - behaviour).clamp(max=2.0)
    want = torch.where(mask, -weight * adv / mask.sum(), torch.zeros(()))
    assert torch.allclose(logp.grad, want, atol=1e-6)
    # the weights e^0, e^-0.5, e^0.5, e^-2, e^2: only e^2 is past the cap
    assert float(metrics["is_truncated_fraction"]) == pytest.approx(
        float(mask[:, 4].sum() / mask.sum()))
    assert float(metrics["is_weight_mean"]) == pytest.approx(float(weight[mask].mean()), rel=1e-5)


def test_truncated_is_ppo_without_a_mismatch_is_ppo_clip():
    torch.manual_seed(1)
    logp, prox = torch.randn(4, 6) - 1, torch.randn(4, 6) - 1
    adv, mask = torch.randn(4, 6), torch.rand(4, 6) > 0.2
    tis, metrics = truncated_is_ppo_loss(logp, prox, prox, adv, mask)
    plain, _ = ppo_clip_loss(logp, prox, adv, mask)
    assert float(tis) == pytest.approx(float(plain), rel=1e-6)
    assert float(metrics["is_weight_mean"]) == pytest.approx(1.0)


def test_the_policy_trains_with_tis_ppo_and_refuses_a_cap_below_one(tiny_model_dir):
    from astralight.datamodules import collate_batch
    from astralight.policy import M2POPolicy
    from tests.fakes import FakeDataflowClient

    with pytest.raises(ValueError, match="is_cap: 0.5 must be >= 1"):
        M2POPolicy(str(tiny_model_dir), loss="tis_ppo", is_cap=0.5)
    for micro_batch_size in (None, 2):
        policy = M2POPolicy(str(tiny_model_dir), loss="tis_ppo",
                            micro_batch_size=micro_batch_size)
        policy.configure_model()
        fake = FakeDataflowClient(tiny_model_dir, logprob_noise=0.5)
        out = policy.accumulate_gradients(policy.prepare_batch(
            collate_batch(fake.make_batch(6), trainer_version=0)))
        assert float(out["is_truncated_fraction"]) > 0  # the noise puts some weights past 2
        assert 0 < float(out["is_weight_mean"]) <= 2.0
        grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
