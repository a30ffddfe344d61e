"""A directory of published weight versions: crash-safe writes, listing, chains, and GC.

Layout::

    <directory>/<model_id>/v0000000012/{manifest.json, model.safetensors | delta.bin, ...}

A version exists exactly when its directory (with ``manifest.json``) exists. It is written in a
hidden temporary directory, every file fsynced, then renamed into place, so a crash never leaves
a half-written version visible and a reader never sees a file change. Every file is checked
against the manifest's size and SHA-256 on the way in: the store never holds data its manifest
does not vouch for. Manifests are JSON (human-readable, no pickle).

Used by the dataflow service (the weight store's HTTP face: ``stage`` each uploaded file, then
``publish`` the manifest) and by anyone who keeps versions on local disk (``put``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from astralight.protocol import ProtocolError, WeightManifest

MANIFEST = "manifest.json"
_VERSION_RE = re.compile(r"^v(\d{10})$")
_COPY_CHUNK = 8 << 20


class WeightStoreError(ValueError):
    """A store operation is refused (bad name, unknown version, conflicting content, bad file)."""


def _check_name(kind: str, name: str) -> str:
    if (not isinstance(name, str) or not name or len(name) > 200 or name.startswith(".")
            or any(c in name for c in "/\\\0") or name != name.strip()):
        raise WeightStoreError(f"{kind} {name!r} is not a safe file name (no '/', '\\', leading '.', NUL)")
    return name


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, src: bytes | bytearray | memoryview | str | os.PathLike) -> tuple[str, int]:
    """Write ``src`` (bytes or a file to copy) to ``path``, fsync it; return (sha256, size)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "wb") as out:
        if isinstance(src, (bytes, bytearray, memoryview)):
            h.update(src)
            out.write(src)
            size = len(src)
        else:
            with open(src, "rb") as inp:
                while chunk := inp.read(_COPY_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return h.hexdigest(), size


def _hash_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _check_entry(name: str, info: dict, sha: str, size: int) -> None:
    if "bytes" in info and info["bytes"] != size:
        raise WeightStoreError(f"file {name!r}: {size} bytes, manifest says {info['bytes']}")
    if info["sha256"] != sha:
        raise WeightStoreError(f"file {name!r}: sha256 does not match the manifest")


class LocalWeightStore:
    """Versions of every policy under one directory. Safe for one writer per model and any
    number of readers (processes too); ``put`` of an existing version is idempotent."""

    def __init__(self, directory: str | os.PathLike):
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ paths

    def _model_dir(self, model_id: str) -> Path:
        return self.root / _check_name("model_id", model_id)

    def version_dir(self, model_id: str, version: int) -> Path:
        if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 10**10:
            raise WeightStoreError(f"version {version!r} must be an int in [0, 1e10)")
        return self._model_dir(model_id) / f"v{version:010d}"

    def file_path(self, model_id: str, version: int, name: str) -> Path:
        """Path of one file of a stored version (raises if the version or file is unknown)."""
        m = self.manifest(model_id, version)
        if name not in m.files:
            raise WeightStoreError(f"version {version} of {model_id!r} has no file {name!r}")
        return self.version_dir(model_id, version) / name

    def files(self, model_id: str, version: int) -> dict[str, Path]:
        """``{name: path}`` of every file of a stored version (what ``WeightState.apply`` takes)."""
        m = self.manifest(model_id, version)
        d = self.version_dir(model_id, version)
        return {name: d / name for name in m.files}

    # ------------------------------------------------------------------ reading

    def model_ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def versions(self, model_id: str) -> list[int]:
        """Stored versions of ``model_id``, ascending."""
        d = self._model_dir(model_id)
        if not d.is_dir():
            return []
        out = []
        for p in d.iterdir():
            m = _VERSION_RE.match(p.name)
            if m and (p / MANIFEST).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def has(self, model_id: str, version: int) -> bool:
        return (self.version_dir(model_id, version) / MANIFEST).is_file()

    def manifest(self, model_id: str, version: int) -> WeightManifest:
        path = self.version_dir(model_id, version) / MANIFEST
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise WeightStoreError(f"version {version} of {model_id!r} is not stored") from None
        return WeightManifest.from_wire(raw)

    def latest_manifest(self, model_id: str) -> WeightManifest | None:
        vs = self.versions(model_id)
        return self.manifest(model_id, vs[-1]) if vs else None

    def chain(self, model_id: str, version: int | None = None) -> list[WeightManifest]:
        """What a newcomer applies to reach ``version`` (default: latest): the latest full
        version at or below it, then every delta after it, each onto the previous one."""
        vs = [v for v in self.versions(model_id) if version is None or v <= version]
        if not vs or (version is not None and vs[-1] != version):
            raise WeightStoreError(f"version {version if version is not None else 'any'} of {model_id!r} is not stored")
        manifests = [self.manifest(model_id, v) for v in vs]
        fulls = [i for i, m in enumerate(manifests) if m.kind == "full"]
        if not fulls:
            raise WeightStoreError(f"no full version of {model_id!r} at or below {vs[-1]}")
        chain = manifests[fulls[-1]:]
        for prev, cur in zip(chain, chain[1:]):
            if cur.base_version != prev.version:
                raise WeightStoreError(
                    f"version {cur.version} of {model_id!r} is a delta onto {cur.base_version}, "
                    f"not onto {prev.version}: the chain is broken"
                )
        return chain

    # ------------------------------------------------------------------ writing

    def _validated(self, manifest: WeightManifest) -> WeightManifest:
        try:
            m = WeightManifest.from_wire(json.loads(json.dumps(manifest.to_wire())))
        except (ProtocolError, TypeError, ValueError) as exc:
            raise WeightStoreError(f"invalid manifest: {exc}") from None
        _check_name("model_id", m.model_id)
        for name in m.files:
            if name == MANIFEST:
                raise WeightStoreError(f"a weight file may not be called {MANIFEST!r}")
            _check_name("file", name)
        self.version_dir(m.model_id, m.version)
        return m

    def _install(self, tmp: Path, manifest: WeightManifest) -> Path:
        """Write the manifest into ``tmp``, fsync, and rename it into place (or drop it if an
        identical version is already there)."""
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_wire(), indent=1, sort_keys=True))
        with open(tmp / MANIFEST, "rb+") as f:
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        final = self.version_dir(manifest.model_id, manifest.version)
        try:
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if self.has(manifest.model_id, manifest.version):
                self._same_or_raise(manifest)
                return final
            raise
        _fsync_dir(final.parent)
        return final

    def _same_or_raise(self, manifest: WeightManifest) -> None:
        old = self.manifest(manifest.model_id, manifest.version)
        if old.files != manifest.files or old.kind != manifest.kind or old.base_version != manifest.base_version:
            raise WeightStoreError(
                f"version {manifest.version} of {manifest.model_id!r} is already stored with other content"
            )

    def put(self, manifest: WeightManifest, files: Mapping[str, bytes | str | os.PathLike]) -> Path:
        """Store a version: every file of the manifest (bytes or a path to copy), checked against
        its sha256 and size, written to a temporary directory, fsynced, renamed into place.
        Storing the same version again is a no-op; with other content it raises."""
        m = self._validated(manifest)
        if self.has(m.model_id, m.version):
            self._same_or_raise(m)
            return self.version_dir(m.model_id, m.version)
        missing = sorted(set(m.files) - set(files))
        if missing:
            raise WeightStoreError(f"files {missing} of the manifest were not given")
        mdir = self._model_dir(m.model_id)
        mdir.mkdir(parents=True, exist_ok=True)
        tmp = mdir / f".tmp-v{m.version}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            for name, info in m.files.items():
                sha, size = _write_file(tmp / name, files[name])
                _check_entry(name, info, sha, size)
            return self._install(tmp, m)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _staging_dir(self, model_id: str, version: int) -> Path:
        self.version_dir(model_id, version)  # validates both
        return self._model_dir(model_id) / f".staging-v{version}"

    def stage(self, model_id: str, version: int, name: str, data: bytes) -> None:
        """Keep one uploaded file of a not yet published version (atomically replaced if sent
        again). :meth:`publish` later checks it against the manifest."""
        _check_name("file", name)
        if name == MANIFEST:
            raise WeightStoreError(f"a weight file may not be called {MANIFEST!r}")
        d = self._staging_dir(model_id, version)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.{uuid.uuid4().hex}"
        try:
            _write_file(tmp, data)
            os.replace(tmp, d / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def publish(self, manifest: WeightManifest) -> Path:
        """Make a staged version visible: every file of the manifest must have been staged with
        the listed sha256 and size (raises naming the first that was not)."""
        m = self._validated(manifest)
        if self.has(m.model_id, m.version):
            self._same_or_raise(m)
            return self.version_dir(m.model_id, m.version)
        d = self._staging_dir(m.model_id, m.version)
        d.mkdir(parents=True, exist_ok=True)
        for name, info in m.files.items():
            if not (d / name).is_file():
                raise WeightStoreError(f"file {name!r} of version {m.version} was not uploaded")
            sha, size = _hash_file(d / name)
            _check_entry(name, info, sha, size)
        for p in d.iterdir():  # drop extra uploads and stray temporaries
            if p.name not in m.files:
                p.unlink() if p.is_file() else shutil.rmtree(p, ignore_errors=True)
        return self._install(d, m)

    # ------------------------------------------------------------------ gc

    def _remove(self, path: Path) -> None:
        trash = path.parent / f".trash-{path.name}-{uuid.uuid4().hex}"
        os.rename(path, trash)  # disappears atomically, then is deleted at leisure
        shutil.rmtree(trash, ignore_errors=True)

    def gc(self, model_id: str, stale_s: float = 3600.0) -> list[int]:
        """Delete every version older than the latest full one (keeping it and the deltas
        after it: all a newcomer needs), and leftovers of interrupted writes older than
        ``stale_s`` seconds. Returns the removed versions."""
        d = self._model_dir(model_id)
        if not d.is_dir():
            return []
        removed = []
        fulls = [v for v in self.versions(model_id) if self.manifest(model_id, v).kind == "full"]
        if fulls:
            for v in self.versions(model_id):
                if v < fulls[-1]:
                    self._remove(self.version_dir(model_id, v))
                    removed.append(v)
        now = time.time()
        for p in d.iterdir():
            if p.name.startswith((".tmp-", ".trash-", ".staging-")):
                try:
                    old = now - p.stat().st_mtime > stale_s
                except FileNotFoundError:
                    continue
                if old or (p.name.startswith(".staging-v") and fulls and _staged_version(p.name) < fulls[-1]):
                    shutil.rmtree(p, ignore_errors=True)
        return removed


def _staged_version(dirname: str) -> int:
    try:
        return int(dirname[len(".staging-v"):])
    except ValueError:
        return -1
