"""Ingest of a task's pushed samples: the checks that refuse them, the sample filters, the
group-normalised advantages stored on them, and :class:`Ingest`, which records a push.

The checks, filters and advantages are plain functions over what the service holds (the current
versions, the registered limits, the config's values). :class:`Ingest` applies them to one push
under the service's lock, in one transaction, and registers what follows in memory (the queued
samples, the curators' outcome, the open task count) to run after its commit.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict

from astralight.agents.stats import episode_counts
from astralight.dataflow import membership
from astralight.dataflow.errors import ServiceError
from astralight.dataflow.evals import EvalScheduler
from astralight.dataflow.leasing import TaskLeasing
from astralight.dataflow.plugins import DataPlugin, PromptOutcome
from astralight.dataflow.pool import Pool
from astralight.dataflow.parts import Part, Shared
from astralight.dataflow.queues import QueueEntry
from astralight.dataflow.rows import TaskRow
from astralight.dataflow.transaction import Transaction
from astralight.protocol import (LOGPROB_FLOOR, MAX_VOCAB_SIZE, ProtocolError, Sample,
                                 check_sample_metadata, encode)
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


def validate_samples(row: TaskRow, model_ids: list[str], samples: list[Sample], *, limit: int,
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
        if s.task_id != row.task_id:
            raise ServiceError(422, f"samples[{i}].task_id",
                               f"{s.task_id!r} does not match the pushed task {row.task_id!r}")
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
                        temperatures.get(s.model_id), train=row.kind == "train")


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


def assign_advantages(samples: list[Sample], scale_by_std: bool = True,
                      failed_advantage: float = 0.0) -> None:
    """Group-normalised advantages per (model_id, role) within one task
    (:func:`astralight.rl.advantages.group_stats`), stored on each sample with its group's
    mean and std; ``scale_by_std=False`` (``advantage_scale: none``) keeps ``r - mean``;
    ``failed_advantage`` (``failed_group_advantage``) is that of every sample of a group in
    which all failed.

    One policy may play several roles in a workflow (a self-verifying solver); its answers and
    its verdicts are rewarded on different scales, so each role is its own group.
    """
    groups: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.model_id, s.role].append(s)
    for group in groups.values():
        mean, std, advantages = group_stats([s.reward for s in group], scale_by_std=scale_by_std,
                                            failed_advantage=failed_advantage)
        for s, adv in zip(group, advantages):
            s.group_mean, s.group_std, s.advantage = mean, std, adv


#: the counter each stored state of a pushed train sample counts in
STATE_COUNTERS = {"queued": "samples_accepted", "stale": "stale_dropped",
                  "filtered": "samples_filtered"}


class Ingest(Part):
    """Records pushes: eval tasks through ``evals``, train tasks into the service's fresh
    queues (filled after each commit) with the curators' outcome. Call :meth:`push` with the
    service's lock held."""

    def __init__(self, shared: Shared, pool: Pool, leasing: TaskLeasing, evals: EvalScheduler,
                 sample_filters: list[DataPlugin]):
        super().__init__(shared)
        self.pool = pool
        self.leasing = leasing
        self.evals = evals
        self.sample_filters = sample_filters

    def push(self, instance_id: str, task_id: str, samples: list[Sample], now: float) -> dict:
        """Accept a task's samples once; later pushes of the same task are ignored (duplicate).

        The first push is a task done by the pusher (its fail streak reset); when the pusher held
        the lease, its lease->push seconds count as its busy time and, for an eval task, as eval
        time of the policies at their current versions (``eval_task_ms``, the balance report)."""
        self.pool.instance(instance_id)
        row = self.store.task(task_id)
        if row is None:
            raise ServiceError(404, "task_id", f"unknown task {task_id!r}")
        if row.state == "done":
            with self.store.tx():
                for m in row.model_ids:
                    self.bump(m, "duplicates_ignored")
                self.store.touch_instance(instance_id, now)
            return {"accepted": 0, "filtered": 0, "duplicate": True}
        if row.lease_count == 0:
            raise ServiceError(409, "task_id", f"task {task_id!r} was never leased")
        cfg = self.config
        validate_samples(
            row, row.model_ids, samples,
            limit=row.task().n * len(row.model_ids) * cfg.max_samples_per_rollout,
            limits_of=lambda m: sample_limits(instance_id, m, cfg.vocab_sizes,
                                              self.pool.instance_limits),
            versions=self.versions, temperatures=cfg.temperatures)
        assign_advantages(samples, scale_by_std=cfg.advantage_scale == "std",
                          failed_advantage=cfg.failed_group_advantage)
        with self.store.tx() as tx:
            if row.kind == "eval":  # scored, never queued for training
                self.evals.record(tx, row, samples, now)
                accepted = len(samples)
            else:
                accepted = self._record_train(tx, row, samples, now)
                tx.after_commit(self.leasing.count_open, -1)
            self.store.mark_done(task_id, now)
            self.store.touch_instance(instance_id, now, pushed=len(samples))
            busy = None
            if row.instance_id == instance_id and row.leased_at is not None:
                busy = max(0.0, now - row.leased_at)
            self.store.instance_done(instance_id, busy)
            if row.kind == "eval" and busy is not None:
                for m in row.model_ids:
                    if m in self.queues:
                        self.bump(m, "eval_task_ms", round(1000 * busy))
            self.leasing.plugin_state.maybe_save(tx, now)
        return {"accepted": accepted,
                "filtered": len(samples) - accepted if row.kind == "train" else 0,
                "duplicate": False}

    def _record_train(self, tx: Transaction, row: TaskRow, samples: list[Sample],
                      now: float) -> int:
        """Inside ``tx``: store a train task's samples (queued, filtered, or in sync mode stale),
        count them and journal the curators' outcome; the queue and the curators follow after
        the commit. Returns the samples queued."""
        source, versions = self.leasing.source, self.versions
        kept, kept_groups, rewards = filter_groups(self.sample_filters, samples)
        index = int(row.prompt_index) % len(source)
        outcome = PromptOutcome(prompt_id=source.get(index).prompt_id, prompt_index=index,
                                version=versions[self.primary], rewards=rewards,
                                kept=kept_groups)
        counts: Counter = Counter()
        sync = self.config.mode == "sync"
        queued = 0
        for s in samples:
            mv = s.min_version
            if sync and mv < versions[s.model_id]:
                state = "stale"  # an older round's sample: never trained in sync mode
            else:
                state = "queued" if id(s) in kept else "filtered"
            sid = self.store.insert_sample(row.task_id, s.model_id, s.sample_index, mv,
                                           s.reward, encode(s), now, state=state)
            counts[s.model_id, "rollouts_generated"] += 1
            for name, k in episode_counts(s.metadata).items():
                counts[s.model_id, name] += k
            if state == "queued":
                tx.after_commit(self.queues[s.model_id].push, QueueEntry(sid, mv, s))
                queued += 1
            counts[s.model_id, STATE_COUNTERS[state]] += 1
        for m, group_kept in outcome.kept.items():
            counts[m, "groups_filtered"] += not group_kept
        journal_seq = self.leasing.plugin_state.journal("outcome", asdict(outcome))
        for (m, name), k in counts.items():
            self.bump(m, name, k)
        tx.after_commit(self.leasing.plugin_state.apply_outcome, outcome, journal_seq)
        return queued
