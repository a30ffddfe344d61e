"""GRPO advantages: rewards normalised within their group, optionally again over the batch.

A group is the set of samples drawn for one task by one policy (same ``task_id`` and
``model_id``). ``A = (r - mean_g) / (std_g + eps)``; a group of one sample gets ``A = 0`` (it has
no baseline to compare with), and a group whose rewards are all equal gets ``A = 0`` too. The
dataflow computes this on ingest with :func:`group_stats` (numpy, float64: it sees one group at a
time and never imports torch); the trainer may renormalise over the batch it trains on and
broadcasts each sample's advantage to its loss-masked tokens (torch).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

#: the default ``eps`` of the advantage denominator ``std + eps``
ADV_EPS = 1e-6


def group_stats(rewards: Sequence[float], eps: float = ADV_EPS,
                scale_by_std: bool = True,
                failed_advantage: float = 0.0) -> tuple[float, float, list[float]]:
    """``(mean, std, advantages)`` of one group's rewards: the population std in float64 and
    ``A = (r - mean) / (std + eps)`` per reward, so a singleton or an all-equal group gets 0;
    ``scale_by_std=False`` gives Dr. GRPO's ``A = r - mean``.

    ``failed_advantage``: the advantage of every sample of a *failed* group -- two or more
    samples whose rewards are all equal and not above 0 -- instead of 0. A negative value lowers
    the probability of what every sample tried (negative sample reinforcement), which moves it
    to answers not yet sampled; GRPO leaves such a group without any gradient.

    The dataflow's ingest path (no torch): it stores ``mean`` and ``std`` on every sample too.
    """
    values = np.asarray(rewards, dtype=np.float64)
    mean, std = float(values.mean()), float(values.std())
    if failed_advantage and values.size > 1 and values.max() == values.min() and mean <= 0:
        return mean, std, [float(failed_advantage)] * values.size
    if not scale_by_std:
        return mean, std, [float(r - mean) for r in rewards]
    return mean, std, [(r - mean) / (std + eps) for r in rewards]


def group_ids_to_index(group_ids: Sequence[Hashable] | Tensor) -> Tensor:
    """Map arbitrary group keys (strings, tuples, ints, or a tensor of ids) to dense ids 0..G-1."""
    import torch

    if isinstance(group_ids, torch.Tensor):
        _, inverse = torch.unique(group_ids, return_inverse=True)
        return inverse.long()
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)


def group_normalized_advantages(
    rewards: Tensor,
    group_ids: Sequence[Hashable] | Tensor,
    eps: float = 1e-6,
    scale_by_std: bool = True,
    unbiased_std: bool = False,
) -> Tensor:
    """GRPO advantage of every sample: ``(r - mean_g) / (std_g + eps)`` over its group ``g``.

    ``scale_by_std=False`` gives Dr.GRPO's ``r - mean_g``. ``unbiased_std`` selects the n-1
    estimator (verl's choice); the default population std keeps ``A`` in [-sqrt(n-1), sqrt(n-1)]
    matches :func:`group_stats`, what the dataflow uses on ingest. Singletons get 0.
    """
    import torch

    rewards = rewards.float()
    if rewards.ndim != 1:
        raise ValueError(f"rewards: expected shape [N], got {tuple(rewards.shape)}")
    idx = group_ids_to_index(group_ids).to(rewards.device)
    if idx.shape[0] != rewards.shape[0]:
        raise ValueError(f"group_ids: {idx.shape[0]} ids for {rewards.shape[0]} rewards")
    n_groups = int(idx.max().item()) + 1 if idx.numel() else 0
    count = torch.zeros(n_groups, device=rewards.device).index_add_(0, idx, torch.ones_like(rewards))
    total = torch.zeros(n_groups, device=rewards.device).index_add_(0, idx, rewards)
    mean = total / count
    centered = rewards - mean[idx]
    sq = torch.zeros(n_groups, device=rewards.device).index_add_(0, idx, centered.square())
    dof = (count - 1).clamp(min=1) if unbiased_std else count
    std = (sq / dof).sqrt()
    adv = centered / (std[idx] + eps) if scale_by_std else centered
    return torch.where(count[idx] > 1, adv, torch.zeros_like(adv))


def batch_normalize(advantages: Tensor, eps: float = 1e-6, mask: Tensor | None = None,
                    reduce_sum: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Renormalise advantages to zero mean, unit (population) std over the batch (or ``mask``).

    ``reduce_sum`` sums a tensor over the ranks that share the batch (e.g.
    :func:`astralight.rl.m2po.all_reduce_sum`): with it the mean and std are those of the global
    batch, not of this rank's share (two small all-reduces: the sum and count, then the squared
    deviations from the global mean)."""
    import torch

    a = advantages.float()
    m = torch.ones_like(a, dtype=torch.bool) if mask is None else mask.bool()
    reduce_sum = reduce_sum or (lambda x: x)
    total = reduce_sum(torch.stack([torch.where(m, a, 0.0).sum(), m.sum().to(a.dtype)]))
    n = total[1].clamp(min=1)
    mean = total[0] / n
    var = reduce_sum(torch.where(m, (a - mean).square(), 0.0).sum()) / n
    return torch.where(m, (a - mean) / (var.sqrt() + eps), a)


def broadcast_to_tokens(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """Per-sample advantages [B] -> per-token [B, T], zero where ``loss_mask`` is 0."""
    if advantages.ndim != 1 or advantages.shape[0] != loss_mask.shape[0]:
        raise ValueError(
            f"advantages: expected shape [{loss_mask.shape[0]}], got {tuple(advantages.shape)}"
        )
    import torch

    return advantages.to(loss_mask.device, torch.float32)[:, None] * loss_mask.float()
