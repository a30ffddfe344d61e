"""Sequence unlikelihood on negative samples: ``-|A| log(1 - pi(y|x))``, against a collapsed policy.

Why: once a policy samples one completion with probability near 1 and that completion fails,
every sample of its group is the same, the group's advantage is 0 (GRPO) or a fixed negative
value (``failed_group_advantage``), and the policy-gradient push on it is ``|A| * grad log pi(y)``,
whose gradient on the chosen token's logit is ``|A| * (1 - pi)``: it vanishes exactly where the
policy is stuck. On a task whose answers must be *discovered* this is the plateau both astralight
and TRL's GRPO reach: the policy collapses onto a wrong answer for every fact it had not found
before its entropy fell, and never samples anything else again
(``tests/benchmarks/bench_vs_trl.py``, docs/benchmark-pages/vs-trl-facts.md).

The unlikelihood of a failed completion, ``-log(1 - pi(y|x))`` with ``pi(y|x)`` the product of its
token probabilities, has the gradient ``pi / (1 - pi) * grad log pi(y|x)``: it grows as the policy
commits to the failure, and is negligible (``~pi``) for a completion the policy rarely samples.
The gradient on each token's logit stays bounded (``pi(y|x) <= pi(y_t)``, so ``pi/(1-pi) * (1 -
pi(y_t)) <= pi(y_t) <= 1``). For a long completion (``pi(y|x)`` astronomically small) it is a
no-op, so it only acts on short answers the policy repeats verbatim. It needs no importance ratio
(the sample is known to be wrong whichever policy drew it), so it is as valid on stale samples as
on fresh ones.

Weighting: a sample's weight is its negative advantage, ``max(0, -A)``; a sample with ``A >= 0``
gets none. The failures of a mixed group have ``A < 0`` already; those of a group in which
*every* sample failed have ``A = 0`` under GRPO, so they count only with the dataflow's
``failed_group_advantage`` set below 0 (which also makes the policy-gradient term push them).
Welleck et al. 2019 ("Neural text generation with unlikelihood training") introduced the
token-level form; this is its sequence-level form on the policy's own failures.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astralight.rl.kl import masked_sum

#: the value of ``log pi(y|x)`` is capped at this (``pi <= 1 - 1e-6``) so that ``log(1 - pi)``
#: stays finite; its gradient passes the cap unchanged (a completion the policy is certain of
#: still gets pushed, with the weight ``pi / (1 - pi)`` held at 1e6)
MAX_SEQ_LOGP = -1e-6


def sequence_logprobs(logp: Tensor, mask: Tensor) -> Tensor:
    """``log pi(y|x)`` of every sample: its token log-probs summed over ``mask`` (``[B]``,
    float32); masked-out entries never contribute, even if NaN/inf."""
    return masked_sum(logp.float(), mask, dim=-1)


def unlikelihood_penalty(
    logp: Tensor,
    mask: Tensor,
    sample_advantages: Tensor,
    coef: float,
    n_samples: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``coef * sum_i max(0, -A_i) * -log(1 - pi(y_i|x_i)) / n_samples`` and its metrics.

    ``logp`` / ``mask`` are ``[B, T]`` (the policy's token log-probs with grad, the trained
    tokens), ``sample_advantages`` ``[B]``. ``n_samples`` defaults to ``B``; pass the whole
    batch's sample count when this is one micro-batch so micro-batch losses add up.

    Metrics: ``unlikelihood_loss`` (the normalised penalty) and ``negative_seq_prob`` (the mean
    ``pi(y|x)`` of the negative samples, 0 if none: how sure the policy is of what fails; near 1
    is a collapsed policy).
    """
    if logp.ndim != 2 or mask.shape != logp.shape:
        raise ValueError(f"logp / mask: expected two [B, T] tensors of one shape, got "
                         f"{tuple(logp.shape)} and {tuple(mask.shape)}")
    if sample_advantages.shape != logp.shape[:1]:
        raise ValueError(f"sample_advantages: expected shape [{logp.shape[0]}], got "
                         f"{tuple(sample_advantages.shape)}")
    raw = sequence_logprobs(logp, mask)
    seq = raw - (raw - raw.clamp(max=MAX_SEQ_LOGP)).detach()  # capped value, gradient kept
    weight = (-sample_advantages.detach().float().to(seq.device)).clamp(min=0.0)
    per_sample = -torch.log(-torch.expm1(seq))  # -log(1 - pi)
    denom = torch.as_tensor(logp.shape[0] if n_samples is None else n_samples,
                            dtype=torch.float32, device=seq.device).clamp(min=1)
    loss = coef * (weight * per_sample).sum() / denom
    negative = weight > 0
    prob = (seq.detach().exp()[negative].mean() if bool(negative.any())
            else torch.zeros((), device=seq.device))
    return loss, {"unlikelihood_loss": loss.detach(), "negative_seq_prob": prob}
