"""The supervised loop every shipped warm start runs, and its batch layout.

Plain torch, no Lightning: a warm start runs once before a run (a recipe's ``prepare`` step).
:func:`sft` samples seeded batches from right-padded examples (:func:`pad_examples`) and trains
with AdamW (no weight decay), linear warm-up over the first 10% of steps, then a cosine decay to
10% of ``lr``, grad-norm clip 1.0; the loss is a cross-entropy on the loss-masked tokens,
optionally against label-smoothed targets. The arithmetic, solver-verifier, chat and
user-data warm starts (:mod:`astralight.tasks.warmstart`, :mod:`astralight.tasks.chat_warmstart`,
:mod:`astralight.tasks.sft_warmstart`) differ only in their examples and smoothing.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Callable

import torch

#: ``progress(step, loss)``, called after every optimizer step
Progress = Callable[[int, float], None]


def print_progress(total: int, every: int | None = None, stream=sys.stderr) -> Progress:
    """A ``progress`` callback that prints step, loss and elapsed time ~20 times per run."""
    start = time.monotonic()
    every = every or max(1, total // 20)

    def report(step: int, loss: float) -> None:
        if step % every == 0 or step == total:
            print(f"[warmstart] step {step}/{total} loss {loss:.4f} "
                  f"({time.monotonic() - start:.1f} s)", file=stream, flush=True)

    return report


def check_sft_args(sft_steps: int, batch_size: int, lr: float, label_smoothing: float) -> None:
    """Raise ValueError naming the first supervised warm-start argument out of range."""
    if sft_steps < 0:
        raise ValueError(f"sft_steps: must be >= 0, got {sft_steps}")
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    if not lr > 0:
        raise ValueError(f"lr: must be > 0, got {lr}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing: must be in [0, 1), got {label_smoothing}")


def pad_examples(rows: list[list[int]], masks: list[list[int]], pad_id: int):
    """Token rows and their loss masks as right-padded ``ids`` / ``attention`` long and
    ``loss_mask`` float tensors ``[n, longest]`` (the warm starts' batch layout)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, attn, loss_mask


def sft(model, ids, attn, loss_mask, smooth_mask, support, sft_steps: int, lr: float,
        batch_size: int, seed: int, label_smoothing: float, progress: Progress | None):
    """Train ``model`` for ``sft_steps`` on batches drawn (seeded by ``seed``) from the padded
    examples; returns it in eval mode. Where ``smooth_mask`` is set the target is smoothed:
    ``1 - label_smoothing`` on the right token, ``label_smoothing`` spread over the ``support``
    ids."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, sft_steps // 10)

    def lr_factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, sft_steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    for step in range(sft_steps):
        idx = torch.randint(len(ids), (batch_size,), generator=gen)
        b_ids, b_attn = ids[idx], attn[idx]
        width = int(b_attn.sum(-1).max())
        b_ids, b_attn = b_ids[:, :width], b_attn[:, :width]
        b_mask = loss_mask[idx][:, 1:width]
        b_smooth = smooth_mask[idx][:, 1:width].float()
        logits = model(input_ids=b_ids, attention_mask=b_attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        nll = -logp.gather(-1, b_ids[:, 1:, None]).squeeze(-1)
        if label_smoothing > 0:
            smooth = (1 - label_smoothing) * nll - label_smoothing * logp[..., support].mean(-1)
            nll = b_smooth * smooth + (1 - b_smooth) * nll
        loss = (nll * b_mask).sum() / b_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress is not None:
            progress(step + 1, float(loss.detach()))
    model.eval()
    return model
