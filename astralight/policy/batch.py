"""A trainer batch on its way into the objective: checked, shifted to next-token targets, sliced.

The batch comes from :func:`astralight.datamodules.rollout.collate_batch` (right-padded
``[B, T]`` tensors plus per-sample lists). :func:`check_batch` refuses one the policy cannot
train on correctly; :func:`prepare_batch` shifts it (``[:, 1:]``, aligned with the policy's
log-probs) and adds the group structure; :func:`micro_slices` / :func:`slice_batch` cut it into
micro-batches, :func:`even_slices` into the parts of a batch that get one optimizer update each.
:class:`astralight.policy.RLPolicy` calls these from its methods of the same names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from astralight.protocol import temperature_mismatch
from astralight.rl.advantages import batch_normalize, broadcast_to_tokens
from astralight.rl.m2po import all_reduce_sum

#: keys every trainer batch has (see :func:`astralight.datamodules.rollout.collate_batch`)
BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "behaviour_logprobs", "versions",
              "advantages", "rewards")
#: plain (non-tensor) batch values :func:`prepare_batch` passes on (None when absent)
PLAIN_KEYS = ("batch_id", "model_id", "policy_version", "trainer_version")


def check_batch(batch: dict, model_id: str, temperature: float) -> None:
    """Refuse a batch a policy of ``model_id`` sampled at ``temperature`` cannot train on
    correctly, naming the field and the fix."""
    if type(batch).__name__ == "PendingPull":
        raise TypeError("got an unresolved PendingPull: pass the RolloutDataModule to fit() as "
                        "datamodule=..., not its train_dataloader(), so it can pull batches")
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise KeyError(f"trainer batch lacks {missing}; see astralight.datamodules.rollout.collate_batch")
    mid = batch.get("model_id")
    if mid is not None and mid != model_id:
        raise ValueError(
            f"batch.model_id: got samples of {mid!r} but this module trains {model_id!r}; "
            "set the datamodule's and the module's model_id to the same policy")
    temps = batch.get("temperature")
    if temps is not None:
        t = torch.as_tensor(temps, dtype=torch.float64).reshape(-1)
        # the same check the dataflow makes on ingest (its ``temperatures`` config)
        bad = [x for x in t[~torch.isnan(t)].tolist() if temperature_mismatch(x, temperature)]
        if bad:
            t_sample = f"{float(bad[0]):g}"
            raise ValueError(
                f"sample temperature {t_sample} != module temperature {temperature:g}: "
                "the behaviour log-probs were computed at the sampling temperature, so the "
                "ratio would be wrong; set the policy's temperature (model.init_args."
                f"temperature={t_sample}) or the workflow's sampling temperature to match")


def prepare_batch(batch: dict, normalize_advantages: bool) -> dict[str, Any]:
    """The shifted batch documented at :meth:`astralight.policy.RLPolicy.prepare_batch`.

    ``normalize_advantages`` renormalises the advantages over the global batch (every rank's
    share, summed with :func:`astralight.rl.m2po.all_reduce_sum`). ``group_ids`` number the
    samples' ``task_ids`` in order of first appearance; a batch without one task id per sample
    (one built by hand) gives every sample its own group, and one without one metadata dict
    per sample gets empty ones.
    """
    attention = batch["attention_mask"]
    mask = (batch["loss_mask"][:, 1:] > 0) & (attention[:, 1:] > 0)
    adv = batch["advantages"].float()
    if normalize_advantages:
        adv = batch_normalize(adv, reduce_sum=all_reduce_sum)
    n = batch["input_ids"].shape[0]
    task_ids = list(batch.get("task_ids") or [])
    if len(task_ids) != n:
        task_ids = [f"sample-{i}" for i in range(n)]
    first: dict[Any, int] = {}
    group_ids = torch.tensor([first.setdefault(t, len(first)) for t in task_ids],
                             dtype=torch.long, device=batch["input_ids"].device)
    metadata = list(batch.get("metadata") or [])
    if len(metadata) != n:
        metadata = [{} for _ in range(n)]
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": attention,
        "mask": mask,
        "logp_behaviour": batch["behaviour_logprobs"][:, 1:].float(),
        "versions": batch["versions"][:, 1:],
        "advantages": broadcast_to_tokens(adv, mask),
        "sample_advantages": adv,
        "rewards": batch["rewards"].float(),
        "group_ids": group_ids,
        "task_ids": task_ids,
        "metadata": metadata,
        **{key: batch.get(key) for key in PLAIN_KEYS},
    }


def micro_slices(n: int, size: int | None) -> list[slice]:
    """Slices of ``size`` samples covering a batch of ``n`` (``None``: one slice of all)."""
    size = size or n
    return [slice(i, min(n, i + size)) for i in range(0, n, size)] or [slice(0, 0)]


def even_slices(n: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices covering a batch of ``n`` (``n >= parts``), in order, of
    (nearly) equal size: the first ``n % parts`` one sample larger."""
    base, extra = divmod(n, parts)
    return [slice(i * base + min(i, extra), (i + 1) * base + min(i + 1, extra))
            for i in range(parts)]


def slice_batch(batch: dict, sl: slice, n: int) -> dict:
    """One micro-batch: every tensor whose first dimension is the batch, and every list of
    one entry per sample (``task_ids``, ``metadata``), sliced; everything else as is."""
    def cut(v):
        if isinstance(v, Tensor) and v.ndim > 0 and v.shape[0] == n:
            return v[sl]
        if isinstance(v, list) and len(v) == n:
            return v[sl]
        return v

    return {k: cut(v) for k, v in batch.items()}
