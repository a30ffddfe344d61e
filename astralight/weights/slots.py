"""Snapshot slots: shared-memory files of bf16 bit patterns the trainer writes snapshots into
and the encoder process reads them from.

A slot holds every published tensor packed back to back (:func:`layout_of`); both processes map
the same anonymous ``memfd`` file (:func:`new_slot_fd`, :func:`map_slot`), so a snapshot crosses
the process boundary without a copy or pickle, and nothing is left behind if either dies.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np


def new_slot_fd(elements: int) -> int:
    """A shared-memory file of ``elements`` bf16 values, open read/write, with no name on disk
    (``memfd_create``; else an unlinked file in /dev/shm or the temp directory)."""
    size = max(2 * elements, 2)
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("astralight-weights-slot")
    else:  # pragma: no cover - non-Linux
        import tempfile

        shm = Path("/dev/shm")
        where = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        fd, path = tempfile.mkstemp(prefix="astralight-slot-", dir=where)
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


def layout_of(shapes: Mapping[str, tuple[int, ...]]) -> tuple[list[list], int]:
    """``[[name, offset, shape], ...]`` of tensors packed back to back, and the element total."""
    out, offset = [], 0
    for name, shape in shapes.items():
        out.append([name, offset, list(shape)])
        offset += int(np.prod(shape, dtype=np.int64))
    return out, offset


def map_slot(fd: int, elements: int, writable: bool) -> np.ndarray:
    """A uint16 array over a slot file descriptor (the mapping outlives the descriptor)."""
    mm = mmap.mmap(fd, max(2 * elements, 2),
                   access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    arr = np.frombuffer(mm, dtype=np.uint16, count=max(elements, 1))
    return arr if writable else arr.view()


def slot_views(buf: np.ndarray, layout: list[list]) -> dict[str, np.ndarray]:
    """Per-tensor views (no copy) of one slot."""
    out = {}
    for name, offset, shape in layout:
        n = int(np.prod(shape, dtype=np.int64))
        out[name] = buf[offset:offset + n].reshape(shape)
    return out


__all__ = ["layout_of", "map_slot", "new_slot_fd", "slot_views"]
