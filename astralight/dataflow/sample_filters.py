"""Sample filters: the post-rollout hook that decides which samples reach the fresh queue.

The service calls ``select`` once per (task, model_id) group after group statistics and
advantages are set, for every filter in list order on the previous filter's survivors. Whatever a
filter drops is counted by the service (``groups_filtered``, ``samples_filtered``): nothing is
lost silently.
"""

from __future__ import annotations

from astralight.dataflow.plugins import DataPlugin, check_range
from astralight.protocol import Sample


class SampleFilter(DataPlugin):
    """Base of sample filters; ``model_ids=None`` applies the filter to every policy."""

    def __init__(self, model_ids: list[str] | None = None):
        super().__init__()
        if model_ids is not None and (isinstance(model_ids, str) or not all(
                isinstance(m, str) and m for m in model_ids)):
            raise ValueError(f"model_ids: must be null (every policy) or a list of policy names, "
                             f"got {model_ids!r}")
        self.model_ids = None if model_ids is None else list(model_ids)

    def applies_to(self, model_id: str) -> bool:
        return self.model_ids is None or model_id in self.model_ids

    def select(self, group: list[Sample]) -> list[Sample]:
        """Return the kept subset of one task's samples of one policy (same objects, same
        order); ``[]`` drops the whole group."""
        raise NotImplementedError(f"{type(self).__name__} must implement select(group)")


class KeepAll(SampleFilter):
    """Keep everything (vanilla RL)."""

    def select(self, group: list[Sample]) -> list[Sample]:
        return list(group)


class ZeroAdvantage(SampleFilter):
    """Dynamic sampling (DAPO): drop a group whose rewards are all equal.

    With group-normalised advantages such a group has advantage 0 on every token, so it adds
    nothing to the policy gradient but still dilutes the batch; dropping it keeps every trained
    sample informative, at the price of generating more rollouts per trained sample.
    """

    def __init__(self, eps: float = 1e-6, model_ids: list[str] | None = None):
        super().__init__(model_ids)
        self.eps = check_range("eps", eps, 0.0, float("inf"))

    def select(self, group: list[Sample]) -> list[Sample]:
        if not group:
            return []
        rewards = [s.reward for s in group]
        return [] if max(rewards) - min(rewards) <= self.eps else list(group)


class LengthFilter(SampleFilter):
    """Drop truncated or over-long completions.

    A completion cut off by the token budget (``finish_reason == "length"``) has no final answer,
    so its reward judges the truncation, not the reasoning (DAPO's overlong filtering). With
    ``whole_group`` one bad sample drops the group, so the survivors' group statistics stay those
    the advantages were computed from.
    """

    def __init__(self, max_completion_tokens: int | None = None, drop_truncated: bool = True,
                 whole_group: bool = False, model_ids: list[str] | None = None):
        super().__init__(model_ids)
        limit = max_completion_tokens
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise ValueError(f"max_completion_tokens: must be null (no limit) or an integer >= 1, "
                             f"got {max_completion_tokens!r}")
        self.max_completion_tokens = limit
        self.drop_truncated = bool(drop_truncated)
        self.whole_group = bool(whole_group)

    def bad(self, sample: Sample) -> bool:
        """Whether this sample breaks the filter's rules."""
        if self.drop_truncated and sample.metadata.get("finish_reason") == "length":
            return True
        limit = self.max_completion_tokens
        return limit is not None and int(sample.loss_mask.sum()) > limit

    def select(self, group: list[Sample]) -> list[Sample]:
        keep = [s for s in group if not self.bad(s)]
        if self.whole_group and len(keep) < len(group):
            return []
        return keep
