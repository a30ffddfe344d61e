"""RLOO (REINFORCE leave-one-out), an objective with a group baseline, as an astralight trainer.

A worked example of the group structure :meth:`astralight.policy.RLPolicy.prepare_batch` keeps
in the batch: ``group_ids`` (``[b]``, samples of one task share an id), ``task_ids`` and
``metadata``. The baseline of sample ``i`` is the mean reward of the *other* samples of its
group in this batch (Kool et al., 2019; Ahmadian et al., 2024)::

    A_i = r_i - mean_{j in g(i), j != i} r_j
    loss = -(1/N) * sum_i A_i * sum_t mask_it * log pi(y_it | y_i<t)

It is computed in :meth:`loss_context`, which sees the whole optimizer batch once before any
micro-batch, so every micro-batch gets the same advantages however the batch is split.

The dataflow serves samples, not groups: a group can be split between two batches (stale drops,
sample filters, a batch size that is not a multiple of the group size). A sample whose group has
no other member in the batch falls back to the dataflow's advantage (``sample_advantages``,
computed over the whole group at ingest); ``train/rloo_alone_fraction`` says how often.
Under DDP each rank sees its own share of the batch, so groups are those of the rank's share.

Run it like the REINFORCE example (``examples/custom_trainer/README.md``), with
``model: {class_path: rloo.LeaveOneOut, init_args: {...}}``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from astralight.policy import RLPolicy


def leave_one_out_advantages(rewards: Tensor, group_ids: Tensor, fallback: Tensor
                             ) -> tuple[Tensor, Tensor]:
    """``(advantages [b], alone [b] bool)``: ``r_i`` minus the mean reward of the other members
    of its group; ``fallback[i]`` where the sample is its group's only member in the batch."""
    rewards = rewards.double()
    n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    sums = torch.zeros(n_groups, dtype=torch.float64, device=rewards.device)
    counts = torch.zeros(n_groups, dtype=torch.float64, device=rewards.device)
    sums.index_add_(0, group_ids, rewards)
    counts.index_add_(0, group_ids, torch.ones_like(rewards))
    others = counts[group_ids] - 1
    alone = others == 0
    baseline = (sums[group_ids] - rewards) / others.clamp(min=1)
    advantages = torch.where(alone, fallback.double(), rewards - baseline)
    return advantages.to(fallback.dtype), alone


class LeaveOneOut(RLPolicy):
    """RLOO: sequence log-prob times the reward minus the leave-one-out group mean.

    Args:
        model_path: Hugging Face model folder (version 0 of the policy).
        **kwargs: every other :class:`astralight.policy.RLPolicy` argument.
    """

    def __init__(self, model_path: str, **kwargs: Any):
        super().__init__(model_path, **kwargs)

    def loss_context(self, batch: dict, logp: Tensor) -> dict[str, Any]:
        """Once per optimizer batch: the leave-one-out advantages of the whole batch."""
        ctx = super().loss_context(batch, logp)
        ctx["rloo_advantages"], ctx["rloo_alone"] = leave_one_out_advantages(
            batch["rewards"], batch["group_ids"], batch["sample_advantages"])
        return ctx

    def compute_loss(self, batch: dict, logp: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        mask = batch["mask"]
        seq_logp = torch.where(mask, logp, torch.zeros_like(logp)).sum(dim=1)  # [b]
        advantage = batch["rloo_advantages"]
        loss = -(advantage * seq_logp).sum() / batch["n_samples"]
        return loss, {
            "rloo_loss": loss.detach(),
            "rloo_advantage_mean": advantage.mean().detach(),
            "rloo_alone_fraction": batch["rloo_alone"].float().mean(),
        }
