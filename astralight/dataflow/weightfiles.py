"""The files behind the weight store's HTTP face: ``state_dir/weights/{model_id}/{version}/{name}``.

Uploads are streamed into a hidden temporary file in the target folder
(``.{name}.{32 hex}.tmp``, a new one per upload), hashed on the way, then fsynced and renamed into
place, so a file either exists whole or not at all. A crash (``kill -9``) in the middle leaves only
that hidden ``.tmp``; no later upload touches it (each has its own name), and
:meth:`WeightFiles.purge_temp` removes every such file when the service starts (no upload can be
in flight then). Publication re-checks each file's sha256; the hash computed during upload is
remembered (keyed by size and mtime) so a publish does not read gigabytes again.

File names are one path component of at most :data:`MAX_FILE_NAME_BYTES` UTF-8 bytes (the file
system's 255-byte limit less the temporary name's 38 extra bytes), with no control characters
(:func:`check_file_name`). Every file system error on the upload and publish paths becomes a
:class:`ServiceError` (:func:`fs_error`): 422 naming the field for what the request caused (a
name the file system refuses), 507 naming the weight store for a full volume or one that cannot
be read or written; never an unhandled ``OSError`` (a 500, after which the server also dropped
the kept-alive connection).

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
import unicodedata
import uuid
from pathlib import Path
from typing import AsyncIterator

from astralight.atomic_files import fsync_path
from astralight.dataflow.errors import ServiceError

_CHUNK = 1 << 20
#: errors that mean "the volume is full" (no space, or the user's quota)
_FULL = {errno.ENOSPC, errno.EDQUOT}
#: errors a request's file name causes (too long, or characters the file system refuses)
_BAD_NAME = {errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ}
#: the longest file name (one path component) common Linux file systems store, in bytes
NAME_MAX = 255
#: bytes the temporary upload name ``.{name}.{32 hex}.tmp`` adds to ``name``
TEMP_NAME_EXTRA = len(".") + len(".") + 32 + len(".tmp")
#: the longest weight file name, in UTF-8 bytes: its temporary name must fit NAME_MAX too
MAX_FILE_NAME_BYTES = NAME_MAX - TEMP_NAME_EXTRA


def _disk_full(root: Path, exc: OSError) -> ServiceError:
    """507 Insufficient Storage naming the weight store, for an upload that hit a full disk."""
    return ServiceError(507, "disk", f"weight store {root} is full ({exc.strerror}); the upload was "
                                     "discarded: free space on that volume (or lower "
                                     "weights_keep_s) and upload again")


def fs_error(root: Path, exc: OSError, field: str, name: str | None = None) -> ServiceError:
    """The :class:`ServiceError` for a file system error on a weight file route.

    A name the file system refuses (too long, invalid characters: ``_BAD_NAME``) is the request's
    fault: 422 naming ``field``. A full volume is 507 (:func:`_disk_full`). Anything else (a
    read-only or unreadable store, an I/O error) is the store's fault, not the request's: 507
    naming the weight store, with the error, so the operator can fix the volume.
    """
    if exc.errno in _BAD_NAME:
        return ServiceError(422, field, f"the file system refuses the weight file name "
                                        f"{(name or '')[:80]!r} ({exc.strerror}); use a plain "
                                        f"name of at most {MAX_FILE_NAME_BYTES} UTF-8 bytes such "
                                        "as 'model.safetensors'")
    if exc.errno in _FULL:
        return _disk_full(root, exc)
    return ServiceError(507, "disk", f"weight store {root} cannot store or read weight files "
                                     f"({exc.strerror or type(exc).__name__}); check that volume "
                                     "(permissions, read-only mount, disk errors) and retry")


def check_file_name(name: str, field: str = "name") -> str:
    """A weight file name is one path component: no separators, no leading dot (hidden names are
    the store's own: temporary uploads, trash), no control characters (they would end up in
    file names and log lines), at most :data:`MAX_FILE_NAME_BYTES` bytes of UTF-8 (so that its
    temporary upload name fits the file system's ``NAME_MAX``). Raises 422 naming ``field``."""
    fix = "use one plain file name such as 'model.safetensors'"
    if not isinstance(name, str) or not name:
        raise ServiceError(422, field, f"bad weight file name {name!r}: {fix}")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates
        raise ServiceError(422, field, f"bad weight file name {name[:80]!r}: not valid UTF-8; "
                                       f"{fix}") from None
    if size > MAX_FILE_NAME_BYTES:
        raise ServiceError(422, field, f"weight file name of {size} bytes exceeds "
                                       f"{MAX_FILE_NAME_BYTES} bytes (UTF-8; the file system "
                                       f"allows {NAME_MAX} and an upload's temporary name adds "
                                       f"{TEMP_NAME_EXTRA}): {fix}")
    if "/" in name or "\\" in name or name.startswith("."):
        raise ServiceError(422, field, f"bad weight file name {name[:80]!r}: no '/', '\\' or "
                                       f"leading '.'; {fix}")
    if any(unicodedata.category(ch) == "Cc" for ch in name):
        raise ServiceError(422, field, f"bad weight file name {name[:80]!r}: control characters "
                                       f"(newline, NUL, ...) are not allowed; {fix}")
    return name


class WeightFiles:
    """Weight files on local disk under ``root``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._hashes: dict[Path, tuple[int, int, str]] = {}  # path -> (size, mtime_ns, sha256)

    def path(self, model_id: str, version: int, name: str, field: str = "name") -> Path:
        """Where a weight file lives; refused (409 naming ``field``) when any part of it below
        the store's root is a symbolic link (:meth:`no_links`)."""
        return self.no_links(self.root / model_id / str(int(version)) / check_file_name(name, field),
                             field)

    def no_links(self, path: Path, field: str) -> Path:
        """``path`` unless a folder or file of it below the root is a symbolic link: a link
        planted in the state folder would make uploads write, and downloads read, outside it.
        The store never creates one, so one found there is refused, not followed."""
        here = self.root
        for part in path.relative_to(self.root).parts:
            here = here / part
            try:
                link = here.is_symlink()
            except OSError:  # unreadable or a name the file system refuses: the operation on
                break        # the path then fails with its own error (fs_error names it)
            if link:
                raise ServiceError(409, field, f"{here} is a symbolic link inside the weight "
                                               f"store {self.root}: the dataflow never follows "
                                               "one; remove it from the state folder")
        return path

    async def receive(self, model_id: str, version: int, name: str, chunks: AsyncIterator[bytes],
                      limit: int) -> tuple[Path, str, int]:
        """Stream ``chunks`` into a temp file next to the target; returns (temp, sha256, bytes).

        Raises ServiceError 413 (and removes the temp file) once more than ``limit`` bytes arrive.
        A file system error removes the temp file and raises :func:`fs_error`'s ServiceError: 422
        naming ``name`` for a name the file system refuses, 507 naming the store for a full
        volume (``ENOSPC``, ``EDQUOT``) or any other failure of the store.
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
            self._unlink_quietly(tmp)
            raise fs_error(self.root, exc, "name", name) from exc
        except BaseException:
            self._unlink_quietly(tmp)
            raise
        return tmp, digest.hexdigest(), size

    @staticmethod
    def _unlink_quietly(path: Path) -> None:
        """Remove a temporary file, never raising (its name may be what the file system refused)."""
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass

    def fsync(self, tmp: Path) -> None:
        """Flush an uploaded temp file to disk (slow for big files: call it off the event loop).
        A file system error (a full volume: some file systems report it only now) removes the
        file and raises :func:`fs_error`'s ServiceError (507)."""
        try:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        except OSError as exc:
            self._unlink_quietly(tmp)
            raise fs_error(self.root, exc, "name", tmp.name) from exc

    def commit(self, tmp: Path, model_id: str, version: int, name: str, sha256: str) -> None:
        """Atomically move an fsynced temp file into place (rename + directory fsync); a file
        system error removes the temp file and raises :func:`fs_error`'s ServiceError."""
        final = self.path(model_id, version, name)
        try:
            os.replace(tmp, final)
            fsync_path(final.parent)
            st = final.stat()
        except OSError as exc:
            self._unlink_quietly(tmp)
            raise fs_error(self.root, exc, "name", name) from exc
        self._hashes[final] = (st.st_size, st.st_mtime_ns, sha256)

    def discard(self, tmp: Path) -> None:
        self._unlink_quietly(tmp)

    def sha256(self, model_id: str, version: int, name: str,
               field: str = "name") -> tuple[str, int] | None:
        """(sha256, size) of a stored file, or None if it was never uploaded. A bad name or a
        file system error raises a ServiceError naming ``field`` (:func:`fs_error`)."""
        path = self.path(model_id, version, name, field)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise fs_error(self.root, exc, field, name) from exc
        cached = self._hashes.get(path)
        if cached and cached[:2] == (st.st_size, st.st_mtime_ns):
            return cached[2], st.st_size
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                while block := f.read(_CHUNK):
                    digest.update(block)
        except OSError as exc:
            raise fs_error(self.root, exc, field, name) from exc
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

    def purge_temp(self) -> int:
        """Remove the temporary files of uploads a crash interrupted (hidden ``*.tmp`` files in
        version folders; weight file names never start with a dot, so every hidden file there
        is the store's own); returns how many. Call it only when no upload is in flight: the
        service does at start, before it answers any request."""
        found = 0
        for path in self.root.glob("*/*/.*.tmp"):
            if path.parent.name.isdigit() and path.is_file():
                try:
                    path.unlink()
                    found += 1
                except FileNotFoundError:
                    pass
        return found
