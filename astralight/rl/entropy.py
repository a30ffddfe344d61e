"""Policy entropy per token, from logits a forward pass already computed.

The entropy of the policy's next-token distribution at the sampling temperature,
``H = logsumexp(z / T) - sum_j softmax(z / T)_j * z_j / T``, is the usual early warning of an RL
run collapsing (entropy falling to 0) or blowing up. The trainer computes it from the logits of
the forward pass it runs anyway (no extra forward), over the loss-masked tokens only, chunk by
chunk so that only one chunk of ``[chunk, V]`` is ever upcast to float32 (the same memory bound
as :mod:`astralight.rl.logprobs`). As a metric it has no gradient; for an entropy bonus
(``RLPolicy(entropy_coef=...)``) it keeps it, and then every chunk's float32 copy stays in the
graph until the backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astralight.rl.logprobs import DEFAULT_CHUNK_ELEMENTS


def masked_entropy_sum(logits: Tensor, mask: Tensor, temperature: float = 1.0,
                       chunk_tokens: int | None = None, grad: bool = False) -> tuple[Tensor, int]:
    """``(sum of per-token entropies over mask, number of masked tokens)``, float32 sum.

    ``logits`` is ``[..., V]`` (any dtype; computed in float32, autocast off), ``mask`` ``[...]``
    (bool or 0/1). Positions off the mask are never read. The mean entropy per token is
    ``sum / count`` (0 tokens: sum 0). Summing lets micro-batches and ranks combine exactly.
    ``grad=True`` keeps the graph (an entropy bonus in the loss: ``RLPolicy(entropy_coef=...)``);
    by default the sum is a detached metric.
    """
    if grad:
        return _entropy_sum(logits, mask, temperature, chunk_tokens, detach=False)
    with torch.no_grad():
        return _entropy_sum(logits, mask, temperature, chunk_tokens, detach=True)


def _entropy_sum(logits: Tensor, mask: Tensor, temperature: float, chunk_tokens: int | None,
                 detach: bool) -> tuple[Tensor, int]:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != mask.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match logits "
                         f"{tuple(logits.shape)}[:-1]")
    vocab = logits.shape[-1]
    flat = (logits.detach() if detach else logits).reshape(-1, vocab)
    rows = mask.reshape(-1).to(flat.device).bool().nonzero().squeeze(1)
    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    chunk = chunk_tokens or max(1, DEFAULT_CHUNK_ELEMENTS // vocab)
    with torch.autocast(device_type=flat.device.type, enabled=False):
        for start in range(0, rows.numel(), chunk):
            z = flat.index_select(0, rows[start:start + chunk]).float()
            if temperature != 1.0:
                z = z / temperature
            log_norm = torch.logsumexp(z, dim=-1)
            probs = torch.exp(z - log_norm[:, None])
            total = total + (log_norm - (probs * z).sum(-1)).sum()
    return total, int(rows.numel())
