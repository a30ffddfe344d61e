"""The custom-objective contract of ``RLPolicy`` and the REINFORCE example built on it.

- a subclass that implements only ``compute_loss`` trains under ``Trainer.fit`` (model, KL,
  optimizer, acks and metrics come from the base class);
- a subclass that does not gets a clear error when it is built;
- ``ReinforceWithBaseline``: the loss on hand-computed tensors with masks, its baseline sequence,
  the baseline's state-dict round trip, micro-batching equal to one pass;
- ``LeaveOneOut`` (RLOO): the group baseline from the batch's ``group_ids`` on hand-computed
  groups, micro-batching equal to one pass, training under ``Trainer.fit``;
- the example's recipe resolves onto the toy recipe with the REINFORCE trainer.
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from astralight.datamodules import RolloutDataModule, collate_batch
from astralight.policy import M2POPolicy, RLPolicy
from tests.fakes import FakeDataflowClient

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "custom_trainer"


@pytest.fixture(scope="module")
def reinforce_module():
    """The example module, imported the way the README says (its folder on the path)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield importlib.import_module("reinforce")
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("reinforce", None)


@pytest.fixture(scope="module")
def rloo_module():
    """The RLOO example (a group baseline from ``group_ids``), imported like ``reinforce``."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield importlib.import_module("rloo")
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("rloo", None)


class TokenMeanPG(RLPolicy):
    """Only the one method: a plain token-mean policy gradient on the dataflow's advantages."""

    def __init__(self, model_path: str, scale: float = 1.0, **kwargs):
        super().__init__(model_path, **kwargs)
        self.scale = scale

    def compute_loss(self, batch, logp):
        mask = batch["mask"]
        loss = -self.scale * (logp * batch["advantages"])[mask].sum() / batch["n_tokens"]
        return loss, {"pg_token_loss": loss.detach()}


def fit(policy, model_dir, tmp_path, steps=2):
    fake = FakeDataflowClient(model_dir, logprob_noise=0.2)
    dm = RolloutDataModule("http://127.0.0.1:1", model_id="policy", batch_size=4)
    dm.client = fake
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1,
                         logger=pl.loggers.CSVLogger(tmp_path), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1)
    trainer.fit(policy, datamodule=dm)
    return trainer, fake


# ----------------------------------------------------------------------------- the base class


def test_a_subclass_implementing_only_compute_loss_trains(tiny_model_dir, tmp_path):
    policy = TokenMeanPG(str(tiny_model_dir), scale=2.0, lr=1e-3, kl_coef=0.05)
    policy.configure_model()
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    trainer, fake = fit(policy, tiny_model_dir, tmp_path)

    assert trainer.global_step == 2 and len(fake.acks) == 2  # acked after each step
    after = policy.model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    metrics = trainer.callback_metrics
    # the objective's metric, the base's KL penalty, optimizer and throughput metrics
    for key in ("train/pg_token_loss", "train/kl_k3", "train/kl_loss", "train/grad_norm",
                "train/lr", "train/reward_mean", "perf/wait_s", "train/loss"):
        assert key in metrics, key
    assert "train/m2_before" not in metrics
    # loss = objective + KL penalty (summed by the base class)
    assert float(metrics["train/loss"]) == pytest.approx(
        float(metrics["train/pg_token_loss"]) + float(metrics["train/kl_loss"]), abs=1e-6)
    # hparams: the subclass's own argument first, then the base's, all saved
    assert list(policy.hparams)[:2] == ["model_path", "scale"]
    assert policy.hparams["scale"] == 2.0 and policy.hparams["kl_coef"] == 0.05
    assert isinstance(M2POPolicy(str(tiny_model_dir)), RLPolicy)


def test_without_compute_loss_the_error_says_what_to_write(tiny_model_dir):
    class NoObjective(RLPolicy):
        pass

    with pytest.raises(TypeError, match=r"NoObjective does not implement compute_loss\(batch, "
                                        r"logp\) -> \(loss, metrics\)"):
        NoObjective(str(tiny_model_dir))
    with pytest.raises(TypeError, match="RLPolicy is a base class with no objective"):
        RLPolicy(str(tiny_model_dir))


def test_loss_context_gives_whole_batch_normalisers():
    policy = TokenMeanPG("unused")
    mask = torch.tensor([[True, True, False], [False, True, False], [False, False, False]])
    ctx = policy.loss_context({"mask": mask}, torch.zeros(3, 3))
    assert float(ctx["n_tokens"]) == 3.0 and float(ctx["n_samples"]) == 3.0
    assert "ref_logp" not in ctx  # kl_coef == 0: no reference model


# ----------------------------------------------------------------------------- REINFORCE


def test_reinforce_loss_on_hand_computed_tensors(reinforce_module):
    policy = reinforce_module.ReinforceWithBaseline("unused")
    logp = torch.tensor([[-0.5, -1.0, -2.0, float("-inf")],
                         [-0.1, -0.2, -0.3, -0.4],
                         [-3.0, -3.0, -3.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[False, True, True, False],   # prompt token, 2 generated, padding
                         [True, True, True, True],
                         [False, False, False, False]])  # nothing trained in this sample
    batch = {"mask": mask, "rewards": torch.tensor([1.0, 0.0, 1.0]),
             "baseline": torch.tensor(0.25), "n_samples": torch.tensor(6.0)}  # of a larger batch
    loss, metrics = policy.compute_loss(batch, logp)

    # seq logp: -3.0, -1.0, 0.0 ; advantages: 0.75, -0.25, 0.75
    expected = -(0.75 * -3.0 + -0.25 * -1.0 + 0.75 * 0.0) / 6.0
    assert float(loss.detach()) == pytest.approx(expected)
    assert math.isfinite(float(loss.detach()))  # the -inf off the mask does not leak in
    loss.backward()
    grad = torch.tensor([[0.0, -0.75, -0.75, 0.0], [0.25] * 4, [0.0] * 4]) / 6.0
    torch.testing.assert_close(logp.grad, grad)
    assert float(metrics["reinforce_loss"]) == pytest.approx(expected)
    assert float(metrics["baseline"]) == 0.25
    assert float(metrics["sequence_logprob_mean"]) == pytest.approx(-4.0 / 3)
    assert float(metrics["reinforce_advantage_mean"]) == pytest.approx(1.25 / 3)


def test_reinforce_baseline_is_a_bias_corrected_ema_of_earlier_batches(reinforce_module):
    policy = reinforce_module.ReinforceWithBaseline("unused", baseline_decay=0.5)
    mask = torch.ones(2, 3, dtype=torch.bool)
    seen = []
    for rewards in ([1.0, 1.0], [0.0, 0.0], [1.0, 0.0]):
        ctx = policy.loss_context({"mask": mask, "rewards": torch.tensor(rewards)},
                                  torch.zeros(2, 3))
        seen.append(float(ctx["baseline"]))
        assert float(ctx["n_samples"]) == 2.0
    # batch 1 sees no history (0); then ema 0.5 / (1 - 0.5) = 1; then 0.25 / (1 - 0.25) = 1/3
    assert seen == pytest.approx([0.0, 1.0, 1.0 / 3.0])
    # after the third batch: ema = 0.5 * 0.25 + 0.5 * 0.5 = 0.375, / (1 - 0.125)
    assert float(policy.baseline) == pytest.approx(0.375 / 0.875)
    with pytest.raises(ValueError, match=r"baseline_decay: must be in \[0, 1\)"):
        reinforce_module.ReinforceWithBaseline("unused", baseline_decay=1.0)


def test_reinforce_baseline_round_trips_through_the_state_dict(reinforce_module):
    trained = reinforce_module.ReinforceWithBaseline("unused", baseline_decay=0.8)
    for rewards in ([1.0, 0.0, 1.0], [1.0, 1.0, 1.0]):
        trained.update_baseline(torch.tensor(rewards))
    state = trained.state_dict()
    assert {"reward_ema", "baseline_updates"} <= set(state)

    fresh = reinforce_module.ReinforceWithBaseline("unused", baseline_decay=0.8)
    assert float(fresh.baseline) == 0.0
    fresh.load_state_dict(state)
    assert int(fresh.baseline_updates) == 2
    assert float(fresh.baseline) == float(trained.baseline)
    # 0.2 * 2/3 * 0.8 + 0.2 * 1 = 0.30667, / (1 - 0.64)
    assert float(fresh.baseline) == pytest.approx((0.2 * 2 / 3 * 0.8 + 0.2) / 0.36)


def test_reinforce_micro_batching_equals_one_pass(tiny_model_dir, reinforce_module):
    batch = collate_batch(FakeDataflowClient(tiny_model_dir, seed=5).make_batch(6))
    grads, losses = [], []
    for mbs in (None, 2):
        policy = reinforce_module.ReinforceWithBaseline(str(tiny_model_dir), micro_batch_size=mbs)
        policy.update_baseline(torch.tensor([0.3]))  # a non-zero baseline from "earlier"
        policy.configure_model()
        out = policy.accumulate_gradients(policy.prepare_batch(batch))
        assert int(policy.baseline_updates) == 2  # once per optimizer batch, not per micro-batch
        assert float(out["baseline"]) == pytest.approx(0.3)
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters()})
        losses.append(float(out["loss"]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6)
    assert any(float(g.abs().sum()) > 0 for g in grads[0].values())


def test_reinforce_trains_under_fit(tiny_model_dir, tmp_path, reinforce_module):
    policy = reinforce_module.ReinforceWithBaseline(str(tiny_model_dir), lr=1e-3)
    trainer, fake = fit(policy, tiny_model_dir, tmp_path, steps=3)
    assert int(policy.baseline_updates) == 3 and len(fake.acks) == 3
    assert {"train/reinforce_loss", "train/baseline"} <= set(trainer.callback_metrics)


# ----------------------------------------------------------------------------- RLOO


def test_leave_one_out_baseline_on_hand_computed_groups(rloo_module):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])  # a group of 3, of 2, and one left alone
    fallback = torch.tensor([9.0, 9.0, 9.0, 9.0, 9.0, -0.25])
    adv, alone = rloo_module.leave_one_out_advantages(rewards, groups, fallback)
    # 1 - mean(0, 0); 0 - mean(1, 0); ...; 1 - 1; the lone sample keeps the dataflow's advantage
    assert adv.tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0, 0.0, -0.25])
    assert alone.tolist() == [False] * 5 + [True]


def test_rloo_uses_the_batch_groups_and_trains_under_fit(tiny_model_dir, tmp_path, rloo_module):
    batch = collate_batch(FakeDataflowClient(tiny_model_dir, seed=2, group_size=2).make_batch(4))
    grads = []
    for mbs in (None, 1):  # the baseline is fixed per optimizer batch: micro-batching agrees
        policy = rloo_module.LeaveOneOut(str(tiny_model_dir), micro_batch_size=mbs)
        policy.configure_model()
        out = policy.accumulate_gradients(policy.prepare_batch(batch))
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters()})
        assert float(out["rloo_alone_fraction"]) == 0.0  # two whole groups of two
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6)

    policy = rloo_module.LeaveOneOut(str(tiny_model_dir), lr=1e-3)
    trainer, fake = fit(policy, tiny_model_dir, tmp_path, steps=2)
    assert len(fake.acks) == 2 and "train/rloo_loss" in trainer.callback_metrics


# ----------------------------------------------------------------------------- the recipe


def test_example_recipe_is_the_toy_recipe_with_the_reinforce_trainer():
    from astralight.launch.recipe import load_recipe

    recipe = load_recipe(EXAMPLE / "recipe.yaml")
    toy = load_recipe(REPO / "examples" / "toy" / "recipe.yaml")
    assert recipe["dataflow"] == toy["dataflow"] and recipe["raas"] == toy["raas"]
    (trainer,) = recipe["trainers"]
    assert trainer["model"]["class_path"] == "reinforce.ReinforceWithBaseline"
    assert trainer["trainer"]["max_steps"] == recipe["stop"]["versions"]
    # every process finds the module: the recipe's pythonpath (relative to the recipe's folder)
    (folder,) = recipe["pythonpath"]
    assert (Path(folder) / "reinforce.py").is_file()
    assert recipe["env"] == toy["env"]
