"""Eval scoring: the unbiased pass@k estimator and per-prompt summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.evals import pass_at_k, summarize
from astralight.protocol import Sample


def test_pass_at_k_with_n_equal_k_is_any_correct():
    assert pass_at_k(4, 0, 4) == 0.0
    for c in range(1, 5):
        assert pass_at_k(4, c, 4) == 1.0


def test_pass_at_k_unbiased_estimator_matches_the_formula():
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 is the fraction correct
    assert pass_at_k(2, 1, 4) == 1.0 and pass_at_k(2, 0, 4) == 0.0  # fewer samples than k
    assert pass_at_k(0, 0, 4) == 0.0


def test_summarize_counts_correct_and_generating_versions():
    def s(reward, versions):
        T = len(versions)
        return Sample(task_id="e", sample_index=0, model_id="p", token_ids=np.zeros(T, np.int32),
                      logprobs=np.zeros(T, np.float32),
                      loss_mask=(np.array(versions) >= 0).astype(np.uint8),
                      versions=np.array(versions, np.int32), reward=reward)

    rep = summarize([s(1.0, [-1, 2, 3]), s(0.5, [-1, 4]), s(0.0, [-1, 3])])
    assert rep == {"n_samples": 3, "n_correct": 1, "sum_reward": 1.5, "min_version": 2,
                   "max_version": 4, "n_team_correct": None, "n_tool_calling": None}


def test_summarize_team_workflow_counts_first_attempts_and_team_answers():
    def s(reward, attempt, team):
        return Sample(task_id="e", sample_index=0, model_id="solver",
                      token_ids=np.zeros(3, np.int32), logprobs=np.zeros(3, np.float32),
                      loss_mask=np.array([0, 1, 1], np.uint8), versions=np.array([-1, 1, 1], np.int32),
                      reward=reward, metadata={"attempt": attempt, "team_correct": team})

    # two chains: wrong then fixed on retry (team right), right at once (team right)
    rep = summarize([s(0.0, 0, 1), s(1.0, 1, 1), s(1.0, 0, 1)])
    assert (rep["n_samples"], rep["n_correct"], rep["n_team_correct"]) == (2, 1, 2)


@pytest.mark.parametrize("bad, field", [({"queue_order": "lifo"}, "queue_order"),
                                        ({"model_ids": []}, "model_ids"),
                                        ({"model_ids": ["a/b"]}, "model_ids"),
                                        ({"group_size": 0}, "group_size"),
                                        ({"eval": {"every": 0}}, "eval.every"),
                                        ({"source": {"init_args": {}}}, "source")])
def test_config_errors_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        DataflowConfig(**bad)
