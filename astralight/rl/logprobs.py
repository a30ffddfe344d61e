"""Token log-probabilities of given targets under a causal LM, at a sampling temperature.

The behaviour log-probs that come back from the RaaS are vLLM's *processed* log-probs: the
log-softmax of ``logits / temperature``. The trainer must compute the same quantity for its own
policy, or every importance ratio is off by the temperature. ``log_softmax`` of the full
``[B, T, V]`` logits would materialise a second vocabulary-sized tensor; here each chunk of tokens
takes ``gather(target) - logsumexp`` in float32, so only the chunk is ever upcast.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: float32 elements upcast at once (64 MiB); bounds the temporary memory of one chunk.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> Tensor:
    """``log softmax(logits / temperature)[..., targets]`` as float32, shape of ``targets``.

    ``logits`` is ``[..., V]`` (any dtype; computed in float32), ``targets`` ``[...]`` of ids.
    ``chunk_tokens`` is how many token positions are processed at once (default: enough for
    ``DEFAULT_CHUNK_ELEMENTS`` logits). Differentiable.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets: shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}[:-1]"
        )
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_targets = targets.reshape(-1).long()
    n = flat_targets.shape[0]
    chunk = chunk_tokens or max(1, DEFAULT_CHUNK_ELEMENTS // vocab)
    pieces = []
    for start in range(0, n, chunk):
        part = flat_logits[start:start + chunk].float()
        if temperature != 1.0:
            part = part / temperature
        picked = part.gather(-1, flat_targets[start:start + chunk, None]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(part, dim=-1))
    out = torch.cat(pieces) if pieces else flat_logits.new_zeros(0, dtype=torch.float32)
    return out.view(targets.shape)


def causal_lm_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> Tensor:
    """Log-prob of each next token under a Hugging Face causal LM: shape ``[B, T-1]``.

    Entry ``[:, t]`` is the log-prob of ``input_ids[:, t + 1]`` given the prefix, so it lines up
    with ``input_ids[:, 1:]`` and with every ``[:, 1:]``-shifted mask of the trainer batch.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature, chunk_tokens)
