"""bf16 tensors as 16-bit patterns: the unit the weight interface versions, diffs and checksums.

Why bit patterns: a RaaS must rebuild *exactly* the bf16 values the trainer cast (rule 5 of
astralight/ARCHITECTURE.md), including NaN payloads and the sign of zero. Comparing and hashing
``uint16`` views is exact, fast, and needs no bf16 support in numpy. Everything here is zero-copy
where the input allows it (a contiguous CPU bf16 tensor becomes a ``uint16`` view of the same
memory).

Checksums are SHA-256 over the little-endian bytes of the C-ordered bf16 array, the same bytes a
safetensors file stores, so a checksum can be checked against either a tensor or a file slice.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping

import numpy as np
import torch

#: the dtype string written in manifests (``WeightManifest.tensors[name]["dtype"]``).
BF16 = "bfloat16"
_LE = sys.byteorder == "little"


def _c_contiguous(arr: np.ndarray) -> np.ndarray:
    """C-contiguous without copying when already so (unlike np.ascontiguousarray, keeps 0-d)."""
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def to_bf16_bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """Return the bf16 bit patterns of ``t`` as a C-contiguous ``uint16`` array of ``t``'s shape.

    A contiguous CPU bf16 tensor is viewed without copying (the result shares its memory: copy it
    if you keep it while the tensor changes). Other float dtypes are cast with torch's
    round-to-nearest-even, the cast a trainer publishing bf16 weights performs. A ``uint16`` numpy
    array is taken to already hold bit patterns and is returned as is (made contiguous).
    """
    if isinstance(t, np.ndarray):
        if t.dtype != np.uint16:
            raise TypeError(f"expected bf16 bit patterns as uint16, got a numpy {t.dtype} array")
        return _c_contiguous(t)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or uint16 array, got {type(t).__name__}")
    t = t.detach()
    if t.dtype != torch.bfloat16:
        if not t.dtype.is_floating_point:
            raise TypeError(f"cannot publish a {t.dtype} tensor as bf16 weights")
        t = t.to(torch.bfloat16)
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.view(torch.int16).numpy().view(np.uint16)


def bits_to_tensor(bits: np.ndarray, shape: tuple[int, ...] | list[int] | None = None) -> torch.Tensor:
    """Return a bf16 CPU tensor holding ``bits`` (``uint16`` patterns), sharing memory if possible.

    Read-only arrays (e.g. from ``np.frombuffer`` on ``bytes``) are copied, because torch tensors
    are writable and must not alias memory nobody may write.
    """
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"expected uint16 bit patterns, got {bits.dtype}")
    if shape is not None:
        bits = bits.reshape(tuple(shape))
    bits = _c_contiguous(bits)
    if not bits.flags.writeable:
        bits = bits.copy()
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def state_to_bits(state: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, np.ndarray]:
    """Apply :func:`to_bf16_bits` to every tensor of a state dict (names and order kept)."""
    return {name: to_bf16_bits(t) for name, t in state.items()}


def tensor_checksum(bits: np.ndarray | torch.Tensor) -> str:
    """SHA-256 (hex) of the little-endian bf16 bytes of a tensor in C order.

    Accepts bit patterns (``uint16``) or a torch tensor (cast to bf16 first). Hashing reads the
    array's buffer directly (no copy for contiguous input) and releases the GIL, so several
    tensors can be hashed from a thread pool.
    """
    arr = to_bf16_bits(bits) if isinstance(bits, torch.Tensor) else np.asarray(bits)
    if arr.dtype != np.uint16:
        raise TypeError(f"expected uint16 bit patterns, got {arr.dtype}")
    arr = _c_contiguous(arr)
    if not _LE:  # pragma: no cover - every supported platform is little-endian
        arr = arr.byteswap()
    return hashlib.sha256(arr.reshape(-1).view(np.uint8)).hexdigest()
