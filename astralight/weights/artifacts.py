"""Weight artifacts: the files and :class:`~astralight.protocol.WeightManifest` of one version.

A version is published either *full* (bf16 safetensors, sharded) or as a *delta* onto exactly
``base_version`` (one blob from :mod:`astralight.weights.delta`). Either way the manifest lists
the SHA-256 and size of every file, and the dtype, shape and SHA-256 of every tensor of the
resulting state, so a receiver verifies what it *built*, not only what it downloaded.

Two small stateful helpers wrap the rules so the trainer and the RaaS need no codec knowledge:

* :class:`ArtifactBuilder` (trainer side) remembers the last *published* bf16 state and decides
  full vs delta (first version, every ``full_every`` versions, or when names/shapes change).
* :class:`WeightState` (RaaS side) holds the bf16 state of one version and applies the next
  artifact, refusing a delta onto any other base and raising on any checksum mismatch, after
  which the caller pulls a full version (astralight/ARCHITECTURE.md rule 5).

Files are passed around as ``{name: bytes | path}``; nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from astralight.protocol import WeightManifest
from astralight.weights.bf16 import BF16, bits_to_tensor, state_to_bits, tensor_checksum, to_bf16_bits
from astralight.weights.delta import DEFAULT_LEVEL, DeltaError, apply_delta, encode_delta, read_delta_header

DELTA_FILE = "delta.bin"
FULL_FILE = "model.safetensors"
#: shard size of full artifacts; below the dataflow's default max_weight_file_bytes (2 GiB).
DEFAULT_SHARD_BYTES = 1 << 30
CODEC = "bf16-delta/1"
HASH_THREADS = 2

FileSource = bytes | bytearray | memoryview | str | os.PathLike


class WeightVerificationError(ValueError):
    """A file or reconstructed tensor does not match its manifest; ``tensor``/``file`` name it."""

    def __init__(self, message: str, *, tensor: str | None = None, file: str | None = None):
        what = f"tensor {tensor!r}: " if tensor is not None else f"file {file!r}: " if file is not None else ""
        super().__init__(what + message)
        self.tensor = tensor
        self.file = file


@dataclass
class Artifact:
    """One version ready to store or upload: its manifest and its files' bytes."""

    manifest: WeightManifest
    files: dict[str, bytes]


# ----------------------------------------------------------------------------- checksums


def file_entry(data: bytes) -> dict:
    """Manifest entry of one file: ``{"sha256": hex, "bytes": size}``."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _hash_many(state: Mapping[str, np.ndarray], names: list[str], threads: int) -> dict[str, str]:
    if threads > 1 and len(names) > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return dict(zip(names, pool.map(lambda n: tensor_checksum(state[n]), names)))
    return {n: tensor_checksum(state[n]) for n in names}


def tensor_table(
    state: Mapping[str, np.ndarray],
    previous: Mapping[str, dict] | None = None,
    changed: Iterable[str] | None = None,
    threads: int = HASH_THREADS,
) -> dict[str, dict]:
    """The manifest's ``tensors`` map ``{name: {dtype, shape, sha256}}`` of a bf16 state.

    With ``previous`` (the last version's table) and ``changed`` (names whose bits may differ),
    only the changed tensors are hashed; the others keep their previous checksum.
    """
    if previous is None or changed is None:
        todo = list(state)
    else:
        changed = set(changed)
        todo = [n for n in state if n in changed or n not in previous]
    sums = _hash_many(state, todo, threads)
    table = {}
    for name, arr in state.items():
        sha = sums[name] if name in sums else previous[name]["sha256"]
        table[name] = {"dtype": BF16, "shape": list(arr.shape), "sha256": sha}
    return table


def state_digest(tensors: Mapping[str, dict]) -> str:
    """SHA-256 over a tensor table: identifies a whole state without hashing its data again."""
    canon = json.dumps(
        sorted([name, t.get("dtype"), list(t.get("shape", [])), t.get("sha256")] for name, t in tensors.items()),
        separators=(",", ":"),
    )
    return hashlib.sha256(canon.encode()).hexdigest()


def verify_state(
    state: Mapping[str, np.ndarray],
    manifest: WeightManifest,
    names: Iterable[str] | None = None,
    threads: int = HASH_THREADS,
) -> None:
    """Check a reconstructed state against ``manifest.tensors``; raise naming the first bad tensor.

    ``names`` restricts the (hashing) check to those tensors; by default every tensor is hashed
    and the state must hold exactly the manifest's tensors.
    """
    expected = manifest.tensors
    if names is None:
        extra = sorted(set(state) - set(expected))
        if extra:
            raise WeightVerificationError("not in the manifest", tensor=extra[0])
        names = list(expected)
    names = list(names)
    for name in names:
        if name not in expected:
            raise WeightVerificationError("not in the manifest", tensor=name)
        if name not in state:
            raise WeightVerificationError("missing from the state", tensor=name)
        arr, want = state[name], expected[name]
        if want.get("dtype") != BF16 or not isinstance(arr, np.ndarray) or arr.dtype != np.uint16:
            raise WeightVerificationError(f"expected bf16 bits, manifest says {want.get('dtype')!r}", tensor=name)
        if list(arr.shape) != list(want.get("shape", [])):
            raise WeightVerificationError(f"shape {list(arr.shape)} != manifest {want.get('shape')}", tensor=name)
    sums = _hash_many(state, names, threads)
    for name in names:
        if sums[name] != expected[name].get("sha256"):
            raise WeightVerificationError(
                f"sha256 {sums[name][:16]}... != manifest {str(expected[name].get('sha256'))[:16]}... "
                f"(version {manifest.version}); pull a full version",
                tensor=name,
            )


def _read(src: FileSource) -> bytes:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(src) if not isinstance(src, bytes) else src
    return Path(src).read_bytes()


def verify_files(manifest: WeightManifest, files: Mapping[str, FileSource]) -> dict[str, bytes]:
    """Check every file of ``manifest`` against its size and SHA-256; return their bytes."""
    out = {}
    for name, info in manifest.files.items():
        if name not in files:
            raise WeightVerificationError("missing", file=name)
        data = _read(files[name])
        if "bytes" in info and len(data) != info["bytes"]:
            raise WeightVerificationError(f"{len(data)} bytes, manifest says {info['bytes']}", file=name)
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise WeightVerificationError("sha256 mismatch (corrupt or truncated download)", file=name)
        out[name] = data
    return out


# ----------------------------------------------------------------------------- full


def _shard_names(n: int) -> list[str]:
    return [FULL_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _unaliased(bits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copy arrays that share memory with an earlier one (tied weights, e.g. embeddings and
    lm_head of a bf16 model): safetensors refuses to save aliased tensors."""
    spans = sorted(
        ((a.__array_interface__["data"][0], a.nbytes, n) for n, a in bits.items() if a.nbytes),
        key=lambda x: x[0],
    )
    out, end = dict(bits), 0
    for start, size, name in spans:
        if start < end:
            out[name] = bits[name].copy()
        end = max(end, start + size)
    return out


def build_full(
    model_id: str,
    version: int,
    state: Mapping[str, torch.Tensor | np.ndarray],
    *,
    tensors: Mapping[str, dict] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: dict | None = None,
) -> Artifact:
    """A full artifact: the state as bf16 safetensors, in shards of at most ``shard_bytes``
    (a larger tensor gets a shard of its own). ``tensors`` may pass a precomputed tensor table."""
    bits = _unaliased(state_to_bits(state))
    groups: list[list[str]] = [[]]
    size = 0
    for name, arr in bits.items():
        if groups[-1] and size + arr.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += arr.nbytes
    files = {}
    st_meta = {"model_id": model_id, "version": str(version), "format": "pt"}
    for fname, group in zip(_shard_names(len(groups)), groups):
        files[fname] = safetensors.torch.save({n: bits_to_tensor(bits[n]) for n in group}, metadata=st_meta)
    table = dict(tensors) if tensors is not None else tensor_table(bits)
    manifest = WeightManifest(
        model_id=model_id,
        version=version,
        kind="full",
        files={name: file_entry(data) for name, data in files.items()},
        tensors=table,
        created=time.time(),
        metadata={"format": "safetensors", "digest": state_digest(table), **(metadata or {})},
    )
    return Artifact(manifest, files)


def read_full(
    manifest: WeightManifest, files: Mapping[str, FileSource], *, verify: bool = True
) -> dict[str, np.ndarray]:
    """Load a full artifact into ``{name: uint16 bits}`` (writable arrays), verifying files and
    every tensor checksum unless ``verify=False``. Files given as paths are hashed while
    streaming and loaded by safetensors directly (no second copy in memory)."""
    if manifest.kind != "full":
        raise ValueError(f"manifest of version {manifest.version} is a {manifest.kind}, not a full artifact")
    state: dict[str, np.ndarray] = {}
    for fname, info in manifest.files.items():
        if fname not in files:
            raise WeightVerificationError("missing", file=fname)
        src = files[fname]
        is_path = not isinstance(src, (bytes, bytearray, memoryview))
        if verify:
            sha, size = _hash_path(src) if is_path else (hashlib.sha256(src).hexdigest(), len(src))
            if "bytes" in info and size != info["bytes"]:
                raise WeightVerificationError(f"{size} bytes, manifest says {info['bytes']}", file=fname)
            if sha != info["sha256"]:
                raise WeightVerificationError("sha256 mismatch (corrupt or truncated download)", file=fname)
        try:
            loaded = safetensors.torch.load_file(os.fspath(src)) if is_path else safetensors.torch.load(bytes(src))
        except Exception as exc:  # safetensors raises its own error types
            raise WeightVerificationError(f"not a readable safetensors file ({exc})", file=fname) from None
        for name, t in loaded.items():
            if t.dtype != torch.bfloat16:
                raise WeightVerificationError(f"stored as {t.dtype}, expected bfloat16", tensor=name)
            if name in state:
                raise WeightVerificationError("stored in two shards", tensor=name)
            state[name] = to_bf16_bits(t)
    if verify:
        verify_state(state, manifest)
    return state


def _hash_path(path: FileSource) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


# ----------------------------------------------------------------------------- delta


def build_delta(
    model_id: str,
    version: int,
    base_manifest: WeightManifest,
    base_state: Mapping[str, np.ndarray],
    new_state: Mapping[str, torch.Tensor | np.ndarray],
    *,
    level: int = DEFAULT_LEVEL,
    update_base: bool = False,
    threads: int = 0,
    metadata: dict | None = None,
) -> Artifact:
    """A delta artifact from ``base_state`` (the bits of ``base_manifest``'s version) to ``new_state``.

    Raises :class:`~astralight.weights.delta.DeltaError` if names or shapes changed (publish a
    full version instead). ``update_base=True`` advances ``base_state`` to the new bits in place.
    """
    if version <= base_manifest.version:
        raise ValueError(f"delta version {version} must be above its base {base_manifest.version}")
    new_bits = state_to_bits(new_state)
    base_digest = state_digest(base_manifest.tensors)
    blob, stats = encode_delta(
        base_state, new_bits, level=level, base_version=base_manifest.version, version=version,
        base_digest=base_digest, update_old=update_base, threads=threads,
    )
    table = tensor_table(new_bits, previous=base_manifest.tensors, changed=stats.changed)
    manifest = WeightManifest(
        model_id=model_id,
        version=version,
        kind="delta",
        base_version=base_manifest.version,
        files={DELTA_FILE: file_entry(blob)},
        tensors=table,
        created=time.time(),
        metadata={
            "codec": CODEC, "zstd_level": level, "base_digest": base_digest, "digest": state_digest(table),
            "changed_tensors": len(stats.changed), "changed_elements": stats.changed_elements,
            "sparsity": stats.sparsity, **(metadata or {}),
        },
    )
    return Artifact(manifest, {DELTA_FILE: blob})


def check_delta_artifact(
    state: Mapping[str, np.ndarray],
    state_manifest: WeightManifest,
    manifest: WeightManifest,
    files: Mapping[str, FileSource],
) -> bytes:
    """Every check that needs no write: model, base version and base digest, tensor tables,
    file sizes and SHA-256, and the blob's header. Returns the delta blob."""
    if manifest.kind != "delta":
        raise ValueError(f"manifest of version {manifest.version} is {manifest.kind!r}, not a delta")
    if manifest.model_id != state_manifest.model_id:
        raise DeltaError(f"delta is for model {manifest.model_id!r}, this state is {state_manifest.model_id!r}")
    if manifest.base_version != state_manifest.version:
        raise DeltaError(
            f"delta {manifest.version} applies onto version {manifest.base_version}, "
            f"this state is version {state_manifest.version}; pull a full version"
        )
    base_digest = state_digest(state_manifest.tensors)
    if manifest.metadata.get("base_digest", base_digest) != base_digest:
        raise DeltaError("delta was built on a different base state (digest mismatch); pull a full version")
    if set(manifest.tensors) != set(state_manifest.tensors) or set(state) != set(state_manifest.tensors):
        raise DeltaError("the delta's version has other tensor names than this state; pull a full version")
    data = verify_files(manifest, files)
    if DELTA_FILE not in data:
        raise DeltaError(f"delta manifest lists no {DELTA_FILE!r}")
    blob = data[DELTA_FILE]
    header = read_delta_header(blob)
    if header.version is not None and header.version != manifest.version:
        raise DeltaError(f"delta file is for version {header.version}, manifest says {manifest.version}")
    if header.base_digest is not None and header.base_digest != base_digest:
        raise DeltaError("delta was built on a different base state (digest mismatch); pull a full version")
    changed = set(header.names)
    for name, want in manifest.tensors.items():
        if name not in changed and want != state_manifest.tensors[name]:
            raise DeltaError(f"tensor {name!r}: the manifest lists a new checksum but the delta does not change it")
    return blob


def apply_delta_artifact(
    state: dict[str, np.ndarray],
    state_manifest: WeightManifest,
    manifest: WeightManifest,
    files: Mapping[str, FileSource],
) -> list[str]:
    """Apply a delta artifact to ``state`` (the bits of ``state_manifest``'s version) in place.

    Before writing, :func:`check_delta_artifact` refuses a delta of another model, onto another
    base version or base state, or with a corrupt file (``DeltaError`` or a
    ``WeightVerificationError`` naming the file; ``state`` untouched). After writing, the changed
    tensors are hashed; the unchanged ones were checked to keep their checksum, so the whole new
    state is verified. A ``WeightVerificationError`` naming a tensor means ``state`` was written
    and is wrong: pull a full version. Returns the names of the changed tensors.
    """
    blob = check_delta_artifact(state, state_manifest, manifest, files)
    return _write_delta(state, state_manifest, manifest, blob)


def _write_delta(state, state_manifest: WeightManifest, manifest: WeightManifest, blob: bytes) -> list[str]:
    apply_delta(state, blob, base_version=state_manifest.version, base_digest=state_digest(state_manifest.tensors))
    changed = read_delta_header(blob).names
    verify_state(state, manifest, names=changed)
    return changed


# ----------------------------------------------------------------------------- helpers


class ArtifactBuilder:
    """Trainer side: builds each published version as full or delta against the last published.

    Keeps a private copy of the last published bf16 bits (one model's worth of memory) so the
    delta is exact with respect to what receivers hold. A full artifact is built for the first
    version, when ``full_every`` versions have passed since the last full one (0: never again),
    when ``full=True``, and when tensor names or shapes changed.
    """

    def __init__(
        self,
        model_id: str,
        *,
        full_every: int = 10,
        level: int = DEFAULT_LEVEL,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        threads: int = 0,
    ):
        self.model_id = model_id
        self.full_every = full_every
        self.level = level
        self.shard_bytes = shard_bytes
        self.threads = threads
        self.last_manifest: WeightManifest | None = None
        self.last_full_version: int | None = None
        self._published: dict[str, np.ndarray] | None = None

    def build(
        self, version: int, state: Mapping[str, torch.Tensor | np.ndarray], *, full: bool | None = None
    ) -> Artifact:
        """Build version ``version`` of ``state`` (torch tensors or uint16 bits), and remember it
        as published. Call it with a snapshot if training may modify the tensors meanwhile."""
        if self.last_manifest is not None and version <= self.last_manifest.version:
            raise ValueError(f"version {version} is not above the last published {self.last_manifest.version}")
        bits = state_to_bits(state)
        want_full = full or self._published is None or (
            full is None and self.full_every > 0 and version - self.last_full_version >= self.full_every
        )
        if not want_full:
            try:
                art = build_delta(
                    self.model_id, version, self.last_manifest, self._published, bits,
                    level=self.level, update_base=True, threads=self.threads,
                )
            except DeltaError:  # names or shapes changed (checked before any write): go full
                want_full = True
            except BaseException:
                self._published = None  # may be half advanced: the next version must be full
                raise
        if want_full:
            art = build_full(self.model_id, version, bits, shard_bytes=self.shard_bytes)
            self._published = {n: np.array(b, copy=True) for n, b in bits.items()}
            self.last_full_version = version
        self.last_manifest = art.manifest
        return art


class WeightState:
    """RaaS side: the bf16 state of one version, advanced by verified full or delta artifacts.

    ``apply`` raises :class:`DeltaError` (nothing written) or :class:`WeightVerificationError`
    (state dropped, ``version`` becomes None) when an artifact cannot be used; the caller then
    fetches the latest full version and applies it.
    """

    def __init__(self) -> None:
        self.state: dict[str, np.ndarray] | None = None
        self.manifest: WeightManifest | None = None

    @property
    def version(self) -> int | None:
        return self.manifest.version if self.manifest is not None else None

    def needs_full(self, manifest: WeightManifest) -> bool:
        """True if ``manifest`` cannot be applied to the current state (so pull a full one)."""
        return manifest.kind == "delta" and (
            self.manifest is None or manifest.base_version != self.manifest.version
            or manifest.model_id != self.manifest.model_id
        )

    def apply(self, manifest: WeightManifest, files: Mapping[str, FileSource]) -> list[str]:
        """Move to ``manifest``'s version; return the names of the tensors that changed."""
        if manifest.kind == "full":
            self.state = read_full(manifest, files)
            self.manifest = manifest
            return list(self.state)
        if self.state is None or self.manifest is None:
            raise DeltaError(f"no base state to apply delta {manifest.version} to; pull a full version")
        blob = check_delta_artifact(self.state, self.manifest, manifest, files)  # raises: state intact
        try:
            changed = _write_delta(self.state, self.manifest, manifest, blob)
        except DeltaError:
            raise  # apply_delta validates every tensor before its first write: state intact
        except Exception:
            self.state, self.manifest = None, None  # written but wrong (or half written): unusable
            raise
        self.manifest = manifest
        return changed

    def tensors(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """bf16 torch views (no copy) of the state, e.g. for ``Engine.update_weights``."""
        if self.state is None:
            raise RuntimeError("no weights loaded")
        names = list(self.state) if names is None else list(names)
        return {n: bits_to_tensor(self.state[n]) for n in names}
