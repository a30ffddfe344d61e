"""Ingest of a task's pushed samples: the checks that refuse them, the sample filters, and
the group-normalised advantages stored on them.

Plain functions over what the service holds (the current versions, the registered limits,
the config's values), so the :class:`~astralight.dataflow.core.Dataflow` facade calls them
under its lock and inside or before its transaction as it needs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

from astralight.dataflow import membership
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.plugins import DataPlugin
from astralight.protocol import (LOGPROB_FLOOR, MAX_VOCAB_SIZE, ProtocolError, Sample,
                                 check_sample_metadata)
from astralight.rl.advantages import group_stats

#: ``(vocab, vocab_source, max_len, max_len_source)`` a policy's pushed samples must respect
Limits = tuple[int, str, int | None, str]


def sample_limits(instance_id: str, model_id: str, vocab_sizes: Mapping[str, int],
                  instance_limits: Mapping[str, dict]) -> Limits:
    """What a sample of ``model_id`` pushed by ``instance_id`` must respect. The vocabulary:
    ``vocab_sizes`` of the config, else what the pushing instance registered, else what another
    instance registered, else :data:`MAX_VOCAB_SIZE` (nothing known: only ids no tokenizer has
    are refused). The length: the pushing instance's registered ``max_model_len``, else the
    pool's largest, else None (unchecked: the body limit ``max_body_bytes`` still bounds it).
    ``instance_limits``: what each instance registered per model_id."""
    own = instance_limits.get(instance_id, {}).get(model_id, {})
    pool = membership.pool_limits(model_id, instance_limits.values())
    if model_id in vocab_sizes:
        vocab, vsrc = vocab_sizes[model_id], f"vocab_sizes.{model_id}"
    elif "vocab_size" in own:
        vocab, vsrc = own["vocab_size"], f"the vocab_size instance {instance_id} registered"
    elif "vocab_size" in pool:
        vocab, vsrc = pool["vocab_size"], "the vocab_size a RaaS registered"
    else:
        vocab, vsrc = MAX_VOCAB_SIZE, "MAX_VOCAB_SIZE (no vocabulary known: set vocab_sizes)"
    if "max_model_len" in own:
        max_len, lsrc = own["max_model_len"], (f"the max_model_len instance {instance_id} "
                                               "registered")
    elif "max_model_len" in pool:
        max_len, lsrc = pool["max_model_len"], "the largest max_model_len a RaaS registered"
    else:
        max_len, lsrc = None, ""
    return int(vocab), vsrc, max_len, lsrc


def validate_samples(row, model_ids: list[str], samples: list[Sample], *, limit: int,
                     limits_of: Callable[[str], Limits], versions: Mapping[str, int],
                     temperatures: Mapping[str, float]) -> None:
    """Refuse (422 naming ``samples[i].<field>``) a push whose samples the trainer could
    not train on correctly; one bad sample refuses the whole push (the task stays open and
    the RaaS hands it back as failed). ``row``: the pushed task; ``limit``: the most samples
    it may deliver; ``limits_of``: a policy's :data:`Limits` for the pushing instance
    (:func:`sample_limits`). Per sample, besides its task, model_id and index:

    * token ids in ``[0, vocab)`` and at most ``max_model_len`` tokens (the config's
      ``vocab_sizes``, else what the RaaS engines registered; ids below ``MAX_VOCAB_SIZE``
      when no vocabulary is known);
    * no token of a version newer than the policy's current one (``versions``) -- on *any*
      token, masked or not (a sample claiming a future version would never go stale);
    * at least one loss-masked token: a sample with none has nothing to train on, and its
      staleness could not be measured. Such a sample is **refused**, not dropped (a workflow
      should not emit it);
    * behaviour log-probs >= ``LOGPROB_FLOOR`` (no engine samples a less likely token);
    * metadata the trainer reads (:func:`astralight.protocol.check_sample_metadata`): on a
      train task a sampling temperature that matches ``temperatures`` of the config.
    """
    if not samples:
        raise ServiceError(422, "samples", "must hold at least one sample")
    if len(samples) > limit:
        raise ServiceError(422, "samples", f"{len(samples)} samples for one task exceeds "
                                           f"n * len(model_ids) * max_samples_per_rollout = {limit}")
    seen = set()
    limits: dict[str, Limits] = {}
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise ServiceError(422, f"samples[{i}]", "expected a Sample")
        if s.task_id != row["task_id"]:
            raise ServiceError(422, f"samples[{i}].task_id",
                               f"{s.task_id!r} does not match the pushed task {row['task_id']!r}")
        if s.model_id not in model_ids:
            raise ServiceError(422, f"samples[{i}].model_id",
                               f"unknown model_id {s.model_id!r}; task serves {model_ids}")
        key = (s.model_id, s.sample_index)
        if key in seen:
            raise ServiceError(422, f"samples[{i}].sample_index",
                               f"sample_index {s.sample_index} of {s.model_id!r} repeats")
        seen.add(key)
        if s.model_id not in limits:  # once per policy and push, not per sample
            limits[s.model_id] = limits_of(s.model_id)
        validate_sample(i, s, limits[s.model_id], versions[s.model_id],
                        temperatures.get(s.model_id), train=row["kind"] == "train")


def validate_sample(i: int, s: Sample, limits: Limits, current: int,
                    temperature: float | None, train: bool) -> None:
    """One sample's checks (see :func:`validate_samples`); ``current``: its policy's version,
    ``temperature``: the one ``temperatures`` of the config sets for it."""
    at = f"samples[{i}]"
    vocab, vsrc, max_len, lsrc = limits
    ids = s.token_ids
    if max_len is not None and ids.size > max_len:
        raise ServiceError(422, f"{at}.token_ids", (
            f"{ids.size} tokens exceed max_model_len={max_len} of {s.model_id!r} ({lsrc}); "
            "no engine of this policy can produce it: trim the sample in the workflow, or "
            "register the engine's real max_model_len"))
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ServiceError(422, f"{at}.token_ids", (
            f"token ids must lie in [0, {vocab}) of {s.model_id!r} ({vsrc}); got "
            f"{int(ids.min())}..{int(ids.max())}: the sample was tokenized for another model"))
    if s.versions.size and int(s.versions.max()) > current:
        raise ServiceError(422, f"{at}.versions", (
            f"version {int(s.versions.max())} is newer than the published version {current} "
            f"of {s.model_id!r}; every token's version must be a published one (or -1 for "
            "prompt and environment tokens)"))
    mask = s.loss_mask.astype(bool)
    if not mask.any():
        raise ServiceError(422, f"{at}.loss_mask", (
            "has no trained token (all 0): the sample carries nothing to learn and no "
            "version to measure its staleness by; do not push samples without generated "
            "tokens (e.g. an empty completion)"))
    if s.logprobs.size and float(s.logprobs.min()) < LOGPROB_FLOOR:
        raise ServiceError(422, f"{at}.logprobs", (
            f"log-prob {float(s.logprobs.min()):g} is below LOGPROB_FLOOR={LOGPROB_FLOOR:g}: "
            "no engine samples a token that unlikely; send the engine's behaviour log-prob "
            "of each generated token (0 on prompt and environment tokens)"))
    try:
        check_sample_metadata(s.metadata, at, temperature, trained=train)
    except ProtocolError as exc:
        raise ServiceError(422, exc.field, exc.message) from None


def filter_groups(filters: Iterable[DataPlugin], samples: list[Sample]
                  ) -> tuple[set[int], dict[str, bool], dict[str, list[float]]]:
    """Run the sample filters over each policy's group. Returns the ids (``id()``) of the
    kept samples, whether each policy's group kept any, and each group's rewards before
    filtering (what the curators learn from)."""
    groups: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.model_id].append(s)
    kept: set[int] = set()
    kept_groups: dict[str, bool] = {}
    for m, group in groups.items():
        survivors = group
        for f in filters:
            if survivors and f.applies_to(m):
                survivors = f.select(survivors)
        kept.update(id(s) for s in survivors)
        kept_groups[m] = bool(survivors)
    return kept, kept_groups, {m: [float(s.reward) for s in g] for m, g in groups.items()}


def assign_advantages(samples: list[Sample]) -> None:
    """Group-normalised advantages per (model_id, role) within one task
    (:func:`astralight.rl.advantages.group_stats`), stored on each sample with its group's
    mean and std.

    One policy may play several roles in a workflow (a self-verifying solver); its answers and
    its verdicts are rewarded on different scales, so each role is its own group.
    """
    groups: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.model_id, s.role].append(s)
    for group in groups.values():
        mean, std, advantages = group_stats([s.reward for s in group])
        for s, adv in zip(group, advantages):
            s.group_mean, s.group_std, s.advantage = mean, std, adv
