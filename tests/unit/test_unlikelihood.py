"""The sequence unlikelihood of negative samples (``astralight.rl.unlikelihood``) and its place
in ``RLPolicy``'s objective (``unlikelihood_coef``)."""

from __future__ import annotations

import math

import pytest
import torch

from astralight.datamodules import collate_batch
from astralight.policy import M2POPolicy
from astralight.rl.unlikelihood import sequence_logprobs, unlikelihood_penalty
from tests.fakes import FakeDataflowClient


def test_value_is_the_negative_advantage_times_minus_log_one_minus_pi():
    logp = torch.tensor([[-0.1, -0.2, 5.0], [-1.0, -0.5, -0.3], [-0.05, -0.01, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([-0.5, 2.0, -1.5])  # the second sample is a success: no weight
    loss, metrics = unlikelihood_penalty(logp, mask, adv, coef=2.0, n_samples=4)
    seq = [-0.3, -1.8, -0.06]  # the masked 5.0 never counts
    expected = 2.0 * (0.5 * -math.log(1 - math.exp(seq[0]))
                      + 1.5 * -math.log(1 - math.exp(seq[2]))) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert float(metrics["unlikelihood_loss"]) == pytest.approx(expected, rel=1e-5)
    assert float(metrics["negative_seq_prob"]) == pytest.approx(
        (math.exp(seq[0]) + math.exp(seq[2])) / 2, rel=1e-5)
    torch.testing.assert_close(sequence_logprobs(logp, mask), torch.tensor(seq))


def test_no_negative_sample_no_loss_no_gradient():
    logp = torch.tensor([[-0.1, -0.2], [-0.3, -0.4]], requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, metrics = unlikelihood_penalty(logp, mask, torch.tensor([0.0, 1.0]), coef=1.0)
    loss.backward()
    assert loss.item() == 0.0
    assert float(metrics["negative_seq_prob"]) == 0.0
    assert torch.count_nonzero(logp.grad) == 0


def _logit_grads(p_chosen: float) -> tuple[float, float]:
    """The gradient on the chosen token's logit of a 10-way softmax whose chosen token has
    probability ``p_chosen``, from the unlikelihood (advantage -1) and from the policy-gradient
    loss ``-A log pi`` with the same advantage."""
    rest = (1 - p_chosen) / 9
    grads = []
    for use_ul in (True, False):
        z = torch.log(torch.tensor([p_chosen] + [rest] * 9)).requires_grad_()
        logp = torch.log_softmax(z, -1)[0].reshape(1, 1)
        if use_ul:
            loss, _ = unlikelihood_penalty(logp, torch.ones(1, 1, dtype=torch.bool),
                                           torch.tensor([-1.0]), coef=1.0)
        else:
            loss = logp.sum()  # -A log pi with A = -1
        loss.backward()
        grads.append(float(z.grad[0]))
    return grads[0], grads[1]


def test_the_push_grows_with_the_confidence_where_the_policy_gradient_vanishes():
    ul_low, pg_low = _logit_grads(0.05)
    ul_high, pg_high = _logit_grads(0.99)
    # both lower the failing token's logit (positive gradient on a loss to minimise)
    assert ul_low > 0 and ul_high > 0 and pg_high > 0
    assert pg_high == pytest.approx(0.01, rel=1e-3)  # |A| (1 - pi): vanishing
    assert ul_high == pytest.approx(0.99, rel=1e-3)  # pi: bounded by 1, not vanishing
    assert ul_low == pytest.approx(0.05, rel=1e-3)  # a rare completion is barely touched
    assert ul_high > 50 * pg_high


def test_a_certain_completion_stays_finite_and_still_gets_pushed():
    # log pi(y|x) == 0.0 (pi == 1 in float32): log(1 - pi) would be -inf without the cap
    logp = torch.zeros(1, 1, requires_grad=True)
    loss, metrics = unlikelihood_penalty(logp, torch.ones(1, 1, dtype=torch.bool),
                                         torch.tensor([-1.0]), coef=1.0)
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() > 10  # -log(1e-6) ~ 13.8
    # the gradient passes the cap: a loss to minimise that lowers log pi, weight pi/(1-pi) ~ 1e6
    assert math.isfinite(float(logp.grad)) and float(logp.grad) == pytest.approx(1e6, rel=1e-2)
    assert float(metrics["negative_seq_prob"]) == pytest.approx(1.0, abs=1e-5)


def test_masked_nan_never_leaks_and_micro_batches_add_up():
    torch.manual_seed(0)
    logp = -torch.rand(6, 4)
    logp[0, 3] = float("nan")
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[0, 3] = False
    adv = torch.tensor([-1.0, 0.5, -0.2, -2.0, 0.0, -0.7])
    whole, _ = unlikelihood_penalty(logp, mask, adv, coef=0.3, n_samples=6)
    parts = [unlikelihood_penalty(logp[sl], mask[sl], adv[sl], coef=0.3, n_samples=6)[0]
             for sl in (slice(0, 2), slice(2, 6))]
    assert math.isfinite(float(whole))
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-6)


def test_shapes_are_checked_naming_the_argument():
    with pytest.raises(ValueError, match="sample_advantages: expected shape \\[2\\]"):
        unlikelihood_penalty(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3), coef=1.0)
    with pytest.raises(ValueError, match="logp / mask"):
        unlikelihood_penalty(torch.zeros(2, 3), torch.ones(2, 4), torch.zeros(2), coef=1.0)


def test_policy_adds_it_to_every_objective_and_micro_batches_give_the_same_gradient(
        tiny_model_dir):
    fake = FakeDataflowClient(tiny_model_dir, logprob_noise=0.4, seed=3)
    batch = collate_batch(fake.make_batch(6))
    batch["advantages"] = torch.tensor([-1.0, 1.0, -0.5, 0.5, -2.0, 2.0])
    runs = {}
    for loss_name in ("m2po", "ppo_clip"):
        for coef, mbs in ((0.0, None), (2.0, None), (2.0, 2)):
            policy = M2POPolicy(str(tiny_model_dir), loss=loss_name, unlikelihood_coef=coef,
                                micro_batch_size=mbs)
            policy.configure_model()
            out = policy.accumulate_gradients(policy.prepare_batch(batch))
            runs[loss_name, coef, mbs] = (
                out, {n: p.grad.clone() for n, p in policy.model.named_parameters()})
    for loss_name in ("m2po", "ppo_clip"):
        plain, plain_grads = runs[loss_name, 0.0, None]
        with_ul, grads = runs[loss_name, 2.0, None]
        assert "unlikelihood_loss" not in plain
        assert float(with_ul["unlikelihood_loss"]) > 0
        assert float(with_ul["loss"]) == pytest.approx(
            float(plain["loss"]) + float(with_ul["unlikelihood_loss"]), rel=1e-4)
        assert 0 < float(with_ul["negative_seq_prob"]) < 1
        assert any(not torch.allclose(g, plain_grads[n]) for n, g in grads.items())
        micro, micro_grads = runs[loss_name, 2.0, 2]
        assert float(micro["unlikelihood_loss"]) == pytest.approx(
            float(with_ul["unlikelihood_loss"]), rel=1e-4)
        for name, g in grads.items():
            torch.testing.assert_close(micro_grads[name], g, rtol=1e-4, atol=1e-6)
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="unlikelihood_coef: must be >= 0"):
            M2POPolicy(str(tiny_model_dir), unlikelihood_coef=bad)
