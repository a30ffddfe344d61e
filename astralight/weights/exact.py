"""Full-precision (float32) publication through the bf16 weight pipeline: each float32 tensor
travels as two 16-bit halves.

Why: a version is published as bf16 bit patterns (full safetensors or bit-diff deltas), so an
engine samples from weights rounded to 8 mantissa bits; an optimizer update smaller than about
2^-8 of a weight's magnitude is rounded away until updates add up past the next bf16 value, and
the engine's policy differs from the trainer's. ``WeightPublisher(precision="fp32")`` publishes
the trainer's float32 weights exactly instead (a float32 engine then samples from the very
weights the trainer holds).

How: the 32 bits of a float32 value are its upper 16 bits -- the bf16 value truncated, not
rounded -- and its lower 16 bits. :func:`split_fp32` publishes the upper half under the tensor's
own name and the lower half under ``name + LO_SUFFIX``, both as bf16-typed bit patterns, so the
delta codec, the manifests, the checksums and the shared-memory slots move them unchanged (a
delta holds the elements whose upper or lower half changed). A receiver rebuilds the float32
tensor with :func:`join_fp32` before it reaches the engine; a tensor without a lower half
passes through as bf16. The lower halves are bit patterns, not numbers: nothing may compute
with them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

#: the name of a tensor's lower 16 bits (``"model.norm.weight" + LO_SUFFIX``)
LO_SUFFIX = "::fp32_lo"
#: the precisions a publisher can publish in
PRECISIONS = ("bf16", "fp32")


def is_low_half(name: str) -> bool:
    return name.endswith(LO_SUFFIX)


def split_fp32(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``{name: upper half, name + LO_SUFFIX: lower half}`` for every floating tensor, as bf16
    tensors whose bit patterns are the float32 value's 16-bit halves (CPU copies, exact)."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if is_low_half(name):
            raise ValueError(f"{name}: a tensor name may not end with {LO_SUFFIX!r} (reserved "
                             "for the lower halves of float32 publication)")
        if not t.is_floating_point():
            out[name] = t
            continue
        bits = t.detach().to(device="cpu", dtype=torch.float32).contiguous().view(torch.int32)
        hi = torch.bitwise_right_shift(bits, 16).to(torch.int16)  # in [-2^15, 2^15): exact
        lo = torch.bitwise_and(bits, 0xFFFF)
        lo = torch.where(lo >= 0x8000, lo - 0x10000, lo).to(torch.int16)  # same 16 bits, signed
        out[name] = hi.view(torch.bfloat16)
        out[name + LO_SUFFIX] = lo.view(torch.bfloat16)
    return out


def join_fp32(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of :func:`split_fp32`: every tensor with its lower half present becomes the
    float32 tensor of both halves; the others are returned as they are. A lower half without
    its upper half is an error (it is no weight on its own)."""
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if is_low_half(name):
            if name[: -len(LO_SUFFIX)] not in tensors:
                raise ValueError(f"{name}: the lower half of a float32 tensor came without its "
                                 "upper half")
            continue
        lo = tensors.get(name + LO_SUFFIX)
        if lo is None:
            out[name] = t
            continue
        if lo.shape != t.shape:
            raise ValueError(f"{name}: upper half {tuple(t.shape)} and lower half "
                             f"{tuple(lo.shape)} differ in shape")
        hi_bits = t.contiguous().view(torch.int16).to(torch.int32)
        lo_bits = torch.bitwise_and(lo.contiguous().view(torch.int16).to(torch.int32), 0xFFFF)
        out[name] = torch.bitwise_or(torch.bitwise_left_shift(hi_bits, 16),
                                     lo_bits).view(torch.float32)
    return out


def weight_names(names: Iterable[str]) -> list[str]:
    """The names of the weights themselves: ``names`` without the lower halves (order kept)."""
    return [n for n in names if not is_low_half(n)]


def with_low_halves(names: Iterable[str], available: Mapping[str, object]) -> list[str]:
    """``names`` plus the lower half of each that ``available`` holds (what :func:`join_fp32`
    needs to rebuild them)."""
    out = []
    for n in names:
        out.append(n)
        if n + LO_SUFFIX in available:
            out.append(n + LO_SUFFIX)
    return out


__all__ = ["LO_SUFFIX", "PRECISIONS", "is_low_half", "split_fp32", "join_fp32", "weight_names",
           "with_low_halves"]
