"""``train/staleness_*`` is measured against the trainer's own weight version (the version the
optimizer step is applied to: ``global_step // every_n_steps`` of its WeightPublisher, resumes
included), not the version the dataflow knew when it served the batch, which lags the trainer's
while a publication is on its way."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from astralight.callbacks import WeightPublisher
from astralight.datamodules import RolloutDataModule, collate_batch
from astralight.policy import M2POPolicy
from tests.fakes import FakeDataflowClient


class RecordStaleness(pl.Callback):
    """Records, per optimizer step, the staleness the module logged and the batch's versions."""

    def __init__(self):
        self.rows: list[tuple[int, float, int, int | None]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((trainer.global_step - 1,
                          float(trainer.callback_metrics["train/staleness_mean"]),
                          int(batch["policy_version"]), batch["trainer_version"]))


def fit(model_dir, fake, callbacks, max_steps, ckpt_path=None):
    dm = RolloutDataModule("http://127.0.0.1:9", model_id="policy", batch_size=4)
    dm.client = fake
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, log_every_n_steps=1)
    fake.trainer = trainer
    trainer.fit(M2POPolicy(str(model_dir), lr=1e-3), datamodule=dm, ckpt_path=ckpt_path)
    return trainer


def lagging_dataflow(model_dir) -> FakeDataflowClient:
    """A dataflow that has not yet recorded any published version: every batch is served at
    version 0 and every token was sampled by version 0, while the trainer's weights move on."""
    fake = FakeDataflowClient(model_dir)
    fake.publish = lambda manifest: {"version": manifest.version}  # accepted, not yet recorded
    return fake


def test_staleness_counts_from_the_weights_the_step_is_applied_to(tiny_model_dir):
    fake = lagging_dataflow(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=1, worker="thread")
    publisher.client = fake
    record = RecordStaleness()
    fit(tiny_model_dir, fake, [publisher, record], max_steps=3)
    # step s trains weights of version s on samples of version 0 served at dataflow version 0;
    # measured against the dataflow's version (the old reference) it read 0, 0, 0
    assert [(step, served, mine) for step, _, served, mine in record.rows] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2)]
    assert [stale for _, stale, _, _ in record.rows] == [0.0, 1.0, 2.0]


def test_every_n_steps_and_a_resume_keep_the_trainer_version(tiny_model_dir, tmp_path):
    fake = lagging_dataflow(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=2, worker="thread")
    publisher.client = fake
    record = RecordStaleness()
    trainer = fit(tiny_model_dir, fake, [publisher, record], max_steps=3)
    assert [stale for _, stale, _, _ in record.rows] == [0.0, 0.0, 1.0]  # versions 0, 0, 1
    ckpt = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(ckpt)

    resumed = WeightPublisher(every_n_steps=2, worker="thread")
    resumed.client = fake
    after = RecordStaleness()
    fit(tiny_model_dir, fake, [resumed, after], max_steps=5, ckpt_path=str(ckpt))
    # the resumed trainer counts from the checkpoint's step 3 (version 1), not from 0
    assert [(step, mine) for step, _, _, mine in after.rows] == [(3, 1), (4, 2)]
    assert [stale for _, stale, _, _ in after.rows] == [1.0, 2.0]


def test_without_a_publisher_the_dataflow_version_is_the_reference(tiny_model_dir):
    fake = FakeDataflowClient(tiny_model_dir)
    record = RecordStaleness()
    fit(tiny_model_dir, fake, [record], max_steps=2)
    assert [(served, mine) for _, _, served, mine in record.rows] == [(0, None), (0, None)]
    assert [stale for _, stale, _, _ in record.rows] == [0.0, 0.0]


@pytest.mark.parametrize("trainer_version,expected", [(None, (1.0, 2.0)), (5, (2.0, 3.0))])
def test_batch_stats_mean_and_max_over_loss_tokens(tiny_model_dir, trainer_version, expected):
    """Per sample: reference - oldest version behind its loss-masked tokens (prompt tokens and
    padding, version -1, never count); mean and max over the samples."""
    raw = FakeDataflowClient(tiny_model_dir).make_batch(2)
    raw.policy_version = 4
    for sample, oldest in zip(raw.samples, (3, 2)):
        mask = sample.loss_mask > 0
        sample.versions[mask] = 4
        sample.versions[mask.nonzero()[0][-1]] = oldest  # one older token: the sample's oldest
    batch = collate_batch(raw, trainer_version=trainer_version)
    policy = M2POPolicy(str(tiny_model_dir))
    stats = policy._batch_stats(batch, policy.prepare_batch(batch))
    assert (float(stats["staleness_mean"]), float(stats["staleness_max"])) == (
        (expected[0] + expected[1]) / 2, expected[1])
    assert float(stats["policy_version"]) == 4.0
    assert ("trainer_version" in stats) == (trainer_version is not None)


def test_trainer_version_asks_the_publisher_of_this_policy():
    """The datamodule finds the publisher among the trainer's callbacks, skips one of another
    policy, and says None without any."""
    dm = RolloutDataModule("http://127.0.0.1:9", model_id="policy")
    other = WeightPublisher(model_id="verifier", every_n_steps=1, worker="thread")
    mine = WeightPublisher(model_id="policy", every_n_steps=3, worker="thread")

    class Trainer:
        global_step = 7
        callbacks = [other, mine]

    dm.trainer = Trainer()
    assert dm.trainer_version() == 2  # 7 // 3
    Trainer.callbacks = [other]
    assert dm.trainer_version() is None
    dm.trainer = None
    assert dm.trainer_version() is None
