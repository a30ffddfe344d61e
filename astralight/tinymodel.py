"""A tiny Qwen3-architecture model and a character-level tokenizer, built locally.

Nothing can come from a model hub on the machines this project is tested on, so the toy recipe
and the tests build their model here: deterministic from a seed, saved as an ordinary Hugging Face
model folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) that both
transformers and vLLM load unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: special tokens first, so their ids are fixed: pad=0, eos=1, bos=2
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]
#: every character the toy tasks use; unknown characters map to <unk>
CHARACTERS = list("0123456789+-*=?:;,. ()abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


@dataclass
class TinyModelSpec:
    """Shape of the tiny model; the defaults train in seconds on two CPU cores."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 128
    vocab_size: int = 96  # >= len(SPECIAL_TOKENS) + len(CHARACTERS) + 1, rounded up
    tie_word_embeddings: bool = False
    seed: int = 0


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast``: one token per character, no merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        model_max_length=TinyModelSpec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def build_model(spec: TinyModelSpec | None = None):
    """A randomly initialised ``Qwen3ForCausalLM`` of ``spec``'s shape (seeded)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec = spec or TinyModelSpec()
    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        rope_theta=10000.0,
        torch_dtype="float32",
    )
    from astralight.hf_models import MODEL_LOCK, tie_if_configured

    with MODEL_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config)
        tie_if_configured(model)
    return model


def save_model_folder(model, tokenizer, path: str | Path) -> Path:
    """Save model and tokenizer as a folder that transformers and vLLM both load."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # vLLM reads generation_config.json for the eos id; make it explicit.
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2})
    )
    return path


def build_tiny_model_folder(path: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Build a fresh tiny model + tokenizer folder at ``path`` and return it."""
    return save_model_folder(build_model(spec), build_tokenizer(), path)
