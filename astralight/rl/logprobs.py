"""Token log-probabilities of given targets under a causal LM, at a sampling temperature.

The behaviour log-probs that come back from the RaaS are vLLM's *processed* log-probs: the
log-softmax of ``logits / temperature``. The trainer must compute the same quantity for its own
policy, or every importance ratio is off by the temperature. ``log_softmax`` of the full
``[B, T, V]`` logits would materialise a second vocabulary-sized tensor; here each chunk of tokens
takes ``gather(target) - logsumexp`` in float32, so only the chunk is ever upcast.

Memory for the backward pass: autograd would keep every chunk's float32 upcast alive until the
backward (``logsumexp`` saves its input): the whole ``[N, V]`` in float32, twice the bf16 logits
(16k tokens x Qwen3's 151,936 vocabulary = 9.7 GB per sequence). :class:`_TokenLogprobs` saves
only the logits as they came (bf16 under ``bf16-mixed``) and the per-token log-normaliser, and
computes the gradient ``(onehot(target) - softmax(z / T)) / T`` chunk by chunk in the backward.
"""

from __future__ import annotations

import inspect

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
    flat_targets = targets.reshape(-1).long().to(flat_logits.device)
    chunk = chunk_tokens or max(1, DEFAULT_CHUNK_ELEMENTS // vocab)
    out = _TokenLogprobs.apply(flat_logits, flat_targets, float(temperature), int(chunk))
    return out.view(targets.shape)


class _TokenLogprobs(torch.autograd.Function):
    """``log softmax(z / T)[target]`` over ``[N, V]`` logits, chunk by chunk, float32 out.

    Saved for the backward: the logits themselves (no copy), the targets and the per-token
    ``logsumexp(z / T)`` -- not the float32 upcasts (see the module docstring)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk: int) -> Tensor:
        n = targets.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        with _fp32(logits):
            for start in range(0, n, chunk):
                end = min(n, start + chunk)
                part = _scaled(logits[start:end], temperature)
                lse[start:end] = torch.logsumexp(part, dim=-1)
                picked = part.gather(-1, targets[start:end, None]).squeeze(-1)
                out[start:end] = picked - lse[start:end]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, targets, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        t, n = ctx.temperature, targets.shape[0]
        grad = torch.empty_like(logits)
        with _fp32(logits):
            for start in range(0, n, ctx.chunk):
                end = min(n, start + ctx.chunk)
                g = grad_out[start:end].float()[:, None]
                # d/dz_j (z_target / T - lse(z / T)) = (onehot_j - softmax_j(z / T)) / T
                part = torch.exp(_scaled(logits[start:end], t) - lse[start:end, None]).mul_(-g)
                part.scatter_add_(-1, targets[start:end, None], g)
                if t != 1.0:
                    part.div_(t)
                grad[start:end] = part
        return grad, None, None, None


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    part = logits.float()
    return part / temperature if temperature != 1.0 else part


def _fp32(t: Tensor):
    """Autocast off: the chunks are computed in float32 whatever the trainer's precision."""
    return torch.autocast(device_type=t.device.type, enabled=False)


def first_trained_target(mask: Tensor | None) -> int:
    """The first target position (column of a ``[B, T-1]`` mask) that any row trains; 0 when
    there is no mask or it is empty. Every column before it is prompt (or padding) in every
    row, so no log-prob there is ever read."""
    if mask is None or mask.numel() == 0:
        return 0
    cols = mask.bool().any(dim=0).nonzero()
    return int(cols[0]) if cols.numel() else 0


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the model under a PEFT wrapper) takes transformers'
    ``logits_to_keep`` argument (every recent ``*ForCausalLM`` does)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False


def causal_lm_next_logits(model: torch.nn.Module, input_ids: Tensor,
                          attention_mask: Tensor | None = None,
                          first: int = 0) -> tuple[Tensor, int]:
    """Next-token logits under a Hugging Face causal LM, from target position ``first`` on:
    ``(logits [B, T-1-start, V], start)``, where row ``[:, t]`` predicts
    ``input_ids[:, start + t + 1]``.

    ``start`` is ``first`` when the model takes ``logits_to_keep`` and ``first`` is not 0, else
    0. The output projection and its log-softmax over the vocabulary are then computed only
    from the first trained position on: with a real vocabulary (SmolLM2's 49,152, Qwen3's
    151,936) and a prompt longer than the reply, that is most of the projection's cost and
    memory, and none of it is read (:func:`first_trained_target`).
    """
    seq = input_ids.shape[1]
    start = first if 0 < first < seq - 1 and accepts_logits_to_keep(model) else 0
    kwargs = {"logits_to_keep": seq - start} if start else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, :-1], start


def pad_to_targets(logp: Tensor, start: int) -> Tensor:
    """``[B, T-1-start]`` log-probs from :func:`causal_lm_next_logits` back to the full
    ``[B, T-1]`` target grid, 0 at the ``start`` untrained positions before them."""
    return torch.nn.functional.pad(logp, (start, 0)) if start else logp


def causal_lm_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    first: int = 0,
) -> Tensor:
    """Log-prob of each next token under a Hugging Face causal LM: shape ``[B, T-1]``.

    Entry ``[:, t]`` is the log-prob of ``input_ids[:, t + 1]`` given the prefix, so it lines up
    with ``input_ids[:, 1:]`` and with every ``[:, 1:]``-shifted mask of the trainer batch.
    With ``first`` (:func:`first_trained_target` of that mask) the entries before it may be 0:
    they are computed only where the model lets the output projection skip them.
    """
    logits, start = causal_lm_next_logits(model, input_ids, attention_mask, first)
    logp = token_logprobs(logits, input_ids[:, start + 1:], temperature, chunk_tokens)
    return pad_to_targets(logp, start)
