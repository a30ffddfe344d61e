"""``AtomicCheckpointIO``: Lightning checkpoints that are whole or absent, even after kill -9.

Why: Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction whose temporary file
lives in the system temp folder (``tempfile.mkstemp()``), then ``shutil.move``s it into place.
When the temp folder and the checkpoint folder are on different file systems (a tmpfs ``/tmp``,
a network or mounted run folder) that move is a *copy into the final path*: a trainer killed
during it leaves a torn ``last.ckpt`` that the next ``--ckpt_path last`` fails to load. Nothing
is fsynced either, so a machine crash can leave an empty file under the final name.

This plugin writes the serialized checkpoint to a hidden temp file *in the checkpoint's own
folder*, fsyncs it, ``os.replace``s it over the target (atomic on one file system) and fsyncs
the folder. A writer killed at any point leaves the previous checkpoint intact plus at most a
``.NAME.tmp-*`` file, which the next save of that name removes. Remote paths (``s3://`` ...)
are left to Lightning's own implementation.

``astralight fit`` installs it unless the config names a checkpoint IO plugin of its own.

Sharded trainers (``ModelParallelStrategy``, FSDP2) do not go through a CheckpointIO: with its
default ``save_distributed_checkpoint=True`` the strategy writes ``last.ckpt`` as a
``torch.distributed.checkpoint`` *folder* (one shard file per rank plus ``meta.pt`` with the
loops', callbacks' -- publisher, datamodule -- and module's other state), and ``--ckpt_path last``
restores it, weights and AdamW state sharded (tests/integration/test_fsdp2_fit.py). Lightning
writes that folder in place (not atomic), so :func:`install` upgrades a plain
``ModelParallelStrategy`` to :class:`astralight.trainer.fsdp2_strategy.FSDP2Strategy`, which writes each
checkpoint into a new folder and swaps a ``last.ckpt`` link to it atomically.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from astralight.atomic_files import atomic_write_bytes

log = logging.getLogger(__name__)


def _is_local(path: Any) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


def _local(path: Any) -> Path:
    text = str(path)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are write-temp, fsync, rename (see the module doc)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(_local(path), buffer.getbuffer())


def install(trainer: Any) -> bool:
    """Give ``trainer``'s strategy an :class:`AtomicCheckpointIO` unless a checkpoint IO was
    chosen (``plugins``, or the strategy's own; the plain default ``TorchCheckpointIO`` is
    replaced); returns whether it did. A plain ``ModelParallelStrategy`` also becomes
    :class:`astralight.trainer.fsdp2_strategy.FSDP2Strategy` (atomic distributed checkpoint folders)."""
    strategy = trainer.strategy
    from astralight.trainer.fsdp2_strategy import upgrade

    if upgrade(strategy):
        log.info("ModelParallelStrategy: distributed checkpoints are written atomically "
                 "(astralight.trainer.fsdp2_strategy.FSDP2Strategy)")
    current = getattr(strategy, "_checkpoint_io", None)
    if current is not None and type(current) is not TorchCheckpointIO:  # a deliberate choice
        return False
    strategy.checkpoint_io = AtomicCheckpointIO()
    return True


__all__ = ["AtomicCheckpointIO", "atomic_write_bytes", "install"]
