"""astralight.trainer.hf_models: a model whose config ties its embeddings is tied even when transformers'
tying is off in the process (as overlapping ``from_pretrained`` calls in two threads leave it),
and astralight's own loads never overlap."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.modeling_utils import PreTrainedModel

from astralight.trainer.hf_models import MODEL_LOCK, tie_if_configured
from astralight.policy import empty_causal_lm, load_causal_lm
from astralight.trainer.tinymodel import TinyModelSpec, build_model, build_tokenizer, save_model_folder


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return save_model_folder(build_model(TinyModelSpec(tie_word_embeddings=True)),
                             build_tokenizer(), tmp_path_factory.mktemp("tied") / "model")


def _tied(model) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


@pytest.fixture
def tying_off(monkeypatch):
    """What a lost race between two from_pretrained calls leaves behind."""
    monkeypatch.setattr(PreTrainedModel, "tie_weights", lambda self, *a, **k: None)


def test_loads_and_builds_are_tied_even_with_transformers_tying_off(tied_dir, tying_off):
    loaded = load_causal_lm(str(tied_dir))
    assert _tied(loaded)
    # the embedding the checkpoint stores, not a random lm_head
    stored = load_file(str(tied_dir / "model.safetensors"))["model.embed_tokens.weight"]
    assert "lm_head.weight" not in load_file(str(tied_dir / "model.safetensors"))
    assert torch.equal(loaded.lm_head.weight, stored)
    assert _tied(empty_causal_lm(str(tied_dir)))
    assert _tied(build_model(TinyModelSpec(tie_word_embeddings=True)))


def test_untied_configs_and_deliberately_untied_checkpoints_are_left_alone(tied_dir, tmp_path):
    assert not tie_if_configured(build_model(TinyModelSpec(tie_word_embeddings=False)))
    # a checkpoint holding two different matrices under a tying config: transformers keeps them
    # apart (and drops the pair from all_tied_weights_keys); so does tie_if_configured
    folder = save_model_folder(build_model(TinyModelSpec(tie_word_embeddings=True)),
                               build_tokenizer(), tmp_path / "both")
    state = load_file(str(folder / "model.safetensors"))
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = load_causal_lm(str(folder))
    assert not _tied(model) and torch.equal(model.lm_head.weight, state["lm_head.weight"])


def test_concurrent_loads_leave_transformers_tying_on(tied_dir):
    original = PreTrainedModel.tie_weights
    errors: list[BaseException] = []

    def load():
        try:
            for _ in range(3):
                assert _tied(load_causal_lm(str(tied_dir)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert PreTrainedModel.tie_weights is original
    assert MODEL_LOCK.acquire(blocking=False)  # nothing left holding it
    MODEL_LOCK.release()
