"""Train/inference mismatch (issue 37, item 2): the trainer's log-probs against the behaviour
log-probs, measured only on tokens the trainer holds the sampling weights of, and logged by a
real ``Trainer.fit`` step as ``train/mismatch_*``."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from astralight.callbacks import WeightPublisher
from astralight.datamodules import collate_batch
from astralight.policy import M2POPolicy
from astralight.rl.mismatch import mismatch_metrics
from tests.fakes import FakeDataflowClient
from tests.unit.publisher_fit import fit


def test_the_statistics_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    behaviour = torch.tensor([[-1.0, -2.0 - math.log(3.0), -0.5, -1.0]])
    mask = torch.tensor([[True, True, True, False]])
    versions = torch.tensor([[4, 4, 3, 4]])
    out = mismatch_metrics(logp, behaviour, mask, versions, version=4)
    # measured: tokens 0 and 1 (token 2 is version 3, token 3 off the mask)
    d = torch.tensor([0.0, math.log(3.0)])
    assert float(out["mismatch_tokens"]) == 2
    assert float(out["mismatch_abs_mean"]) == pytest.approx(float(d.abs().mean()))
    assert float(out["mismatch_k3"]) == pytest.approx(float((d.exp() - 1 - d).mean()))
    assert float(out["mismatch_ratio_max"]) == pytest.approx(3.0)
    assert float(out["mismatch_ratio_min"]) == pytest.approx(1.0)
    assert float(out["mismatch_tail_fraction"]) == pytest.approx(0.5)  # 3x is past 2x


def test_no_token_of_that_version_gives_only_the_count():
    logp = torch.zeros(1, 3)
    out = mismatch_metrics(logp, logp, torch.ones(1, 3, dtype=torch.bool),
                           torch.full((1, 3), 2), version=5)
    assert out == {"mismatch_tokens": torch.tensor(0.0)}


@pytest.mark.parametrize("micro_batch_size", [None, 2])
def test_same_weights_measure_zero_and_noise_measures_itself(tiny_model_dir, micro_batch_size):
    policy = M2POPolicy(str(tiny_model_dir), micro_batch_size=micro_batch_size)
    policy.configure_model()
    exact = FakeDataflowClient(tiny_model_dir)  # version 0: its log-probs are the model's
    batch = policy.prepare_batch(collate_batch(exact.make_batch(6), trainer_version=0))
    out = policy.accumulate_gradients(batch, weights_version=0)
    assert float(out["mismatch_tokens"]) == float(batch["mask"].sum()) > 0
    assert float(out["mismatch_abs_mean"]) < 1e-4
    assert float(out["mismatch_tail_fraction"]) == 0.0

    noisy = FakeDataflowClient(tiny_model_dir, logprob_noise=0.5)
    batch = policy.prepare_batch(collate_batch(noisy.make_batch(6), trainer_version=0))
    out = policy.accumulate_gradients(batch, weights_version=0)
    assert 0.1 < float(out["mismatch_abs_mean"]) < 1.0
    assert float(out["mismatch_k3"]) > 0.01
    assert float(out["mismatch_ratio_max"]) > 1.0 > float(out["mismatch_ratio_min"])
    # without a version nothing is measured: the weights may not be any published version
    assert not any(k.startswith("mismatch_") for k in policy.accumulate_gradients(batch))


class RecordMismatch(pl.Callback):
    def __init__(self):
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()
                          if k.startswith("train/mismatch_")})


def test_a_fit_step_logs_the_mismatch_of_on_policy_tokens(tiny_model_dir):
    fake = FakeDataflowClient(tiny_model_dir, logprob_noise=0.3)
    publisher = WeightPublisher(every_n_steps=1, worker="thread")
    publisher.client = fake
    record = RecordMismatch()
    fit(tiny_model_dir, fake, [publisher, record], max_steps=2,
        policy=M2POPolicy(str(tiny_model_dir), lr=1e-3, minibatches=2))
    # step 0 trains version 0's weights on samples of version 0: all measured, the noise seen
    first = record.rows[0]
    assert first["train/mismatch_tokens"] > 0
    assert first["train/mismatch_abs_mean"] > 0.05
    assert {"train/mismatch_k3", "train/mismatch_ratio_max", "train/mismatch_ratio_min",
            "train/mismatch_tail_fraction"} <= set(first)
