"""What the objective sees and what the step logs (issue 19, items 16 and 32).

- ``prepare_batch`` keeps the group structure and provenance of the batch (``group_ids``,
  ``task_ids``, ``metadata``, ``policy_version``, ...) and every micro-batch gets the slice of the
  per-sample lists that matches its tensors;
- the policy entropy per token: :func:`masked_entropy_sum` against the textbook formula, and the
  training step's ``entropy`` against the model's own logits, with and without micro-batches;
- M2PO logs its second moment once (``m2_before``), not twice.
"""

from __future__ import annotations

import math

import pytest
import torch

from astralight.datamodules import collate_batch
from astralight.policy import M2POPolicy, RLPolicy
from astralight.rl.entropy import masked_entropy_sum
from tests.fakes import FakeDataflowClient


class Recording(RLPolicy):
    """Records what every micro-batch saw; the loss is a plain token-mean policy gradient."""

    def __init__(self, model_path: str, **kwargs):
        super().__init__(model_path, **kwargs)
        self.seen: list[dict] = []

    def compute_loss(self, batch, logp):
        self.seen.append({"task_ids": list(batch["task_ids"]), "metadata": batch["metadata"],
                          "group_ids": batch["group_ids"].tolist(),
                          "rewards": batch["rewards"].tolist(),
                          "policy_version": batch["policy_version"]})
        mask = batch["mask"]
        loss = -(logp * batch["advantages"])[mask].sum() / batch["n_tokens"]
        return loss, {"pg_token_loss": loss.detach()}


def a_batch(model_dir, size=6, seed=0):
    fake = FakeDataflowClient(model_dir, seed=seed, group_size=3)
    fake.version = 5
    raw = fake.make_batch(size)
    for i, s in enumerate(raw.samples):
        s.metadata = {**s.metadata, "tag": i}
    return raw, collate_batch(raw, trainer_version=6)


# ----------------------------------------------------------------------------- 32: group structure


def test_prepare_batch_keeps_the_group_structure(tiny_model_dir):
    raw, batch = a_batch(tiny_model_dir)
    prepared = Recording(str(tiny_model_dir)).prepare_batch(batch)
    assert prepared["task_ids"] == [s.task_id for s in raw.samples]
    assert [m["tag"] for m in prepared["metadata"]] == list(range(6))
    assert prepared["metadata"][0]["finish_reason"] == "stop"
    # two tasks of three samples: ids in order of first appearance
    assert prepared["group_ids"].tolist() == [0, 0, 0, 1, 1, 1]
    assert prepared["group_ids"].dtype == torch.long
    assert (prepared["policy_version"], prepared["trainer_version"]) == (5, 6)
    assert prepared["batch_id"] == raw.batch_id and prepared["model_id"] == "policy"


def test_a_hand_built_batch_without_task_ids_gets_one_group_per_sample(tiny_model_dir):
    _, batch = a_batch(tiny_model_dir, size=3)
    del batch["task_ids"], batch["metadata"]
    prepared = Recording(str(tiny_model_dir)).prepare_batch(batch)
    assert prepared["group_ids"].tolist() == [0, 1, 2]
    assert prepared["metadata"] == [{}, {}, {}]


def test_each_micro_batch_sees_the_lists_that_match_its_tensors(tiny_model_dir):
    raw, batch = a_batch(tiny_model_dir)
    policy = Recording(str(tiny_model_dir), micro_batch_size=4)
    policy.configure_model()
    policy.accumulate_gradients(policy.prepare_batch(batch))
    first, second = policy.seen
    assert first["task_ids"] == [s.task_id for s in raw.samples[:4]]
    assert second["task_ids"] == [s.task_id for s in raw.samples[4:]]
    assert [m["tag"] for m in second["metadata"]] == [4, 5]
    assert second["group_ids"] == [1, 1]  # the batch's numbering, not the micro-batch's
    assert second["rewards"] == [s.reward for s in raw.samples[4:]]
    assert first["policy_version"] == second["policy_version"] == 5


# ----------------------------------------------------------------------------- 16: entropy


def test_masked_entropy_sum_is_the_entropy_of_the_tempered_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3
    mask = torch.rand(3, 5) > 0.4
    logits[~mask] = float("nan")  # positions off the mask are never read
    for temperature, chunk in ((1.0, None), (0.7, 2), (1.3, 1)):
        total, count = masked_entropy_sum(logits, mask, temperature, chunk)
        want = torch.distributions.Categorical(logits=logits[mask] / temperature).entropy()
        assert count == int(mask.sum())
        assert float(total) == pytest.approx(float(want.sum()), rel=1e-5)
    uniform, n = masked_entropy_sum(torch.zeros(2, 4, 8), torch.ones(2, 4, dtype=torch.bool))
    assert float(uniform) / n == pytest.approx(math.log(8))
    empty, none = masked_entropy_sum(torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.bool))
    assert (float(empty), none) == (0.0, 0)
    with pytest.raises(ValueError, match="mask: shape"):
        masked_entropy_sum(torch.zeros(2, 3, 8), torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("micro_batch_size", [None, 2])
def test_the_step_entropy_is_the_model_entropy_on_trained_tokens(tiny_model_dir,
                                                                 micro_batch_size):
    _, batch = a_batch(tiny_model_dir)
    policy = M2POPolicy(str(tiny_model_dir), temperature=0.8, micro_batch_size=micro_batch_size)
    policy.configure_model()
    prepared = policy.prepare_batch(batch)
    with torch.no_grad():
        logits = policy.model(input_ids=prepared["input_ids"],
                              attention_mask=prepared["attention_mask"]).logits[:, :-1]
    mask = prepared["mask"]
    want = torch.distributions.Categorical(logits=logits[mask] / 0.8).entropy().mean()
    out = policy.accumulate_gradients(prepared)
    assert float(out["entropy"]) == pytest.approx(float(want), rel=1e-4)
    assert 0 < float(out["entropy"]) < math.log(policy.model.config.vocab_size)


def test_m2po_logs_its_second_moment_once(tiny_model_dir):
    _, batch = a_batch(tiny_model_dir)
    for loss in ("m2po", "ppo_clip"):
        policy = M2POPolicy(str(tiny_model_dir), loss=loss)
        policy.configure_model()
        out = policy.accumulate_gradients(policy.prepare_batch(batch))
        if loss == "m2po":  # m2 over the micro-batch would repeat m2_before over the batch
            assert "m2_before" in out and "m2" not in out
        else:  # PPO-clip has no selection: its m2 is the only one
            assert "m2" in out and "m2_before" not in out
