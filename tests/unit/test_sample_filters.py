"""Sample filters: zero-advantage (dynamic sampling) and length/truncation, per model_id."""

from __future__ import annotations

import numpy as np
import pytest

from astralight.dataflow.sample_filters import KeepAll, LengthFilter, SampleFilter, ZeroAdvantage
from astralight.protocol import Sample


def sample(i: int, reward: float, completion: int = 2, finish: str | None = "stop",
           model_id: str = "policy") -> Sample:
    """A sample with a 2-token prompt and ``completion`` generated tokens."""
    n = 2 + completion
    meta = {} if finish is None else {"finish_reason": finish}
    return Sample(task_id="t", sample_index=i, model_id=model_id,
                  token_ids=np.arange(n, dtype=np.int32), logprobs=np.zeros(n, np.float32),
                  loss_mask=np.array([0, 0] + [1] * completion, np.uint8),
                  versions=np.array([-1, -1] + [0] * completion, np.int32), reward=reward,
                  metadata=meta)


def test_keep_all_keeps_the_same_objects_in_order():
    group = [sample(i, float(i)) for i in range(3)]
    out = KeepAll().select(group)
    assert out == group and all(a is b for a, b in zip(out, group)) and out is not group


def test_zero_advantage_drops_only_groups_with_equal_rewards():
    f = ZeroAdvantage()
    assert f.select([sample(i, 1.0) for i in range(4)]) == []
    assert f.select([sample(i, 0.0) for i in range(4)]) == []
    assert f.select([sample(0, 0.3), sample(1, 0.3 + 1e-7)]) == []  # within eps
    mixed = [sample(0, 0.0), sample(1, 1.0), sample(2, 0.0)]
    out = f.select(mixed)
    assert len(out) == 3 and all(a is b for a, b in zip(out, mixed))
    assert f.select([]) == []
    assert ZeroAdvantage(eps=0.5).select([sample(0, 0.0), sample(1, 0.4)]) == []


def test_model_ids_scope_a_filter():
    assert ZeroAdvantage().applies_to("anything")
    f = ZeroAdvantage(model_ids=["solver"])
    assert f.applies_to("solver") and not f.applies_to("verifier")
    with pytest.raises(ValueError, match="model_ids"):
        ZeroAdvantage(model_ids="solver")  # a bare string is a common YAML slip
    with pytest.raises(ValueError, match="model_ids"):
        KeepAll(model_ids=[""])


def test_length_filter_drops_truncated_samples():
    group = [sample(0, 1.0), sample(1, 0.0, finish="length"), sample(2, 0.0, finish=None)]
    out = LengthFilter().select(group)
    assert [s.sample_index for s in out] == [0, 2]
    assert LengthFilter(drop_truncated=False).select(group) == group
    assert LengthFilter(whole_group=True).select(group) == []
    assert LengthFilter(whole_group=True).select([group[0], group[2]]) == [group[0], group[2]]


def test_length_filter_counts_completion_tokens_from_the_loss_mask():
    group = [sample(i, float(i % 2), completion=3 + i) for i in range(3)]  # 3, 4, 5 tokens
    out = LengthFilter(max_completion_tokens=4, drop_truncated=False).select(group)
    assert [s.sample_index for s in out] == [0, 1]  # inclusive; prompt tokens don't count
    assert LengthFilter(max_completion_tokens=4, whole_group=True).select(group) == []
    assert LengthFilter(max_completion_tokens=5).select(group) == group


@pytest.mark.parametrize("kwargs,field", [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
    ({"model_ids": [3]}, "model_ids"),
])
def test_length_filter_rejects_bad_args(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LengthFilter(**kwargs)


def test_zero_advantage_rejects_negative_eps():
    with pytest.raises(ValueError, match="eps"):
        ZeroAdvantage(eps=-1.0)


def test_base_class_select_must_be_implemented():
    with pytest.raises(NotImplementedError, match="select"):
        SampleFilter().select([])
