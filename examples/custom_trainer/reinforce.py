"""REINFORCE with a running-mean baseline, written as an astralight trainer objective.

A worked example of :class:`astralight.policy.RLPolicy`: the base class loads the model, checks
and shifts the batch, computes log-probs, micro-batches, steps AdamW, acknowledges the batch and
logs; this module only says what the loss is (:meth:`compute_loss`) and keeps its baseline
(:meth:`loss_context`, the optional once-per-batch hook). ``astralight fit`` trains it through
YAML alone::

    PYTHONPATH=examples/custom_trainer astralight fit --config examples/custom_trainer/trainer.yaml

The objective, per sample ``i`` of the optimizer batch (``N`` samples over all ranks)::

    loss = -(1/N) * sum_i (r_i - b) * sum_t mask_it * log pi(y_it | y_i<t)

**Baseline choice: an exponential moving average of past batch-mean rewards**, bias-corrected
like Adam's moments (``b = ema / (1 - decay**k)`` after ``k`` batches; ``b = 0`` before the
first). It is taken *before* the current batch's rewards enter it, so ``b`` does not depend on
the samples it weighs and the gradient stays unbiased. It lives in registered buffers
(``reward_ema``, ``baseline_updates``), so it is part of ``state_dict()``: a Lightning checkpoint
saves it and resuming restores it. (The alternative, the group mean of the sample's own task, is
what the dataflow's ``advantages`` already encode; this example deliberately uses the raw
``rewards`` to show a different objective.)

REINFORCE is an on-policy estimator: it ignores the behaviour log-probs. With astralight's
bounded staleness (``max_staleness``: samples at most that many versions old) that is a small
bias; weight by ``exp(logp - logp_behaviour)`` for an off-policy correction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from astralight.policy import RLPolicy
from astralight.rl.m2po import all_reduce_sum


class ReinforceWithBaseline(RLPolicy):
    """REINFORCE (sequence log-prob times reward minus a running-mean baseline).

    Args:
        model_path: Hugging Face model folder (version 0 of the policy).
        baseline_decay: EMA decay of the baseline over batch-mean rewards, in ``[0, 1)``;
            0 uses the previous batch's mean reward alone.
        **kwargs: every other :class:`astralight.policy.RLPolicy` argument (``model_id``,
            ``lr``, ``temperature``, ``micro_batch_size``, ``kl_coef``, ...).
    """

    def __init__(self, model_path: str, baseline_decay: float = 0.9, **kwargs: Any):
        if not 0.0 <= baseline_decay < 1.0:
            raise ValueError(f"baseline_decay: must be in [0, 1), got {baseline_decay}")
        super().__init__(model_path, **kwargs)
        self.baseline_decay = baseline_decay
        # Buffers, not attributes: they are in state_dict(), so checkpoints carry the baseline.
        self.register_buffer("reward_ema", torch.zeros((), dtype=torch.float64))
        self.register_buffer("baseline_updates", torch.zeros((), dtype=torch.int64))

    @property
    def baseline(self) -> Tensor:
        """The bias-corrected running mean of past batch rewards (0 before any batch)."""
        k = int(self.baseline_updates)
        if k == 0:
            return torch.zeros((), dtype=torch.float64, device=self.reward_ema.device)
        return self.reward_ema / (1.0 - self.baseline_decay ** k)

    def update_baseline(self, rewards: Tensor) -> None:
        """Fold one optimizer batch's mean reward (over all ranks) into the running mean."""
        local = torch.stack([rewards.double().sum(),
                             torch.tensor(float(rewards.numel()), dtype=torch.float64,
                                          device=rewards.device)])
        total = all_reduce_sum(local)
        mean = (total[0] / total[1]).to(self.reward_ema.device)
        self.reward_ema.mul_(self.baseline_decay).add_((1.0 - self.baseline_decay) * mean)
        self.baseline_updates.add_(1)

    def loss_context(self, batch: dict, logp: Tensor) -> dict[str, Any]:
        """Runs once per optimizer batch, before any backward: fix this batch's baseline (from
        earlier batches only), then fold this batch's rewards in for the next one. Every
        micro-batch of the batch sees the same ``baseline``."""
        ctx = super().loss_context(batch, logp)
        ctx["baseline"] = self.baseline.to(batch["rewards"].dtype).to(batch["rewards"].device)
        self.update_baseline(batch["rewards"])
        return ctx

    def compute_loss(self, batch: dict, logp: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``-(1/N) sum_i (r_i - b) * sum_t mask * logp`` on one (micro-)batch."""
        mask = batch["mask"]
        seq_logp = torch.where(mask, logp, torch.zeros_like(logp)).sum(dim=1)  # [b]
        advantage = batch["rewards"] - batch["baseline"]  # [b]
        loss = -(advantage * seq_logp).sum() / batch["n_samples"]
        return loss, {
            "reinforce_loss": loss.detach(),
            "baseline": batch["baseline"].detach(),
            "reinforce_advantage_mean": advantage.mean().detach(),
            "sequence_logprob_mean": seq_logp.mean().detach(),
        }
