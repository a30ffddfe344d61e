"""The ingest path's advantages (:func:`group_stats`, numpy float64) against their formula and
against the torch implementation the trainer uses."""

from __future__ import annotations

import numpy as np
import torch

from astralight.rl.advantages import ADV_EPS, group_normalized_advantages, group_stats


def test_group_stats_is_the_population_formula_in_float64():
    rewards = [0.0, 1.0, 1.0, 0.25]
    mean, std, adv = group_stats(rewards)
    arr = np.array(rewards, dtype=np.float64)
    assert mean == float(arr.mean()) and std == float(arr.std())
    assert adv == [(r - mean) / (std + ADV_EPS) for r in rewards]


def test_singletons_and_equal_rewards_get_zero():
    assert group_stats([0.7]) == (0.7, 0.0, [0.0])
    assert group_stats([1.0, 1.0, 1.0])[2] == [0.0, 0.0, 0.0]


def test_group_stats_agrees_with_the_torch_implementation():
    rewards = [0.0, 1.0, 0.5, 0.5, 2.0]
    torch_adv = group_normalized_advantages(torch.tensor(rewards), [0] * len(rewards))
    assert np.allclose(group_stats(rewards)[2], torch_adv.numpy(), atol=1e-6)


def test_dr_grpo_keeps_the_centred_reward():
    rewards = [0.0, 1.0, 1.0, 0.25]
    mean, std, adv = group_stats(rewards, scale_by_std=False)
    assert (mean, std) == group_stats(rewards)[:2]
    assert adv == [r - mean for r in rewards]
    assert group_stats([1.0, 1.0], scale_by_std=False)[2] == [0.0, 0.0]


def test_a_failed_group_gets_the_failed_advantage_and_no_other_group_does():
    assert group_stats([0.0, 0.0, 0.0], failed_advantage=-0.2)[2] == [-0.2, -0.2, -0.2]
    assert group_stats([-1.0, -1.0], scale_by_std=False, failed_advantage=-0.2)[2] == [-0.2, -0.2]
    assert group_stats([1.0, 1.0], failed_advantage=-0.2)[2] == [0.0, 0.0]  # all correct
    assert group_stats([0.0], failed_advantage=-0.2)[2] == [0.0]  # a singleton: no group
    assert group_stats([0.0, 1.0], failed_advantage=-0.2) == group_stats([0.0, 1.0])
