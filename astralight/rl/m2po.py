"""M2PO: Second-Moment Trust Policy Optimization (arXiv 2510.01161), and the released variant.

**Paper objective** (``m2po_loss``). Per loss-masked token ``log r = logp_theta - logp_behaviour``.
Over *all* loss-masked tokens of the batch, the second moment ``M2 = mean((log r)^2)`` is the trust
statistic. Sort ``(log r)^2`` descending and mask the smallest prefix of that order (the largest
values) such that the mean over the remaining tokens is ``<= m2_threshold`` (paper default 0.04).
Then ``loss = -sum(keep * r * A) / n_tokens`` where ``n_tokens`` counts all loss-masked tokens
(masked ones included), with no ratio clipping. Removing the largest value never raises the mean,
so the smallest such prefix is the first index where the suffix mean drops under the threshold;
ties are broken by a stable sort (lower flat index kept masked first). NaN/inf values sort first
and are always masked.

The statistic is over the whole optimizer batch: :func:`m2_select_global` all-gathers the flat
``(log r)^2`` vectors of every rank (padded ``all_gather``; no-op without an initialised process
group), selects on the concatenation, and returns this rank's slice. With gradient accumulation
the caller computes the selection once from a no-grad pass over the whole batch and hands the
``keep`` mask to every micro-batch.

**Released-code variant** (``m2po_harmful_loss``; Infini-AI-Lab/M2PO, ``compute_m2po_policy_loss``).
Only *harmful* tokens are constrained: ``A > 0 and r > 1`` or ``A < 0 and r < 1`` (the update would
push the ratio further from 1 in the advantage's direction). Exactly what is implemented here:

1. ``v`` = ``(log r)^2`` of the harmful loss-masked tokens (gathered over ranks), ``n_h = len(v)``.
   ``m2_before = mean(v)``. If ``n_h == 0`` or ``m2_before <= m2_threshold`` nothing is constrained.
2. Otherwise find ``tau``: with ``v`` sorted ascending, ``tau^2`` is the largest ``v_j`` whose
   *capped* mean ``mean(min(v, v_j))`` is ``<= m2_threshold`` (``tau = 0`` if none);
   ``m2_after`` is that capped mean. (The released code walks the same breakpoints; it uses
   ``<`` with 1e-12 slacks where this uses ``<=``.)
3. Ratio bounds ``eps_low = 1 - exp(-tau)``, ``eps_high = exp(tau) - 1``, optionally floored by
   ``min_eps_low`` / ``min_eps_high`` (the released code's ``miniclip_low/high``; its training
   scripts leave them unset, so the defaults are ``None``).
4. PPO form: ``loss_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, token-mean over all
   loss-masked tokens. The clip binds only on harmful tokens with ``|log r| > tau`` (before the
   floors): those contribute a constant and **no gradient**, i.e. they are masked from the update,
   while non-harmful tokens are never constrained. ``masked_fraction`` reports that share.

Differences from the released code, on purpose: the selection is over the whole batch (all ranks,
all micro-batches) rather than per micro-batch, and ``n_tokens`` may be the batch's token count.

Both losses exponentiate ``log r`` only after clamping it to ``+-LOG_RATIO_CLAMP``
(:func:`astralight.rl.kl.clamped_log_ratio`), so they and their gradients stay finite for any
finite log-probs (a behaviour log-prob at ``LOGPROB_FLOOR`` included); the selections see the
unclamped values (an extreme token is masked first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from astralight.rl.kl import clamped_log_ratio, masked_mean, ratio_metrics


# ----------------------------------------------------------------------------- distributed


def _distributed(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def gather_flat(x: Tensor, group=None) -> tuple[Tensor, int]:
    """Concatenate the 1-D tensors ``x`` of every rank (rank order); return it and this rank's offset.

    Ranks may hold different lengths: sizes are all-gathered first, then values padded to the
    longest. Without an initialised process group (or world size 1) returns ``(x, 0)``.
    """
    x = x.reshape(-1)
    if not _distributed(group):
        return x, 0
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    size = torch.tensor([x.numel()], device=x.device, dtype=torch.long)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    counts = [int(s.item()) for s in sizes]
    longest = max(counts)
    padded = x.new_zeros(longest)
    padded[: x.numel()] = x
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded.contiguous(), group=group)
    allx = torch.cat([b[:c] for b, c in zip(bufs, counts)])
    return allx, sum(counts[:rank])


def all_reduce_sum(x: Tensor, group=None) -> Tensor:
    """Sum of ``x`` over ranks (a copy; ``x`` itself when not distributed)."""
    if not _distributed(group):
        return x
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


# ----------------------------------------------------------------------------- paper selection


@dataclass
class M2Selection:
    """Result of the M2 selection; ``keep`` is for this rank's tokens, statistics are global."""

    keep: Tensor  # bool [n_local]: True = token stays in the loss
    m2_before: Tensor  # mean (log r)^2 over all tokens (whole batch)
    m2_after: Tensor  # mean over the kept tokens (0 if none kept)
    n_total: int  # tokens in the whole batch
    n_masked: int  # tokens masked in the whole batch

    @property
    def masked_fraction(self) -> float:
        return self.n_masked / self.n_total if self.n_total else 0.0


def m2_select(sq: Tensor, m2_threshold: float) -> M2Selection:
    """Paper M2 selection on a flat vector of ``(log r)^2`` values (one process, no gathering).

    Masks the smallest prefix of the descending order such that the mean of the rest is
    ``<= m2_threshold``. Computed in float64; stable sort, so ties resolve by index.
    """
    sq = sq.detach().reshape(-1)
    n = sq.numel()
    zero = torch.zeros((), dtype=torch.float64, device=sq.device)
    if n == 0:
        return M2Selection(torch.zeros(0, dtype=torch.bool, device=sq.device), zero, zero, 0, 0)
    s64 = sq.double()
    # NaN sorts first in a descending sort; map inf-like garbage to +inf so it is masked first too.
    s64 = torch.where(torch.isnan(s64), torch.full_like(s64, float("inf")), s64)
    order = torch.sort(s64, descending=True, stable=True).indices
    s_sorted = s64[order]
    finite = torch.isfinite(s_sorted)
    # suffix sums of the sorted values: suffix[k] = sum(s_sorted[k:]); inf entries make it inf.
    suffix = torch.flip(torch.cumsum(torch.flip(torch.where(finite, s_sorted, zero), [0]), 0), [0])
    n_inf_suffix = torch.flip(torch.cumsum(torch.flip((~finite).long(), [0]), 0), [0])
    remaining = torch.arange(n, 0, -1, device=sq.device, dtype=torch.float64)
    mean_after = torch.where(n_inf_suffix > 0, torch.full_like(suffix, float("inf")),
                             suffix / remaining)
    ok = mean_after <= m2_threshold
    k = int(torch.argmax(ok.int()).item()) if bool(ok.any()) else n  # how many to mask
    keep_sorted = torch.arange(n, device=sq.device) >= k
    keep = torch.empty(n, dtype=torch.bool, device=sq.device)
    keep[order] = keep_sorted
    m2_before = s64.mean()
    m2_after = mean_after[k] if k < n else zero
    return M2Selection(keep, m2_before, m2_after, n, k)


def m2_select_global(sq_local: Tensor, m2_threshold: float, group=None) -> M2Selection:
    """:func:`m2_select` over the concatenation of every rank's ``sq_local``; ``keep`` is local.

    Every rank computes the same selection on the same gathered vector (deterministic stable
    sort), then keeps its own slice, so the masked set is exactly the single-process one.
    """
    sq_local = sq_local.detach().reshape(-1)
    allsq, offset = gather_flat(sq_local, group)
    sel = m2_select(allsq, m2_threshold)
    sel.keep = sel.keep[offset: offset + sq_local.numel()]
    return sel


def m2po_keep_mask(
    logp: Tensor, logp_behaviour: Tensor, mask: Tensor, m2_threshold: float = 0.04, group=None
) -> tuple[Tensor, M2Selection]:
    """The paper's keep mask (same shape as ``logp``; False off ``mask``) for a whole batch."""
    m = mask.bool()
    log_ratio = (logp - logp_behaviour).detach()
    sel = m2_select_global(log_ratio[m].double().square(), m2_threshold, group)
    keep = torch.zeros_like(m)
    keep[m] = sel.keep
    return keep, sel


def m2po_loss(
    logp: Tensor,
    logp_behaviour: Tensor,
    advantages: Tensor,
    mask: Tensor,
    m2_threshold: float = 0.04,
    keep: Tensor | None = None,
    n_tokens: Tensor | float | None = None,
    selection: M2Selection | None = None,
    group=None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Paper M2PO loss ``-sum(keep * r * A) / n_tokens`` and its metrics.

    ``logp`` (with grad), ``logp_behaviour``, per-token ``advantages`` and ``mask`` share one
    shape. Without ``keep`` the selection is computed here over these tokens (gathered over ranks
    when a process group is up); with gradient accumulation pass the ``keep`` mask (and its
    ``selection`` for the metrics) computed once over the whole batch, and ``n_tokens`` = the
    whole batch's loss-masked token count.

    Metrics: ``pg_loss``, ``m2_before``, ``m2_after``, ``masked_fraction``, ratio statistics.
    """
    m = mask.bool()
    if keep is None:
        keep, selection = m2po_keep_mask(logp, logp_behaviour, m, m2_threshold, group)
    keep = keep.bool() & m
    # log r is zeroed on dropped tokens before exp so that an overflowing ratio there cannot
    # leak NaN into the gradient through torch.where.
    log_ratio = clamped_log_ratio(logp, logp_behaviour, keep)
    ratio = torch.exp(log_ratio)
    loss = masked_mean(-ratio * advantages, keep, n_tokens if n_tokens is not None else m.sum())
    metrics = {"pg_loss": loss.detach(),
               **ratio_metrics((logp - logp_behaviour).detach(), m)}
    if selection is not None:
        metrics.update(
            m2_before=selection.m2_before.float(),
            m2_after=selection.m2_after.float(),
            masked_fraction=torch.tensor(selection.masked_fraction),
        )
    return loss, metrics


# ----------------------------------------------------------------------------- released variant


def harmful_token_mask(log_ratio: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Tokens whose update pushes r further from 1 in A's direction: (A>0, r>1) or (A<0, r<1)."""
    return mask.bool() & (((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0)))


@dataclass
class HarmfulClip:
    """Clip range chosen by the released variant for one batch (statistics over the whole batch)."""

    tau: float  # bound on |log r| for harmful tokens; inf when inactive
    eps_low: float  # clip(r, 1 - eps_low, 1 + eps_high)
    eps_high: float
    m2_before: float  # mean (log r)^2 over harmful tokens
    m2_after: float  # capped mean at tau^2
    n_harmful: int
    active: bool


def solve_harmful_tau(sq_harmful: Tensor, m2_threshold: float) -> tuple[float, float]:
    """``(tau, capped_mean)``: largest breakpoint ``tau^2 = v_j`` with ``mean(min(v, v_j)) <= thr``.

    ``tau = 0`` (and capped mean 0) when even the smallest value breaks the budget; ``inf`` when
    nothing needs capping.
    """
    v = torch.sort(sq_harmful.detach().double().reshape(-1)).values
    n = v.numel()
    if n == 0 or float(v.mean()) <= m2_threshold:
        return float("inf"), float(v.mean()) if n else 0.0
    csum = torch.cumsum(v, 0)
    rest = torch.arange(n - 1, -1, -1, device=v.device, dtype=torch.float64)  # n - j - 1
    capped_mean = (csum + v * rest) / n  # mean(min(v, v_j)) for each j; non-decreasing in j
    ok = capped_mean <= m2_threshold
    if not bool(ok.any()):
        return 0.0, 0.0
    j = int(ok.nonzero().max().item())
    return float(v[j].sqrt()), float(capped_mean[j])


def m2_harmful_clip(
    logp: Tensor,
    logp_behaviour: Tensor,
    advantages: Tensor,
    mask: Tensor,
    m2_threshold: float = 0.04,
    min_eps_low: float | None = None,
    min_eps_high: float | None = None,
    group=None,
) -> HarmfulClip:
    """Steps 1-3 of the released variant over the whole batch (gathered over ranks)."""
    log_ratio = (logp - logp_behaviour).detach()
    harmful = harmful_token_mask(log_ratio, advantages, mask)
    v, _ = gather_flat(log_ratio[harmful].double().square(), group)
    n_h = v.numel()
    m2_before = float(v.double().mean()) if n_h else 0.0
    tau, m2_after = solve_harmful_tau(v, m2_threshold)
    if tau == float("inf"):
        return HarmfulClip(float("inf"), 1.0, float("inf"), m2_before, m2_after, n_h, False)
    eps_low = 1.0 - float(torch.exp(torch.tensor(-tau, dtype=torch.float64)))
    eps_high = float(torch.exp(torch.tensor(tau, dtype=torch.float64))) - 1.0
    if min_eps_low is not None:
        eps_low = max(eps_low, min_eps_low)
    if min_eps_high is not None:
        eps_high = max(eps_high, min_eps_high)
    return HarmfulClip(tau, eps_low, eps_high, m2_before, m2_after, n_h, True)


def m2po_harmful_loss(
    logp: Tensor,
    logp_behaviour: Tensor,
    advantages: Tensor,
    mask: Tensor,
    m2_threshold: float = 0.04,
    clip: HarmfulClip | None = None,
    n_tokens: Tensor | float | None = None,
    min_eps_low: float | None = None,
    min_eps_high: float | None = None,
    group=None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Released-code M2PO (see module docstring): adaptive PPO clip on harmful tokens only.

    Pass ``clip`` (from :func:`m2_harmful_clip` over the whole batch) when this is a micro-batch.
    Metrics: ``pg_loss``, ``m2_before``/``m2_after`` (over harmful tokens), ``m2_all`` (over all
    tokens), ``masked_fraction`` (share of loss-masked tokens whose gradient the clip removes),
    ``harmful_fraction``, ``tau``, ``eps_low``, ``eps_high``, ratio statistics.
    """
    m = mask.bool()
    if clip is None:
        clip = m2_harmful_clip(logp, logp_behaviour, advantages, m, m2_threshold,
                               min_eps_low, min_eps_high, group)
    log_ratio = clamped_log_ratio(logp, logp_behaviour, m)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    if clip.active:
        clipped = -advantages * torch.clamp(ratio, 1.0 - clip.eps_low, 1.0 + clip.eps_high)
        per_token = torch.maximum(unclipped, clipped)
        bound = (clipped > unclipped) & m
    else:
        per_token = unclipped
        bound = torch.zeros_like(m)
    loss = masked_mean(per_token, m, n_tokens if n_tokens is not None else m.sum())
    harmful = harmful_token_mask(log_ratio.detach(), advantages, m)
    dev = logp.device
    stats = ratio_metrics(log_ratio.detach(), m)
    stats["m2_all"] = stats.pop("m2")
    metrics = {
        "pg_loss": loss.detach(),
        **stats,
        "m2_before": torch.tensor(clip.m2_before, device=dev),
        "m2_after": torch.tensor(clip.m2_after, device=dev),
        "masked_fraction": masked_mean(bound.float(), m).detach(),
        "harmful_fraction": masked_mean(harmful.float(), m).detach(),
        "tau": torch.tensor(min(clip.tau, 1e6), device=dev),
        "eps_low": torch.tensor(clip.eps_low, device=dev),
        "eps_high": torch.tensor(min(clip.eps_high, 1e6), device=dev),
    }
    return loss, metrics
