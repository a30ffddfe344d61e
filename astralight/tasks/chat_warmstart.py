"""Supervised warm start of the tiny chat model on scripted conversations.

Why: a randomly initialised model never writes a chat turn, let alone a well-formed tool call, so
an agentic task gives RL nothing to work with. A short supervised run on scripted conversations
(the recipe's own task, rendered by the same chat template and laid out by the same
:class:`~astralight.agents.chat.ChatTranscript` the workflows use, so training sees exactly the
token streams RL will) teaches the format; the recipe's choice of scripts decides how much of the
skill it also teaches.

A conversation is a list of messages ending in an assistant turn. Every assistant turn is trained
(its text and its ``<|im_end|>``); everything else is context. Same optimiser, schedule and
clipping as the arithmetic warm start (:func:`astralight.tasks.sft_loop.sft`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from astralight.agents.chat import ChatTranscript, encode
from astralight.engine import Completion
from astralight.tasks.sft_loop import Progress, sft
from astralight.tasks.warmstart_folder import build_folder
from astralight.trainer.tinymodel import CHAT_MODEL_SPEC, TinyModelSpec, build_chat_model, build_chat_tokenizer

Conversation = Sequence[dict]


def transcript_of(tokenizer, conversation: Conversation, tools: list | None = None,
                  **template_kwargs) -> ChatTranscript:
    """``conversation`` laid out as the workflows lay out an episode: the messages before the
    first assistant turn as the prompt, then each assistant turn as if generated (with its stop
    token), and the messages between turns as the template renders them (``template_kwargs``:
    as a workflow's, e.g. ``chat_template``)."""
    first = next((i for i, m in enumerate(conversation) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("conversation: needs messages before a first assistant turn")
    if conversation[-1]["role"] != "assistant":
        raise ValueError("conversation: must end with an assistant turn")
    t = ChatTranscript(tokenizer, conversation[:first], tools, **template_kwargs)
    pending: list[dict] = []
    for m in conversation[first:]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            t.add_messages(pending)
            pending = []
        ids = encode(tokenizer, m["content"]) + [tokenizer.eos_token_id]
        t.add_completion(Completion(ids, [0.0] * len(ids), "stop", version=0), 0, m["content"])
    return t


def encode_conversations(tokenizer, conversations: Sequence[Conversation], tools: list | None = None,
                         max_len: int | None = None, **template_kwargs):
    """Right-padded ids, attention mask and loss mask (assistant turns) of ``conversations``."""
    rows = [transcript_of(tokenizer, c, tools, **template_kwargs) for c in conversations]
    width = max(len(r) for r in rows)
    if max_len is not None and width > max_len:
        raise ValueError(f"conversations: the longest is {width} tokens, more than the model's "
                         f"{max_len}; shorten the scripts or raise max_position_embeddings")
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r)
        ids[i, :n] = torch.tensor(r.token_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(r.loss_mask, dtype=torch.float32)
    return ids, attn, mask


def train_chat_warmstart(conversations: Sequence[Conversation], tools: list | None = None,
                         spec: TinyModelSpec | None = None, sft_steps: int = 600, lr: float = 5e-3,
                         batch_size: int = 32, seed: int = 0, progress: Progress | None = None):
    """The tiny chat model trained on ``conversations``; returns ``(model, tokenizer)``."""
    if not conversations:
        raise ValueError("conversations: the warm start needs at least one")
    tokenizer = build_chat_tokenizer()
    model = build_chat_model(spec or CHAT_MODEL_SPEC)
    ids, attn, mask = encode_conversations(tokenizer, conversations, tools,
                                           model.config.max_position_embeddings)
    sft(model, ids, attn, mask, torch.zeros_like(mask), torch.tensor([0]), sft_steps, lr,
         batch_size, seed, 0.0, progress)
    return model, tokenizer


def build_chat_policy(out_dir: str | Path, conversations: Callable[[], Sequence[Conversation]],
                      tools: list | None = None, spec: TinyModelSpec | None = None,
                      sft_steps: int = 600, lr: float = 5e-3, batch_size: int = 32, seed: int = 0,
                      progress: Progress | bool = True, num_threads: int | None = 1,
                      provenance: dict | None = None) -> Path:
    """Warm-start the tiny chat model on ``conversations()`` and save it as a model folder at
    ``out_dir`` (written aside and renamed into place, with ``warmstart.json``)."""
    kwargs = {"conversations": list(conversations()), "tools": tools, "spec": spec,
              "sft_steps": sft_steps, "lr": lr, "batch_size": batch_size, "seed": seed}
    record = {"sft_steps": sft_steps, "lr": lr, "batch_size": batch_size, "seed": seed,
              "conversations": len(kwargs["conversations"]), **(provenance or {})}
    return build_folder(out_dir, train_chat_warmstart, kwargs, record, sft_steps, progress,
                         num_threads)
