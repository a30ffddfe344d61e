"""KL estimators and importance-ratio statistics over masked token tensors.

Every function takes per-token tensors of the same shape and a ``mask`` (1 where a token is
trained); nothing here knows about models or batches. The KL penalty uses Schulman's k3 estimator
(http://joschu.net/blog/kl-approx.html): unbiased for KL(pi_theta || pi_ref) when tokens are drawn
from pi_theta, always >= 0, and with low variance.

**Bounded log-ratios.** Every loss in :mod:`astralight.rl` exponentiates a log-ratio only after
clamping it to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` (:func:`clamped_log_ratio`; verl clamps at
the same 20). Behaviour log-probs are bounded below by ``astralight.protocol.LOGPROB_FLOOR``
(-1000) on ingest, so a log-ratio can reach +1000 and ``exp`` of it overflows float32 (inf loss,
NaN gradients); clamped, ``r <= exp(20) ~ 4.9e8`` stays finite. A token beyond the clamp gets no
gradient through its ratio (it is far outside any trust region; M2PO masks it anyway).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: |log r| beyond this is clamped before any exp (see the module docstring)
LOG_RATIO_CLAMP = 20.0


def clamped_log_ratio(logp: Tensor, logp_behaviour: Tensor, mask: Tensor | None = None) -> Tensor:
    """``logp - logp_behaviour`` clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]``, and 0 off
    ``mask`` (when given) so that nothing there can overflow or leak NaN into a gradient."""
    lr = (logp - logp_behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if mask is None:
        return lr
    return torch.where(mask.bool(), lr, torch.zeros_like(lr))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over ``mask`` (all of it, or along ``dim``); masked-out entries never
    contribute, even if NaN/inf."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, denom: Tensor | float | None = None) -> Tensor:
    """Mean of ``x`` over ``mask`` (or ``sum / denom`` when given); 0 for an empty mask."""
    total = masked_sum(x, mask)
    if denom is None:
        denom = mask.sum()
    denom = torch.as_tensor(denom, dtype=total.dtype, device=total.device)
    return total / denom.clamp(min=1)


def kl_k3(logp: Tensor, ref_logp: Tensor, clamp: float | None = 10.0) -> Tensor:
    """k3 = exp(d) - d - 1 with d = log pi_ref - log pi_theta (unbiased, >= 0, low variance).

    ``clamp`` bounds the per-token value (verl's ``low_var_kl`` uses 10) so that one token the
    reference finds far likelier than the policy cannot blow up the loss; ``None`` disables it.
    ``d`` itself is clamped to ``+-LOG_RATIO_CLAMP`` before the exp, so the value and its gradient
    stay finite whatever the log-probs (clamping only the result would leave ``0 * inf`` = NaN
    in the gradient of an overflowing token).
    """
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kl = torch.exp(d) - d - 1.0
    if clamp is not None:
        kl = kl.clamp(min=-clamp, max=clamp)
    return kl


def kl_penalty(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    kl_coef: float,
    n_tokens: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``kl_coef * sum(mask * k3) / n_tokens`` and its metrics.

    ``kl_k3`` is the mean k3 over these tokens; ``kl_loss`` the (normalised) penalty itself.

    ``n_tokens`` defaults to ``mask.sum()``; pass the whole batch's token count when this is one
    micro-batch so that micro-batch losses add up to the batch loss.
    """
    per_token = kl_k3(logp, ref_logp)
    loss = kl_coef * masked_mean(per_token, mask, n_tokens)
    return loss, {"kl_k3": masked_mean(per_token.detach(), mask), "kl_loss": loss.detach()}


def ratio_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Statistics of r = exp(log_ratio) over the masked tokens (all detached).

    ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``log_ratio_abs_mean`` and ``m2`` (the mean of
    (log r)^2, M2PO's statistic). An empty mask gives ratio 1 and zero spreads. ``log_ratio`` is
    clamped to ``+-LOG_RATIO_CLAMP`` first, so the statistics stay finite (a NaN stays NaN).
    """
    lr = log_ratio.detach().float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    m = mask.bool()
    if not bool(m.any()):
        one = torch.ones((), device=lr.device)
        zero = torch.zeros((), device=lr.device)
        return {"ratio_mean": one, "ratio_min": one, "ratio_max": one,
                "log_ratio_abs_mean": zero, "m2": zero}
    vals = lr[m]
    r = torch.exp(vals)
    return {
        "ratio_mean": r.mean(),
        "ratio_min": r.min(),
        "ratio_max": r.max(),
        "log_ratio_abs_mean": vals.abs().mean(),
        "m2": vals.square().mean(),
    }
