"""Files that are whole or absent after a crash: write a temp file beside the target, fsync it,
rename it over the target, fsync the folder.

Why beside the target: ``os.replace`` is atomic only within one file system, and a temp file in
the system temp folder may be on another (a tmpfs ``/tmp``, a mounted run folder). Why the
folder fsync: until it, a machine crash may lose the rename itself. Used for checkpoints
(:mod:`astralight.trainer.checkpoint_io`) and the launcher's run-folder files
(:mod:`astralight.launch.state`); standard library only, so the launcher imports it without
Lightning.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def fsync_path(path: Path | str) -> None:
    """fsync a file or a folder by path (opened read-only: Linux syncs through any descriptor);
    on a folder, its renames and new entries then survive a machine crash."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder: fsync, rename, fsync dir.
    Temp files of writers killed mid-write (``.NAME.tmp-*``) are removed after the rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        stale.unlink(missing_ok=True)


__all__ = ["fsync_path", "fsync_dir", "atomic_write_bytes"]
