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


#: the chat tokenizer's special tokens, Qwen3's names; ``<|im_end|>`` ends a turn (its EOS)
CHAT_SPECIAL_TOKENS = ["<pad>", "<|im_end|>", "<|im_start|>"]
#: tokens a chat model writes as text (kept by ``decode(skip_special_tokens=True)``), as in Qwen3
CHAT_TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                    "<think>", "</think>"]
#: every printable ASCII character and the newline, one token each
CHAT_CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n"]

#: A Qwen3-style chat template for the tiny chat tokenizer. It follows Qwen3's layout (turns
#: between ``<|im_start|>ROLE\n`` and ``<|im_end|>\n``; tools announced in the system turn;
#: consecutive tool results grouped in one user turn as ``<tool_response>`` blocks; the
#: ``<think>`` part of assistant turns before the last user message dropped), with the tools
#: announced by name only (``tools: add, search``) instead of Qwen3's full JSON schemas, so that a
#: character-level model's prompts stay short.
CHAT_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "tools: {% for t in tools %}{{ t.function.name if t.function is defined else t.name }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}<|im_end|>\n"
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}{{ '\\n' }}"
    "<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'assistant' %}"
    "{% set content = m.content or '' %}"
    "{% if loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>assistant\n{{ content }}"
    "{% for call in m.tool_calls or [] %}{% set f = call.function if call.function is defined else call %}"
    "<tool_call>{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_tokenizer():
    """A character-level chat tokenizer: one token per printable ASCII character or newline,
    Qwen3's turn and tool tokens, and :data:`CHAT_TEMPLATE` as its chat template.

    ``<|im_end|>`` is its EOS (a turn ends there, as in Qwen3); the tool and think tags are added
    tokens that ``decode(skip_special_tokens=True)`` keeps, so tool calls survive decoding.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(CHAT_SPECIAL_TOKENS + CHAT_TEXT_TOKENS
                                            + CHAT_CHARACTERS + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in CHAT_SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TEXT_TOKENS])
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        model_max_length=CHAT_MODEL_SPEC.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    out.chat_template = CHAT_TEMPLATE
    return out


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
    from astralight.trainer.hf_models import MODEL_LOCK, tie_if_configured

    with MODEL_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config)
        tie_if_configured(model)
    return model


#: the tiny chat model's shape: the chat vocabulary, room for a few turns of characters
CHAT_MODEL_SPEC = TinyModelSpec(vocab_size=128, max_position_embeddings=512)


def build_chat_model(spec: TinyModelSpec | None = None):
    """A randomly initialised tiny model for :func:`build_chat_tokenizer` (its ids: pad 0,
    ``<|im_end|>`` 1, ``<|im_start|>`` 2)."""
    spec = spec or CHAT_MODEL_SPEC
    if spec.vocab_size < len(build_chat_tokenizer()):
        raise ValueError(f"spec.vocab_size: the chat tokenizer needs at least "
                         f"{len(build_chat_tokenizer())}, got {spec.vocab_size}")
    return build_model(spec)


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
