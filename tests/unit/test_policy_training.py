"""M2POPolicy + RolloutDataModule under a real Lightning ``Trainer.fit`` on the tiny model."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from astralight.datamodules import RolloutDataModule, collate_batch
from astralight.policy import M2POPolicy
from tests.fakes import FakeDataflowClient


def make_trainer(tmp_path, max_steps=3, callbacks=()):
    return pl.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=TensorBoardLogger(tmp_path),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1, callbacks=list(callbacks))


def make_data(fake, batch_size=4):
    dm = RolloutDataModule("http://127.0.0.1:1", model_id="policy", batch_size=batch_size)
    dm.client = fake
    return dm


EXPECTED_METRICS = [
    "train/loss", "train/pg_loss", "train/m2_before", "train/m2_after", "train/masked_fraction",
    "train/ratio_mean", "train/ratio_max", "train/reward_mean", "train/advantage_mean",
    "train/advantage_std", "train/staleness_mean", "train/staleness_max", "train/grad_norm",
    "train/lr", "perf/samples_per_s", "perf/tokens_per_s", "perf/wait_s",
]


@pytest.mark.parametrize("micro_batch_size", [None, 2])
def test_fit_trains_acknowledges_and_logs(tiny_model_dir, tmp_path, micro_batch_size):
    fake = FakeDataflowClient(tiny_model_dir)
    fake.version = 3  # batches say the dataflow is at version 3; tokens are 0-2 versions older
    dm = make_data(fake)
    policy = M2POPolicy(str(tiny_model_dir), lr=1e-3, micro_batch_size=micro_batch_size)
    trainer = make_trainer(tmp_path)
    fake.trainer = trainer
    policy.configure_model()
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}

    trainer.fit(policy, datamodule=dm)

    assert trainer.global_step == 3
    # every batch trained was acknowledged once, in order, after its optimizer step
    assert [b for b, _ in fake.acks] == fake.served[:3]
    assert [s for _, s in fake.acks] == [1, 2, 3]
    # the prefetch slot holds placeholders, not pulled batches: nothing pulled is left unacked
    assert len(fake.served) == 3
    assert dm.n_acknowledged == 3
    after = policy.model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)
    metrics = trainer.callback_metrics
    missing = [k for k in EXPECTED_METRICS if k not in metrics]
    assert not missing
    assert torch.isfinite(metrics["train/loss"])
    assert 0 <= float(metrics["train/masked_fraction"]) <= 1
    assert 0 <= float(metrics["train/staleness_mean"]) <= float(metrics["train/staleness_max"]) <= 3
    assert float(metrics["train/lr"]) == pytest.approx(1e-3)
    assert list(tmp_path.rglob("events.out.tfevents*"))


@pytest.mark.parametrize("loss", ["m2po_harmful", "ppo_clip"])
def test_fit_other_objectives(tiny_model_dir, tmp_path, loss):
    fake = FakeDataflowClient(tiny_model_dir, logprob_noise=0.3)
    policy = M2POPolicy(str(tiny_model_dir), loss=loss, lr=1e-3, kl_coef=0.05, warmup_steps=4)
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(policy, datamodule=make_data(fake))
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"])
    assert "train/kl_k3" in metrics and "train/kl_loss" in metrics
    assert float(metrics["train/lr"]) == pytest.approx(1e-3 * 2 / 4)  # linear warm-up
    key = "train/masked_fraction" if loss == "m2po_harmful" else "train/clip_fraction"
    assert 0 < float(metrics[key]) <= 1  # noisy behaviour log-probs: some tokens constrained
    assert policy.ref_model is not None


def test_kl_decay_falls_linearly_and_then_skips_the_reference_pass(tiny_model_dir, tmp_path,
                                                                    monkeypatch):
    fake = FakeDataflowClient(tiny_model_dir, logprob_noise=0.3)
    policy = M2POPolicy(str(tiny_model_dir), lr=1e-3, kl_coef=0.08, kl_decay_steps=2)
    reference_passes = []
    real = policy._reference_logprobs
    monkeypatch.setattr(policy, "_reference_logprobs",
                        lambda batch: reference_passes.append(1) or real(batch))
    coefs = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            coefs.append(float(trainer.callback_metrics["train/kl_coef"]))

    make_trainer(tmp_path, max_steps=3, callbacks=[Record()]).fit(policy,
                                                                  datamodule=make_data(fake))
    assert coefs == pytest.approx([0.08, 0.04, 0.0])  # global_step 0, 1, 2 of 2 decay steps
    assert len(reference_passes) == 2  # none once the coefficient is 0
    assert policy.ref_model is not None


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_kl_decay_steps_must_be_a_count(tiny_model_dir, bad):
    with pytest.raises(ValueError, match=r"kl_decay_steps: must be an integer >= 0"):
        M2POPolicy(str(tiny_model_dir), kl_coef=0.05, kl_decay_steps=bad)


def test_temperature_mismatch_is_refused(tiny_model_dir, tmp_path):
    fake = FakeDataflowClient(tiny_model_dir, temperature=0.7)
    policy = M2POPolicy(str(tiny_model_dir), temperature=1.0)
    with pytest.raises(ValueError, match=r"sample temperature 0\.7 != module temperature 1:"):
        make_trainer(tmp_path, max_steps=1).fit(policy, datamodule=make_data(fake))
    assert fake.acks == []


def test_other_model_id_is_refused(tiny_model_dir):
    policy = M2POPolicy(str(tiny_model_dir), model_id="solver")
    batch = collate_batch(FakeDataflowClient(tiny_model_dir).make_batch(2))
    with pytest.raises(ValueError, match="model_id"):
        policy.check_batch(batch)


@pytest.mark.parametrize("loss,kl_coef", [("m2po", 0.0), ("m2po_harmful", 0.0),
                                          ("ppo_clip", 0.0), ("m2po", 0.1)])
def test_micro_batching_gives_the_whole_batch_gradient(tiny_model_dir, loss, kl_coef):
    """Gradient accumulation with the whole-batch M2 context equals one pass over the batch."""
    fake = FakeDataflowClient(tiny_model_dir, logprob_noise=0.4, seed=3)
    batch = collate_batch(fake.make_batch(6))
    grads, metrics = [], []
    for mbs in (None, 2, 4):
        policy = M2POPolicy(str(tiny_model_dir), loss=loss, kl_coef=kl_coef, micro_batch_size=mbs)
        policy.configure_model()
        out = policy.accumulate_gradients(policy.prepare_batch(batch))
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters()})
        metrics.append(out)
    assert float(metrics[0]["masked_fraction" if loss != "ppo_clip" else "clip_fraction"]) > 0
    for other, m in zip(grads[1:], metrics[1:]):
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, rtol=1e-4, atol=1e-6)
        assert float(m["loss"]) == pytest.approx(float(metrics[0]["loss"]), rel=1e-4, abs=1e-6)
        for key in ("m2_before", "m2_after", "masked_fraction", "ratio_max"):
            if key in m:
                assert float(m[key]) == pytest.approx(float(metrics[0][key]), rel=1e-4, abs=1e-6)


class CustomObjective(M2POPolicy):
    """The documented extension point: a plain REINFORCE-style token-mean loss."""

    def compute_loss(self, batch, logp):
        loss = -(logp * batch["advantages"])[batch["mask"]].sum() / batch["n_tokens"]
        return loss, {"custom_loss": loss.detach()}


def test_compute_loss_is_the_extension_point(tiny_model_dir, tmp_path):
    fake = FakeDataflowClient(tiny_model_dir)
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(CustomObjective(str(tiny_model_dir), lr=1e-3), datamodule=make_data(fake))
    assert "train/custom_loss" in trainer.callback_metrics
    assert "train/m2_before" not in trainer.callback_metrics
    assert len(fake.acks) == 2


def test_datamodule_gives_up_after_max_wait(tiny_model_dir, caplog):
    class Empty:
        def pull_batch(self, *a, **k):
            return None

    dm = RolloutDataModule("http://127.0.0.1:1", batch_size=2, pull_timeout_s=0.01, max_wait_s=0.05)
    dm.client = Empty()
    stream = dm.stream(lazy=False)
    with pytest.raises(TimeoutError, match="max_wait_s"):
        next(iter(stream))
    with pytest.raises(TypeError):
        len(stream)  # Lightning must see an unsized (infinite) stream


def test_collate_batch_layout(tiny_model_dir):
    batch = FakeDataflowClient(tiny_model_dir).make_batch(4)
    out = collate_batch(batch, wait_s=1.5)
    n = max(s.num_tokens for s in batch.samples)
    assert out["input_ids"].shape == (4, n) and out["input_ids"].dtype == torch.long
    for i, s in enumerate(batch.samples):
        k = s.num_tokens
        assert out["input_ids"][i, :k].tolist() == s.token_ids.tolist()
        assert out["attention_mask"][i].sum() == k
        assert out["loss_mask"][i, :k].tolist() == s.loss_mask.astype(float).tolist()
        assert out["versions"][i, k:].eq(-1).all()
        assert out["input_ids"][i, k:].eq(0).all()
    assert out["wait_s"] == 1.5 and out["batch_id"] == batch.batch_id
    assert out["temperature"].tolist() == [1.0] * 4
    logging.getLogger(__name__).info("collated %s", {k: getattr(v, "shape", v) for k, v in out.items()})


class _RefusesNoSync(torch.nn.Module):
    """Stands in for FSDP's root: it has ``no_sync`` (so Lightning's duck-typed DDP check
    matches it) and, like FSDP inside its own forward, refuses it."""

    def no_sync(self):
        raise AssertionError("no_sync called on a module that is not DistributedDataParallel")


def test_micro_batches_never_ask_a_non_ddp_wrapper_for_no_sync(tiny_model_dir):
    from types import SimpleNamespace

    from lightning.pytorch.strategies.parallel import ParallelStrategy

    fake = FakeDataflowClient(tiny_model_dir)
    batch = collate_batch(fake.make_batch(4))
    policy = M2POPolicy(str(tiny_model_dir), micro_batch_size=2)
    policy.configure_model()
    backwards = []
    strategy = SimpleNamespace(
        model=_RefusesNoSync(),
        block_backward_sync=lambda: ParallelStrategy.block_backward_sync(strategy),
        backward=lambda loss, optimizer, *a, **k: (backwards.append(1), loss.backward()))
    prepared = policy.prepare_batch(batch)
    policy._trainer = SimpleNamespace(strategy=strategy, world_size=1)
    try:
        policy.accumulate_gradients(prepared)
    finally:
        policy._trainer = None
    assert len(backwards) == 2  # one backward per micro-batch, none under no_sync
    assert all(p.grad is not None for p in policy.model.parameters() if p.requires_grad)


def test_several_updates_per_batch_stay_one_step(tiny_model_dir, tmp_path):
    """``minibatches`` x ``batch_passes`` optimizer updates per batch, each stepping the
    optimizer and the schedule, while ``global_step`` (versions, max_steps) counts batches and
    every batch is acknowledged once."""
    fake = FakeDataflowClient(tiny_model_dir, logprob_noise=0.3)
    # every update steps AdamW, the empty ones too (M2PO may mask all of a 2-sample part)
    policy = M2POPolicy(str(tiny_model_dir), lr=1e-3, warmup_steps=8, minibatches=2,
                        batch_passes=2, skip_empty_updates=False)
    trainer = make_trainer(tmp_path, max_steps=2)
    fake.trainer = trainer
    trainer.fit(policy, datamodule=make_data(fake))

    assert trainer.global_step == 2
    assert [s for _, s in fake.acks] == [1, 2]
    adam = policy.optimizers().optimizer
    steps = {int(state["step"]) for state in adam.state.values()}
    assert steps == {8}  # 2 batches x 2 passes x 2 minibatches
    metrics = trainer.callback_metrics
    assert float(metrics["train/updates"]) == 4
    # the second batch's first update is the fifth of the warm-up: lr x 5/8
    assert float(metrics["train/lr"]) == pytest.approx(1e-3 * 5 / 8)
    assert torch.isfinite(metrics["train/loss"])


def _learn_then_solved(batch_number, group_size):
    """The first batch has a learning signal (one success per group), every later one is
    solved: all rewards 1, every advantage 0."""
    return [1.0] + [0.0] * (group_size - 1) if batch_number == 0 else [1.0] * group_size


@pytest.mark.parametrize("skip", [True, False])
def test_updates_without_a_gradient_leave_the_optimizer_alone(tiny_model_dir, tmp_path, skip):
    """After one update with a signal, three batches whose advantages are all 0: with
    ``skip_empty_updates`` (the default) the weights and AdamW's state stay as the first update
    left them, while the steps, versions and acks still count; without it AdamW keeps moving the
    weights on momentum alone (what drifted a converged policy into a collapse)."""
    fake = FakeDataflowClient(tiny_model_dir, group_rewards=_learn_then_solved)
    after_first = {}

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                after_first.update({k: v.clone() for k, v in module.model.state_dict().items()})

    policy = M2POPolicy(str(tiny_model_dir), lr=1e-3, minibatches=2, skip_empty_updates=skip)
    trainer = make_trainer(tmp_path, max_steps=4, callbacks=[Snapshot()])
    fake.trainer = trainer
    trainer.fit(policy, datamodule=make_data(fake))

    assert trainer.global_step == 4 and [s for _, s in fake.acks] == [1, 2, 3, 4]
    assert float(trainer.callback_metrics["train/empty_update_fraction"]) == 1.0
    assert float(trainer.callback_metrics["train/grad_norm"]) == 0.0
    adam = policy.optimizers().optimizer
    steps = {int(state["step"]) for state in adam.state.values()}
    trained = policy.model.state_dict()
    moved = [k for k in after_first if not torch.equal(trained[k], after_first[k])]
    if skip:
        assert steps == {2}  # the first batch's two updates only
        assert moved == []
    else:
        assert steps == {8}
        assert moved  # momentum alone moved the weights


def test_updates_step_anyway_under_a_gradient_scaler(tiny_model_dir, tmp_path):
    """fp16 mixed precision's GradScaler cannot step an optimizer without gradients (it asserts
    on an empty inf check), so with a scaler in the precision plugin nothing is skipped."""
    from types import SimpleNamespace

    policy = M2POPolicy(str(tiny_model_dir))
    trainer = make_trainer(tmp_path)
    policy.trainer = trainer
    assert not policy._grad_scaler()  # 32-bit: no scaler, empty updates are skipped
    trainer.strategy.precision_plugin = SimpleNamespace(scaler=torch.amp.GradScaler("cpu"))
    assert policy._grad_scaler()


class _KeepsBatch(M2POPolicy):
    def training_step(self, batch, batch_idx):
        self.seen = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        return super().training_step(batch, batch_idx)


def test_minibatches_equal_sequential_steps_on_the_parts(tiny_model_dir, tmp_path):
    """A fit step with two minibatches is two AdamW steps, each on its half of the batch with
    the half's own context: the same weights as stepping on the halves by hand."""
    fake = FakeDataflowClient(tiny_model_dir, logprob_noise=0.4, seed=5)
    policy = _KeepsBatch(str(tiny_model_dir), lr=1e-2, grad_clip=None, minibatches=2,
                         skip_empty_updates=False)  # steps as the loop by hand below does
    make_trainer(tmp_path, max_steps=1).fit(policy, datamodule=make_data(fake))

    def by_hand(parts):
        ref = M2POPolicy(str(tiny_model_dir), lr=1e-2, grad_clip=None)
        ref.configure_model()
        opt = torch.optim.AdamW(ref.model.parameters(), lr=1e-2, weight_decay=0.0)
        prepared = ref.prepare_batch(policy.seen)
        for sl in parts:
            ref.accumulate_gradients(ref._slice(prepared, sl, 4))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return ref.model.state_dict()

    halves = by_hand([slice(0, 2), slice(2, 4)])
    whole = by_hand([slice(0, 4)])
    trained = policy.model.state_dict()
    for name, value in halves.items():
        torch.testing.assert_close(trained[name], value)
    assert any(not torch.equal(trained[k], whole[k]) for k in whole)


def test_update_counts_are_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="minibatches: must be an integer >= 1"):
        M2POPolicy(str(tiny_model_dir), minibatches=0)
    with pytest.raises(ValueError, match="batch_passes: must be an integer >= 1"):
        M2POPolicy(str(tiny_model_dir), batch_passes=1.5)
    policy = M2POPolicy(str(tiny_model_dir), minibatches=3)
    assert [(s.start, s.stop) for s in policy.update_slices(7)] == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="minibatches: 3 updates per pass need at least"):
        policy.update_slices(2)


def test_entropy_bonus_is_in_the_loss_and_micro_batches_add_up(tiny_model_dir):
    """``entropy_coef`` subtracts coef x the mean entropy per trained token from the loss, with
    its gradient; micro-batching gives the same gradient as one pass."""
    fake = FakeDataflowClient(tiny_model_dir, logprob_noise=0.4, seed=7)
    batch = collate_batch(fake.make_batch(6))
    runs = {}
    for coef, mbs in ((0.0, None), (0.5, None), (0.5, 2)):
        policy = M2POPolicy(str(tiny_model_dir), entropy_coef=coef, micro_batch_size=mbs)
        policy.configure_model()
        out = policy.accumulate_gradients(policy.prepare_batch(batch))
        runs[coef, mbs] = (out, {n: p.grad.clone() for n, p in policy.model.named_parameters()})
    plain, _ = runs[0.0, None]
    bonus, grads = runs[0.5, None]
    assert float(bonus["entropy"]) > 0
    assert float(bonus["entropy_loss"]) == pytest.approx(-0.5 * float(bonus["entropy"]), rel=1e-4)
    assert float(bonus["loss"]) == pytest.approx(
        float(plain["loss"]) - 0.5 * float(plain["entropy"]), rel=1e-4, abs=1e-6)
    assert "entropy_loss" not in plain
    assert any(not torch.allclose(g, runs[0.0, None][1][n]) for n, g in grads.items())
    micro, micro_grads = runs[0.5, 2]
    assert float(micro["entropy_loss"]) == pytest.approx(float(bonus["entropy_loss"]), rel=1e-4)
    for name, g in grads.items():
        torch.testing.assert_close(micro_grads[name], g, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="entropy_coef: must be >= 0"):
        M2POPolicy(str(tiny_model_dir), entropy_coef=-0.1)
