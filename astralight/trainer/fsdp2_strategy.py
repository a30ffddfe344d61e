"""``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` for astralight policies, with
distributed checkpoints that are whole or absent, even after kill -9.

Why: ``ModelParallelStrategy`` writes a distributed (``torch.distributed.checkpoint``) checkpoint
*in place* -- into the existing ``last.ckpt/`` folder, shard file by shard file, then ``meta.pt``.
A trainer killed during that save leaves a folder mixing two steps (or missing ``meta.pt``), and
the next ``--ckpt_path last`` loads torn state or fails. For a 14B policy a save takes long
enough for preemption to land in it.

What this strategy does instead (rank zero does the file-system steps, every rank writes its
shards):

1. every rank writes the checkpoint into a new folder next to the target,
   ``NAME.d-<token>`` (the token broadcast from rank zero, so all ranks write the same folder);
2. after a barrier, rank zero fsyncs every file of it and the folder;
3. rank zero points ``NAME`` at it through a symbolic link made under a temporary name and
   ``os.replace``d over ``NAME`` (atomic on one file system), fsyncs the parent folder, and only
   then removes the folder ``NAME`` pointed at before and any ``NAME.d-*`` left by a save that
   was killed.

A kill at any point leaves ``NAME`` pointing at the previous complete checkpoint (or at the new
one), never at a partial folder. Lightning loads through the link like any folder
(``ckpt_path="last"`` finds ``last.ckpt``), and the link is relative, so a run folder can move.
``remove_checkpoint`` removes a link and its folder together.

Defaults suit a data-parallel FSDP2 policy: ``data_parallel_size="auto"`` (every GPU of the
trainer), ``tensor_parallel_size=1`` (astralight's policies do not implement tensor
parallelism). With ``save_distributed_checkpoint=False`` the strategy writes one file and
:class:`astralight.trainer.checkpoint_io.AtomicCheckpointIO` makes that atomic as for unsharded trainers.

``astralight fit`` (:func:`astralight.trainer.checkpoint_io.install`) upgrades a plain
``ModelParallelStrategy`` to this class in place: it adds no state of its own, only the two
checkpoint methods.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from astralight.atomic_files import fsync_dir as _fsync  # (open read-only + fsync: files too)

log = logging.getLogger(__name__)

#: how a checkpoint's own folder is named next to its link: ``last.ckpt.d-1a2b3c4d5e6f``
FOLDER_INFIX = ".d-"


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder (deepest first), then ``root``."""
    folders = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync(Path(dirpath) / name)
        folders.append(Path(dirpath))
    for folder in reversed(folders):
        _fsync(folder)


def point_link(link: Path, folder: Path) -> None:
    """Make ``link`` a relative symbolic link to ``folder`` (a sibling) atomically, then remove
    what it replaced: the folder it pointed at before, a plain file or folder of that name (a
    checkpoint written before this strategy: moved aside first, the one non-atomic step, once),
    and folders of killed saves (``NAME.d-*`` not pointed at)."""
    parent = link.parent
    previous = None
    if link.is_symlink():
        previous = parent / os.readlink(link)
    elif link.exists():  # written in place by a plain ModelParallelStrategy or TorchCheckpointIO
        aside = parent / f".{link.name}.replaced-{uuid.uuid4().hex[:8]}"
        os.rename(link, aside)
        previous = aside
    tmp = parent / f".{link.name}.link-{uuid.uuid4().hex[:8]}"
    os.symlink(folder.name, tmp)
    os.replace(tmp, link)
    _fsync(parent)
    if previous is not None and previous.resolve() != folder.resolve():
        _remove(previous)
    for stale in parent.glob(f"{link.name}{FOLDER_INFIX}*"):
        if stale.resolve() != folder.resolve():
            _remove(stale)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with atomic distributed checkpoints (see the module docstring).

    Args: as ``ModelParallelStrategy``, with ``data_parallel_size="auto"`` and
    ``tensor_parallel_size=1`` by default. ``"auto"`` data parallelism here means every process
    of the trainer (``num_nodes x devices / tensor_parallel_size``): Lightning's own ``"auto"``
    means ``num_nodes`` (it assumes tensor parallelism inside a node), which with
    ``tensor_parallel_size=1`` fails its world-size check on any multi-GPU trainer.
    """

    def __init__(self, data_parallel_size: Any = "auto", tensor_parallel_size: Any = 1,
                 **kwargs: Any) -> None:
        super().__init__(data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tensor_parallel_size, **kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto" and self._tensor_parallel_size != "auto":
            world = self.num_nodes * self.num_processes
            tp = int(self._tensor_parallel_size)
            if tp < 1 or world % tp:
                raise ValueError(
                    f"trainer.strategy.tensor_parallel_size: {tp} does not divide the trainer's "
                    f"{world} processes (num_nodes x devices); astralight's policies use 1")
            self._data_parallel_size = world // tp
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        if not self._save_distributed_checkpoint or "://" in str(filepath):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        link = Path(self.broadcast(str(filepath)))
        token = self.broadcast(uuid.uuid4().hex[:12])
        folder = link.with_name(f"{link.name}{FOLDER_INFIX}{token}")
        super().save_checkpoint(checkpoint, folder, storage_options)
        self.barrier("astralight_checkpoint_written")
        if self.is_global_zero:
            fsync_tree(folder)
            point_link(link, folder)
        self.barrier("astralight_checkpoint_linked")

    def remove_checkpoint(self, filepath: Any) -> None:
        path = Path(str(filepath))
        if self.is_global_zero and path.is_symlink():
            target = path.parent / os.readlink(path)
            path.unlink()
            _remove(target)
            return
        super().remove_checkpoint(filepath)


def upgrade(strategy: Any) -> bool:
    """Turn a plain ``ModelParallelStrategy`` into :class:`FSDP2Strategy` in place (it adds no
    state, only checkpoint methods); returns whether it did."""
    if type(strategy) is ModelParallelStrategy:
        strategy.__class__ = FSDP2Strategy
        return True
    return False


__all__ = ["FSDP2Strategy", "fsync_tree", "point_link", "upgrade", "FOLDER_INFIX"]
