"""The policy's per-step metrics: micro-batch combination, batch statistics, throughput.

:meth:`astralight.policy.RLPolicy.training_step` logs the objective's metrics combined over
micro-batches (:func:`combine_metrics`) and the batch's reward, advantage and staleness
statistics (:func:`batch_stats`) as ``train/<name>``, and the step timing
(:func:`perf_metrics`) as ``perf/<name>``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def combine_metrics(parts: list[tuple[float, dict[str, Tensor]]],
                    add_losses: bool = True) -> dict[str, Tensor]:
    """Combine micro-batch metrics: ``*_loss`` add up (each is already normalised by the whole
    batch; with ``add_losses=False`` they are averaged like the rest), ``*_max``/``*_min`` take
    max/min, everything else a mean weighted by each part's weight (its loss tokens)."""
    out: dict[str, Tensor] = {}
    keys = {k for _, m in parts for k in m}
    for key in sorted(keys):
        vals = [(w, torch.as_tensor(m[key]).detach().float()) for w, m in parts if key in m]
        stacked = torch.stack([v for _, v in vals])
        weights = torch.tensor([w for w, _ in vals], device=stacked.device)
        if add_losses and key.endswith("_loss"):
            out[key] = stacked.sum()
        elif key.endswith("_max"):
            out[key] = stacked.max()
        elif key.endswith("_min"):
            out[key] = stacked.min()
        elif float(weights.sum()) > 0:
            out[key] = (stacked * weights).sum() / weights.sum()
        else:
            out[key] = stacked.mean()
    return out


def mean_over_updates(updates: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Combine the metrics of a batch's several optimizer updates (``minibatches`` /
    ``batch_passes``) into one logged value per key: ``*_max``/``*_min`` by max/min, everything
    else (losses included: each update's is normalised by its own part) the plain mean."""
    return combine_metrics([(1.0, m) for m in updates], add_losses=False)


def staleness_reference(batch: dict) -> int | None:
    """The version staleness is measured against: the batch's ``trainer_version`` (the
    version of the weights this step is applied to, stamped by the datamodule from the
    WeightPublisher), else -- no publisher numbers this trainer's weights -- the
    ``policy_version`` the dataflow knew when serving it; None if neither is there."""
    version = batch.get("trainer_version")
    if version is None:
        version = batch.get("policy_version")
    return None if version is None else int(version)


def batch_stats(batch: dict, prepared: dict, reference: int | None) -> dict[str, Tensor]:
    """Reward, advantage and staleness statistics of the batch (detached scalars).

    ``staleness_mean`` / ``staleness_max``: per sample with loss tokens, ``reference`` (the
    version staleness is measured against, e.g. :func:`staleness_reference`) minus the oldest
    version behind its loss-masked tokens; mean / max over those samples. ``policy_version`` is
    the dataflow's version at serving, ``trainer_version`` the trainer's own (when known).
    """
    rewards = prepared["rewards"]
    adv = prepared["sample_advantages"]
    mask = prepared["mask"]
    stats = {
        "reward_mean": rewards.mean(),
        "reward_std": rewards.std(unbiased=False),
        "advantage_mean": adv.mean(),
        "advantage_std": adv.std(unbiased=False),
        "advantage_min": adv.min(),
        "advantage_max": adv.max(),
        "response_tokens_mean": mask.sum(1).float().mean(),
        "zero_advantage_fraction": (adv == 0).float().mean(),
    }
    if reference is not None:
        versions = prepared["versions"]
        has = mask.any(1)
        big = torch.iinfo(versions.dtype).max
        oldest = torch.where(mask, versions, torch.full_like(versions, big)).min(1).values
        if bool(has.any()):
            staleness = (reference - oldest[has]).float()
            stats["staleness_mean"] = staleness.mean()
            stats["staleness_max"] = staleness.max()
    if batch.get("policy_version") is not None:
        stats["policy_version"] = torch.tensor(float(batch["policy_version"]))
    if batch.get("trainer_version") is not None:
        stats["trainer_version"] = torch.tensor(float(batch["trainer_version"]))
    return {k: v.detach().float() for k, v in stats.items()}


def perf_metrics(prepared: dict, wait_s: float, compute_s: float,
                 interval: float) -> dict[str, float]:
    """The ``perf/*`` metrics of one step: ``wait_s`` waiting for the batch, ``compute_s``
    computing on it, ``interval`` since the previous step's end (the rates' denominator)."""
    def rate(amount: float) -> float:
        return amount / interval if interval > 0 else 0.0

    return {
        "perf/wait_s": wait_s,
        "perf/step_compute_s": compute_s,
        "perf/wait_fraction": rate(wait_s),
        "perf/samples_per_s": rate(prepared["input_ids"].shape[0]),
        "perf/tokens_per_s": rate(float(prepared["attention_mask"].sum())),
        "perf/trained_tokens_per_s": rate(float(prepared["mask"].sum())),
    }
