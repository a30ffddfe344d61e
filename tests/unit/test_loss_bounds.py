"""Every loss in astralight.rl stays finite, with finite gradients, for behaviour log-probs at
the ingest floor (issue 18, defect 3: a log-prob of -3e38 made ppo_clip_loss inf and its
gradients non-finite)."""

from __future__ import annotations

import math

import pytest
import torch

from astralight.protocol import LOGPROB_FLOOR
from astralight.rl.kl import LOG_RATIO_CLAMP, clamped_log_ratio, kl_penalty, ratio_metrics
from astralight.rl.m2po import m2po_harmful_loss, m2po_loss
from astralight.rl.ppo import ppo_clip_loss


def _batch(extreme: float, sign: float):
    """Four loss-masked tokens, one of them with behaviour log-prob ``extreme`` (``logp`` near
    0: log r = -extreme, the largest ratio the floor allows), advantages of sign ``sign``."""
    torch.manual_seed(0)
    logp = (-torch.rand(1, 4) * 0.1).requires_grad_(True)
    logp_b = logp.detach() - 0.01
    logp_b[0, 1] = extreme
    adv = torch.full((1, 4), sign)
    mask = torch.ones(1, 4, dtype=torch.bool)
    return logp, logp_b, adv, mask


LOSSES = {
    "ppo_clip": lambda lp, lb, a, m: ppo_clip_loss(lp, lb, a, m)[0],
    "ppo_clip_higher": lambda lp, lb, a, m: ppo_clip_loss(lp, lb, a, m, 0.2, 0.28)[0],
    "m2po": lambda lp, lb, a, m: m2po_loss(lp, lb, a, m, 0.04)[0],
    # with a keep mask computed elsewhere that keeps the extreme token (a huge threshold)
    "m2po_keep_all": lambda lp, lb, a, m: m2po_loss(lp, lb, a, m, 0.04, keep=m)[0],
    "m2po_harmful": lambda lp, lb, a, m: m2po_harmful_loss(lp, lb, a, m, 0.04)[0],
    "m2po_harmful_loose": lambda lp, lb, a, m: m2po_harmful_loss(lp, lb, a, m, 1e12)[0],
    "kl_k3": lambda lp, lb, a, m: kl_penalty(lp, lb, m, 0.1)[0],
}


@pytest.mark.parametrize("extreme", [LOGPROB_FLOOR, -3e38])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_and_gradients_are_finite_at_and_below_the_floor(name, sign, extreme):
    logp, logp_b, adv, mask = _batch(extreme, sign)
    loss = LOSSES[name](logp, logp_b, adv, mask)
    loss.backward()
    assert torch.isfinite(loss), (name, float(loss))
    assert torch.isfinite(logp.grad).all(), (name, logp.grad)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_current_policy_at_the_floor_is_finite_too(name):
    """The other direction: the trainer's log-prob far below the behaviour's (log r = -1000)."""
    logp = torch.tensor([[LOGPROB_FLOOR, -0.5, -0.2]], requires_grad=True)
    logp_b = torch.tensor([[-0.1, -0.5, -0.2]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    for sign in (1.0, -1.0):
        logp.grad = None
        loss = LOSSES[name](logp, logp_b, torch.full((1, 3), sign), mask)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), name


def test_the_clamp_is_documented_and_leaves_ordinary_ratios_alone():
    lp = torch.tensor([0.0, -1.0, -2.0])
    lb = torch.tensor([-0.5, -1.0, LOGPROB_FLOOR])
    lr = clamped_log_ratio(lp, lb)
    assert lr.tolist() == [0.5, 0.0, LOG_RATIO_CLAMP]
    stats = ratio_metrics(lr, torch.ones(3, dtype=torch.bool))
    assert float(stats["ratio_max"]) == pytest.approx(math.exp(LOG_RATIO_CLAMP), rel=1e-5)
    assert all(torch.isfinite(v) for v in stats.values())
    # ordinary tokens: the PPO loss equals the unclamped formula
    logp = torch.tensor([[-0.4, -0.3]], requires_grad=True)
    logp_b = torch.tensor([[-0.5, -0.2]])
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = ppo_clip_loss(logp, logp_b, adv, torch.ones(1, 2, dtype=torch.bool))
    r = torch.exp(logp.detach() - logp_b)
    expected = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2)).mean()
    assert float(loss.detach()) == pytest.approx(float(expected))
