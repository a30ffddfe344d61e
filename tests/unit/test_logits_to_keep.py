"""The trainer computes the output projection only from the first trained token on
(``logits_to_keep``, :func:`astralight.rl.logprobs.causal_lm_next_logits`): the log-probs of
every trained token, the entropy, the loss and the gradients are those of the full projection,
and the skipped columns are 0."""

from __future__ import annotations

import pytest
import torch

from astralight.datamodules import collate_batch
from astralight.policy import M2POPolicy
from astralight.rl import logprobs as logprobs_mod
from astralight.rl.logprobs import (accepts_logits_to_keep, causal_lm_logprobs,
                                    first_trained_target)
from tests.fakes import FakeDataflowClient


def test_first_trained_target():
    mask = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]]).bool()
    assert first_trained_target(mask) == 2
    assert first_trained_target(torch.zeros(2, 4, dtype=torch.bool)) == 0
    assert first_trained_target(None) == 0


def test_trimmed_logprobs_equal_the_full_ones_on_trained_columns(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert accepts_logits_to_keep(model)
    ids = torch.tensor([[2, 10, 11, 12, 13, 14, 1], [2, 20, 21, 22, 23, 0, 0]])
    attn = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    full = causal_lm_logprobs(model, ids, attn, temperature=0.7)
    trimmed = causal_lm_logprobs(model, ids, attn, temperature=0.7, first=3)
    assert trimmed.shape == full.shape == (2, 6)
    torch.testing.assert_close(trimmed[:, 3:], full[:, 3:], rtol=1e-5, atol=1e-5)
    assert torch.equal(trimmed[:, :3], torch.zeros(2, 3))


class NoKeep(torch.nn.Module):
    """A causal LM whose forward has no ``logits_to_keep``: the full projection is used."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


def test_a_model_without_logits_to_keep_gets_the_full_projection(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = NoKeep(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    assert not accepts_logits_to_keep(model)
    ids = torch.tensor([[2, 10, 11, 12, 13, 14, 1]])
    out = causal_lm_logprobs(model, ids, first=3)
    assert torch.all(out[:, :3] < 0)  # computed, not skipped
    torch.testing.assert_close(out, causal_lm_logprobs(model, ids))


def _grads(policy) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("micro_batch_size", [None, 2])
def test_a_training_step_is_unchanged_by_the_trimming(tiny_model_dir, monkeypatch,
                                                      micro_batch_size):
    collated = collate_batch(FakeDataflowClient(tiny_model_dir, logprob_noise=0.3).make_batch(6),
                             trainer_version=0)
    results = []
    for trim in (True, False):
        if not trim:
            monkeypatch.setattr(logprobs_mod, "accepts_logits_to_keep", lambda model: False)
        torch.manual_seed(0)
        policy = M2POPolicy(str(tiny_model_dir), micro_batch_size=micro_batch_size,
                            temperature=0.7)
        policy.configure_model()
        batch = policy.prepare_batch(dict(collated))
        assert first_trained_target(batch["mask"]) > 0  # the prompts are not trained
        out = policy.accumulate_gradients(batch, weights_version=0)
        results.append((out, _grads(policy)))
    (trimmed, g_trim), (full, g_full) = results
    assert g_trim.keys() == g_full.keys() and g_trim
    for name in g_full:
        torch.testing.assert_close(g_trim[name], g_full[name], rtol=1e-4, atol=1e-6)
    for key in ("loss", "entropy", "mismatch_abs_mean"):
        torch.testing.assert_close(trimmed[key], full[key], rtol=1e-4, atol=1e-6)
