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
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = masked_mean(per_token, m, n_tokens)
    metrics = {
        "pg_loss": loss.detach(),
        "clip_fraction": masked_mean((clipped > unclipped).float(), m).detach(),
        **ratio_metrics(log_ratio, m),
    }
    return loss, metrics
