"""The files behind the weight store's HTTP face: ``state_dir/weights/{model_id}/{version}/{name}``.

Uploads are streamed into a temporary file in the target folder, hashed on the way, then fsynced
and renamed into place, so a file either exists whole or not at all (a crash leaves only a ``.tmp``
that the next upload of the same name replaces). Publication re-checks each file's sha256; the
hash computed during upload is remembered (keyed by size and mtime) so a publish does not read
gigabytes again.

Garbage collection (decided by the service core, see ``Dataflow.gc_weights``) removes a version
folder in two steps: an atomic rename to a hidden ``.trash-*`` name (the version is gone for every
reader at once), then a ``rmtree`` outside the service lock. A crash in between leaves a trash
folder that :meth:`WeightFiles.purge_trash` removes at the next start.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import AsyncIterator

from astralight.dataflow.errors import ServiceError

_CHUNK = 1 << 20
#: errors that mean "the volume is full" (no space, or the user's quota)
_FULL = {errno.ENOSPC, errno.EDQUOT}


def _disk_full(root: Path, exc: OSError) -> ServiceError:
    """507 Insufficient Storage naming the weight store, for an upload that hit a full disk."""
    return ServiceError(507, "disk", f"weight store {root} is full ({exc.strerror}); the upload was "
                                     "discarded: free space on that volume (or lower "
                                     "weights_keep_s) and upload again")


def check_file_name(name: str, field: str = "name") -> str:
    """A weight file name is one path component: no separators, no leading dot, no NUL."""
    if (not isinstance(name, str) or not name or len(name) > 255 or "/" in name or "\\" in name
            or "\x00" in name or name.startswith(".")):
        raise ServiceError(422, field, f"bad weight file name {name!r}: use one plain file name "
                                       "such as 'model.safetensors'")
    return name


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WeightFiles:
    """Weight files on local disk under ``root``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._hashes: dict[Path, tuple[int, int, str]] = {}  # path -> (size, mtime_ns, sha256)

    def path(self, model_id: str, version: int, name: str) -> Path:
        return self.root / model_id / str(int(version)) / check_file_name(name)

    async def receive(self, model_id: str, version: int, name: str, chunks: AsyncIterator[bytes],
                      limit: int) -> tuple[Path, str, int]:
        """Stream ``chunks`` into a temp file next to the target; returns (temp, sha256, bytes).

        Raises ServiceError 413 (and removes the temp file) once more than ``limit`` bytes arrive.
        A full volume (``ENOSPC``, ``EDQUOT``) raises ServiceError 507 naming the store.
        """
        final = self.path(model_id, version, name)
        tmp = final.parent / f".{name}.{uuid.uuid4().hex}.tmp"
        digest, size = hashlib.sha256(), 0
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise ServiceError(413, "body", f"weight file exceeds max_weight_file_bytes="
                                                        f"{limit}; raise it in the dataflow config")
                    digest.update(chunk)
                    f.write(chunk)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in _FULL:
                raise _disk_full(self.root, exc) from exc
            raise
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, digest.hexdigest(), size

    def fsync(self, tmp: Path) -> None:
        """Flush an uploaded temp file to disk (slow for big files: call it off the event loop).
        A full volume (some file systems report it only now) removes the file and raises 507."""
        try:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        except OSError as exc:
            if exc.errno in _FULL:
                tmp.unlink(missing_ok=True)
                raise _disk_full(self.root, exc) from exc
            raise

    def commit(self, tmp: Path, model_id: str, version: int, name: str, sha256: str) -> None:
        """Atomically move an fsynced temp file into place (rename + directory fsync)."""
        final = self.path(model_id, version, name)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        st = final.stat()
        self._hashes[final] = (st.st_size, st.st_mtime_ns, sha256)

    def discard(self, tmp: Path) -> None:
        tmp.unlink(missing_ok=True)

    def sha256(self, model_id: str, version: int, name: str) -> tuple[str, int] | None:
        """(sha256, size) of a stored file, or None if it was never uploaded."""
        path = self.path(model_id, version, name)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        cached = self._hashes.get(path)
        if cached and cached[:2] == (st.st_size, st.st_mtime_ns):
            return cached[2], st.st_size
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                digest.update(block)
        self._hashes[path] = (st.st_size, st.st_mtime_ns, digest.hexdigest())
        return digest.hexdigest(), st.st_size

    # ------------------------------------------------------------------ garbage collection

    def stored_versions(self, model_id: str) -> list[int]:
        """Versions with a folder on disk (published or not), ascending."""
        d = self.root / model_id
        if not d.is_dir():
            return []
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir())

    def detach(self, model_id: str, version: int) -> Path | None:
        """Atomically move a version folder out of sight; returns the trash path to
        :meth:`purge` (outside any lock), or None if there was no folder."""
        src = self.root / model_id / str(int(version))
        trash = src.parent / f".trash-{int(version)}-{uuid.uuid4().hex}"
        try:
            os.rename(src, trash)
        except FileNotFoundError:
            return None
        for path in [p for p in self._hashes if p.parent == src]:
            del self._hashes[path]
        return trash

    @staticmethod
    def purge(paths: list[Path]) -> None:
        """Delete detached folders (slow for big files: call it off the event loop)."""
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)

    def purge_trash(self) -> int:
        """Remove trash folders an interrupted collection left behind; returns how many."""
        found = [p for p in self.root.glob("*/.trash-*") if p.is_dir()]
        self.purge(found)
        return len(found)
