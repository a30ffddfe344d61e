"""PPO-clip surrogate with GRPO's token-mean aggregation.

Per token, with ``r = exp(logp - logp_behaviour)`` and advantage ``A``:
``loss_t = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))`` and
``loss = sum(mask * loss_t) / n_tokens`` ("token-mean": every trained token weighs the same,
whatever the length of its sample). The clip only ever binds on the two quadrants where the update
would push the ratio further from 1 in the advantage's direction (A > 0 with r > 1 + eps_high,
A < 0 with r < 1 - eps_low); there the token contributes a constant and no gradient. ``log r`` is
clamped to ``+-LOG_RATIO_CLAMP`` before the exp (:func:`astralight.rl.kl.clamped_log_ratio`), so
the loss and its gradient stay finite for any finite log-probs (a behaviour log-prob at
``LOGPROB_FLOOR`` included).
"""

from __future__ import annotations

import torch
from torch import Tensor

from astralight.rl.kl import clamped_log_ratio, masked_mean, ratio_metrics


def clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float,
                      eps_high: float) -> tuple[Tensor, Tensor]:
    """Per token ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` and where the clipped
    term is the active one (PPO's pessimistic bound)."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def ppo_clip_loss(
    logp: Tensor,
    logp_behaviour: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    n_tokens: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip token-mean loss and its metrics.

    ``advantages`` is per token (same shape as ``logp``). ``clip_eps`` is eps_low and, unless
    ``clip_eps_high`` is given (DAPO's clip-higher), eps_high too. ``n_tokens`` is the
    normaliser (default: ``mask.sum()``; pass the whole batch's count for a micro-batch).

    Metrics: ``pg_loss``, ``clip_fraction`` (share of masked tokens whose clipped term is the
    active one), and :func:`ratio_metrics`.
    """
    m = mask.bool()
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = clamped_log_ratio(logp, logp_behaviour, m)
    per_token, clipped_active = clipped_surrogate(torch.exp(log_ratio), advantages, clip_eps,
                                                  eps_high)
    loss = masked_mean(per_token, m, n_tokens)
    metrics = {
        "pg_loss": loss.detach(),
        "clip_fraction": masked_mean(clipped_active.float(), m).detach(),
        **ratio_metrics(log_ratio, m),
    }
    return loss, metrics


def truncated_is_ppo_loss(
    logp: Tensor,
    logp_proximal: Tensor,
    logp_behaviour: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    is_cap: float = 2.0,
    n_tokens: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO-clip with a truncated importance weight on the behaviour policy.

    The sampler (a bf16 engine, other kernels, stale weights) is not the policy the trainer
    computes, so the ratio is split in two (AReaL's decoupled objective; verl's and slime's
    truncated importance sampling): the PPO ratio ``r = pi_theta / pi_proximal`` against the
    trainer's own log-probs of the weights this update starts from (``logp_proximal``,
    detached), clipped as PPO clips it; and a per-token weight ``w = min(pi_proximal /
    pi_behaviour, is_cap)`` (detached) that corrects for the sampler. Per token
    ``loss_t = w * max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, token-mean over
    ``n_tokens``.

    With one gradient step per update (astralight's: the proximal log-probs are recomputed at
    each update's start) ``r`` is 1 where the gradient is taken, so the clip never binds and
    the gradient is the truncated-IS policy gradient ``-w A grad log pi``: an unbiased one
    where ``w <= is_cap``, with the variance of rare tokens the sampler under-weighted cut off.

    Metrics: ``pg_loss``, ``clip_fraction``, ``is_weight_mean`` (mean ``w``),
    ``is_truncated_fraction`` (tokens whose weight hit the cap) and :func:`ratio_metrics` of
    the behaviour ratio ``pi_proximal / pi_behaviour``.
    """
    m = mask.bool()
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = clamped_log_ratio(logp, logp_proximal.detach(), m)
    behaviour = clamped_log_ratio(logp_proximal.detach(), logp_behaviour, m)
    weight = torch.exp(behaviour).clamp(max=is_cap)
    surrogate, clipped_active = clipped_surrogate(torch.exp(log_ratio), advantages, clip_eps,
                                                  eps_high)
    loss = masked_mean(weight * surrogate, m, n_tokens)
    metrics = {
        "pg_loss": loss.detach(),
        "clip_fraction": masked_mean(clipped_active.float(), m).detach(),
        "is_weight_mean": masked_mean(weight, m).detach(),
        "is_truncated_fraction": masked_mean((torch.exp(behaviour) > is_cap).float(), m).detach(),
        **ratio_metrics(behaviour, m),
    }
    return loss, metrics
