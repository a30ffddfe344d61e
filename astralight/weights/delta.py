"""The bf16 bit-diff delta codec: what changed between two published versions, compactly.

RL updates at small learning rates leave ~99% of bf16 weights bit-identical from one version to
the next (AstraFlow, Figure 17), so a RaaS only needs the elements whose 16-bit pattern changed.

Per changed tensor the codec stores

* the sorted flat indices of the changed elements, gap-encoded (``g[0] = i[0]``,
  ``g[j] = i[j] - i[j-1] - 1``) in the narrowest unsigned type that holds the largest gap
  (uint8/16/32/64; a gap can exceed 2**32 in a tensor of more than 2**32 elements);
* the *absolute* new 16-bit patterns (not xor/differences), so applying a delta twice, or onto a
  state where part of it was already applied, is harmless;

laid out as byte planes (all low bytes of the gaps, then the next bytes, ..., then the low and the
high bytes of the values) and compressed as one zstd frame with a content checksum. Byte planes
matter: the high byte of a bf16 value (sign and exponent) and the upper bytes of the gaps are
highly repetitive, the low bytes are not; separated, zstd's entropy coder sees each distribution
on its own (measured: 13% smaller than interleaved gaps-then-values at level 1, and faster).

Blob layout (all integers little-endian)::

    MAGIC (8 bytes) | u32 header length H | header: zstd frame (H bytes) of a msgpack map
    | one zstd frame per changed tensor, in header order, back to back | u32 CRC-32 of all before

The header names the format, the base and target versions, an optional digest of the base
state, and per tensor its name, shape, number of changed elements, gap width and frame sizes.
Decoding never trusts it: every size, index and name is checked, and corrupted input raises
:class:`DeltaError` before anything is written (see :func:`apply_delta`). Corruption is caught
in layers: the trailing CRC-32 (every 1-3 bit error and every burst up to 32 bits, whole blob,
~7 GB/s), then each frame's own xxhash64 content checksum (names the tensor), then index bounds;
the manifest's SHA-256 of the file and of every rebuilt tensor sit above that. No pickle.
"""

from __future__ import annotations

import math
import struct
import time
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import numpy as np
import zstandard

MAGIC = b"ALDELTA\x01"
FORMAT = 1
#: zstd level chosen by measurement (bench_delta_codec.py --levels, 5e7 elements, sparsity
#: 0.989): ratio 56.5 at -5, 58.3 at -1, 72.1 at 1, 71.0 at 3, 71.6 at 9, 71.8 at 19, with
#: compression 4x (level 9) to 300x (level 19) slower than level 1. The planes are close to
#: their order-0 entropy (mantissa bytes are noise), which level 1's Huffman stage already
#: reaches; matching at higher levels finds nothing more. Negative levels skip Huffman.
DEFAULT_LEVEL = 1
#: elements compared per step when diffing; keeps the boolean mask in L2/L3 cache and bounds
#: temporaries to a few MiB whatever the tensor size.
DIFF_CHUNK = 1 << 20
#: decoded indices+values (10 bytes per changed element) kept in memory between validation and
#: writing; above this, apply decodes twice rather than hold them.
APPLY_MEMORY_BUDGET = 512 << 20

_GAP_DTYPES = (np.dtype("<u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8"))
_VALUE_DTYPE = np.dtype("<u2")
_HEADER_LIMIT = 64 << 20  # a header describes tensors, not data; anything larger is corrupt


class DeltaError(ValueError):
    """A delta cannot be built or applied (corrupt blob, wrong base, shape/name mismatch)."""


# ----------------------------------------------------------------------------- gaps


def gap_dtype_for(max_gap: int) -> np.dtype:
    """The narrowest unsigned little-endian dtype that holds ``max_gap``."""
    for dt in _GAP_DTYPES:
        if max_gap <= np.iinfo(dt).max:
            return dt
    raise DeltaError(f"gap {max_gap} does not fit in 64 bits")


def encode_gaps(indices: np.ndarray) -> np.ndarray:
    """Gap-encode sorted, distinct, non-negative flat indices into the narrowest unsigned type.

    ``g[0] = i[0]`` and ``g[j] = i[j] - i[j-1] - 1``, so every gap is ``>= 0`` and below the
    tensor size; a fully changed tensor encodes as all zeros, which compresses to nothing.
    """
    idx = np.asarray(indices)
    if idx.size == 0:
        return np.zeros(0, dtype=_GAP_DTYPES[0])
    idx = idx.astype(np.int64, copy=False)
    gaps = np.empty(idx.size, dtype=np.int64)
    gaps[0] = idx[0]
    np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    gaps[1:] -= 1
    if gaps[0] < 0 or (gaps.size > 1 and gaps[1:].min() < 0):
        raise DeltaError("indices must be sorted, distinct and non-negative")
    return gaps.astype(gap_dtype_for(int(gaps.max())))


def decode_gaps(gaps: np.ndarray, size: int) -> np.ndarray:
    """Inverse of :func:`encode_gaps`, with bounds checks: every index is in ``[0, size)``.

    Raises :class:`DeltaError` (never returns an out-of-range or unsorted index) so a corrupted
    delta cannot write outside a tensor.
    """
    gaps = np.asarray(gaps)
    if gaps.dtype.kind != "u":
        raise DeltaError(f"gaps must be unsigned integers, got {gaps.dtype}")
    count = gaps.size
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    if count > size:
        raise DeltaError(f"{count} changed elements in a tensor of {size}")
    if int(gaps.max()) >= size:  # also keeps uint64 gaps inside int64 below
        raise DeltaError(f"a gap of {int(gaps.max())} exceeds the tensor size {size}")
    idx = gaps.astype(np.int64)
    idx += 1
    np.cumsum(idx, out=idx)
    idx -= 1
    # Each step is in [1, size] and count <= size, so the sum is at most size**2: it can only
    # wrap around int64 for tensors above ~3e9 elements, where monotonicity is checked too.
    if size > 3_000_000_000 and count > 1 and not bool(np.all(idx[1:] > idx[:-1])):
        raise DeltaError("indices overflow")
    if int(idx[-1]) >= size:
        raise DeltaError(f"index {int(idx[-1])} out of bounds for a tensor of {size}")
    return idx


# ----------------------------------------------------------------------------- diff


def changed_indices(old: np.ndarray, new: np.ndarray, chunk: int = DIFF_CHUNK) -> np.ndarray:
    """Sorted flat int64 indices where the 16-bit patterns of ``old`` and ``new`` differ.

    Compares bit patterns, so NaNs with equal payloads are equal and ``-0.0 != 0.0``. Works in
    cache-sized chunks: ~2-4 GB/s of bf16 per core (CPU time), temporaries of a few MiB.
    """
    a, b = old.reshape(-1), new.reshape(-1)
    n = a.size
    if n <= chunk:
        return np.flatnonzero(a != b)
    parts = []
    mask = np.empty(chunk, dtype=bool)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        m = mask[: stop - start]
        np.not_equal(a[start:stop], b[start:stop], out=m)
        hits = np.flatnonzero(m)
        if hits.size:
            hits += start
            parts.append(hits)
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _to_planes(gaps: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Byte planes ``[gap byte 0..w-1 | value low | value high]``, each ``count`` bytes."""
    count, w = gaps.size, gaps.dtype.itemsize
    planes = np.empty((w + 2, count), dtype=np.uint8)
    planes[:w] = gaps.astype(gaps.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(count, w).T
    planes[w:] = values.astype(_VALUE_DTYPE, copy=False).view(np.uint8).reshape(count, 2).T
    return planes


def _from_planes(raw: bytes, count: int, gap_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    w = gap_dtype.itemsize
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(w + 2, count)
    gaps = np.empty(count, dtype=gap_dtype)
    gaps.view(np.uint8).reshape(count, w)[...] = planes[:w].T
    values = np.empty(count, dtype=_VALUE_DTYPE)
    values.view(np.uint8).reshape(count, 2)[...] = planes[w:].T
    return gaps, values.view(np.uint16)


# ----------------------------------------------------------------------------- encode


@dataclass
class DeltaStats:
    """What :func:`encode_delta` did; ``changed`` lists the tensors present in the delta."""

    tensors: int = 0
    elements: int = 0
    changed_elements: int = 0
    raw_bytes: int = 0
    delta_bytes: int = 0
    diff_s: float = 0.0
    compress_s: float = 0.0
    total_s: float = 0.0
    changed: list[str] = field(default_factory=list)
    gap_dtypes: dict[str, int] = field(default_factory=dict)

    @property
    def full_bytes(self) -> int:
        """Size of the whole state as bf16 (what a full sync moves, before file overhead)."""
        return 2 * self.elements

    @property
    def sparsity(self) -> float:
        """Fraction of elements whose bit pattern did not change."""
        return 1.0 - self.changed_elements / self.elements if self.elements else 1.0

    @property
    def compression_ratio(self) -> float:
        return self.full_bytes / self.delta_bytes if self.delta_bytes else float("inf")


def _check_array(arr: np.ndarray, where: str) -> None:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint16:
        got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
        raise DeltaError(f"{where}: expected bf16 bit patterns as a uint16 array (to_bf16_bits), got {got}")


def encode_delta(
    old: Mapping[str, np.ndarray],
    new: Mapping[str, np.ndarray],
    *,
    level: int = DEFAULT_LEVEL,
    base_version: int | None = None,
    version: int | None = None,
    base_digest: str | None = None,
    update_old: bool = False,
    threads: int = 0,
) -> tuple[bytes, DeltaStats]:
    """Encode the change from ``old`` to ``new`` (name -> ``uint16`` bit patterns) as a blob.

    Both states must hold the same names with the same shapes (a renamed, added or reshaped
    tensor cannot be a delta: publish a full version). Only tensors with at least one changed
    element are stored. ``base_version``/``version``/``base_digest`` are recorded in the header
    so :func:`apply_delta` can refuse the wrong base. With ``update_old=True`` the changed
    elements are also written into ``old`` (in place, O(changes)), so the caller's copy of the
    last published state advances to ``new`` without a second full pass. ``threads > 0``
    encodes that many tensors concurrently (numpy compares and zstd release the GIL).
    """
    t0 = time.perf_counter()
    missing, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    if missing or added:
        raise DeltaError(
            f"tensor names differ (missing in new: {missing[:5]}, new: {added[:5]}); publish a full version"
        )
    stats = DeltaStats()
    names = list(new)
    for name in names:
        _check_array(old[name], f"old[{name!r}]")
        _check_array(new[name], f"new[{name!r}]")
        if old[name].shape != new[name].shape:
            raise DeltaError(
                f"tensor {name!r} changed shape {old[name].shape} -> {new[name].shape}; publish a full version"
            )
        if update_old and not (old[name].flags.writeable and old[name].flags.c_contiguous):
            raise DeltaError(f"old[{name!r}] must be writable and C-contiguous for update_old")
        stats.tensors += 1
        stats.elements += int(new[name].size)

    def one(name: str):
        a, b = old[name], new[name]
        t = time.perf_counter()
        idx = changed_indices(a, b)
        if idx.size == 0:
            return name, None, None, time.perf_counter() - t, 0.0
        values = b.reshape(-1)[idx]
        if update_old:
            a.reshape(-1)[idx] = values
        gaps = encode_gaps(idx)
        planes = _to_planes(gaps, values)
        t1 = time.perf_counter()
        cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        frame = cctx.compress(planes)
        entry = {
            "name": name,
            "shape": list(b.shape),
            "count": int(idx.size),
            "gap_bytes": gaps.dtype.itemsize,
            "raw": int(planes.nbytes),
            "frame": len(frame),
        }
        return name, entry, frame, t1 - t, time.perf_counter() - t1

    if threads and threads > 0 and len(names) > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            results = list(pool.map(one, names))
    else:
        results = [one(name) for name in names]

    entries, frames = [], []
    for name, entry, frame, diff_s, comp_s in results:
        stats.diff_s += diff_s
        stats.compress_s += comp_s
        if entry is None:
            continue
        entries.append(entry)
        frames.append(frame)
        stats.changed.append(name)
        stats.changed_elements += entry["count"]
        stats.raw_bytes += entry["raw"]
        key = _GAP_DTYPES[[d.itemsize for d in _GAP_DTYPES].index(entry["gap_bytes"])].name
        stats.gap_dtypes[key] = stats.gap_dtypes.get(key, 0) + 1

    header = msgpack.packb(
        {
            "format": FORMAT,
            "base_version": base_version,
            "version": version,
            "base_digest": base_digest,
            "tensors": entries,
        },
        use_bin_type=True,
    )
    hframe = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True).compress(header)
    body = [MAGIC, struct.pack("<I", len(hframe)), hframe, *frames]
    crc = 0
    for part in body:
        crc = zlib.crc32(part, crc)
    blob = b"".join([*body, struct.pack("<I", crc)])
    stats.delta_bytes = len(blob)
    stats.total_s = time.perf_counter() - t0
    return blob, stats


# ----------------------------------------------------------------------------- decode


@dataclass
class DeltaEntry:
    """One changed tensor in a delta blob (validated header fields plus its frame's offset)."""

    name: str
    shape: tuple[int, ...]
    count: int
    gap_dtype: np.dtype
    raw: int
    offset: int
    length: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # exact Python ints: a corrupt shape cannot overflow


@dataclass
class DeltaHeader:
    """The validated header of a delta blob."""

    base_version: int | None
    version: int | None
    base_digest: str | None
    tensors: list[DeltaEntry]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.tensors]

    @property
    def changed_elements(self) -> int:
        return sum(e.count for e in self.tensors)


def _opt_int(d: dict, key: str) -> int | None:
    v = d.get(key)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise DeltaError(f"header.{key}: expected an int or nil, got {type(v).__name__}")
    return v


def read_delta_header(blob: bytes) -> DeltaHeader:
    """Parse and validate a delta's header (sizes, names, frame layout) without decoding data."""
    view = memoryview(blob)
    if len(view) < len(MAGIC) + 8 or bytes(view[: len(MAGIC)]) != MAGIC:
        raise DeltaError("not an astralight bf16 delta (bad magic); was a full artifact sent?")
    (crc,) = struct.unpack_from("<I", view, len(view) - 4)
    view = view[:-4]
    if zlib.crc32(view) != crc:
        raise DeltaError("delta blob is corrupt (CRC-32 mismatch); download it again")
    (hlen,) = struct.unpack_from("<I", view, len(MAGIC))
    start = len(MAGIC) + 4
    if hlen == 0 or start + hlen > len(view):
        raise DeltaError(f"header length {hlen} runs past the end of a {len(view)}-byte blob")
    try:
        header_raw = _decompress(view[start : start + hlen], None, _HEADER_LIMIT)
        h = msgpack.unpackb(header_raw, raw=False, strict_map_key=True)
    except Exception as exc:  # zstd and msgpack raise several unrelated types
        raise DeltaError(f"corrupt delta header ({type(exc).__name__}: {exc})") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        raise DeltaError(f"unsupported delta format {h.get('format') if isinstance(h, dict) else h!r}")
    base_digest = h.get("base_digest")
    if base_digest is not None and not isinstance(base_digest, str):
        raise DeltaError("header.base_digest: expected a string or nil")
    raw_tensors = h.get("tensors")
    if not isinstance(raw_tensors, list):
        raise DeltaError("header.tensors: expected a list")
    offset = start + hlen
    entries: list[DeltaEntry] = []
    seen: set[str] = set()
    for i, t in enumerate(raw_tensors):
        where = f"header.tensors[{i}]"
        if not isinstance(t, dict):
            raise DeltaError(f"{where}: expected a map")
        name, shape = t.get("name"), t.get("shape")
        if not isinstance(name, str) or name in seen:
            raise DeltaError(f"{where}.name: missing or duplicated ({name!r})")
        seen.add(name)
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise DeltaError(f"{where}.shape: expected a list of non-negative ints")
        ints = {}
        for key in ("count", "gap_bytes", "raw", "frame"):
            v = t.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise DeltaError(f"{where}.{key}: expected a non-negative int")
            ints[key] = v
        widths = [d.itemsize for d in _GAP_DTYPES]
        if ints["gap_bytes"] not in widths:
            raise DeltaError(f"{where}.gap_bytes: {ints['gap_bytes']} is not one of {widths}")
        gap_dtype = _GAP_DTYPES[widths.index(ints["gap_bytes"])]
        entry = DeltaEntry(name, tuple(shape), ints["count"], gap_dtype, ints["raw"], offset, ints["frame"])
        if entry.count == 0 or entry.count > entry.size:
            raise DeltaError(f"{where}.count: {entry.count} changed elements in a tensor of {entry.size}")
        if entry.raw != entry.count * (gap_dtype.itemsize + 2):
            raise DeltaError(f"{where}.raw: {entry.raw} bytes do not match {entry.count} changes")
        offset += entry.length
        if offset > len(view):
            raise DeltaError(f"{where}: data runs past the end of the blob (truncated download?)")
        entries.append(entry)
    if offset != len(view):
        raise DeltaError(f"{len(view) - offset} unexpected bytes after the last tensor")
    return DeltaHeader(_opt_int(h, "base_version"), _opt_int(h, "version"), base_digest, entries)


def _decompress(frame: memoryview, size: int | None, limit: int) -> bytes:
    """One whole zstd frame that must carry its content checksum (and, if given, ``size``)."""
    params = zstandard.get_frame_parameters(frame)
    if not params.has_checksum:
        raise zstandard.ZstdError("frame has no content checksum")
    if size is not None and params.content_size != size:
        raise zstandard.ZstdError(f"frame declares {params.content_size} bytes, expected {size}")
    if params.content_size > limit:
        raise zstandard.ZstdError(f"frame declares {params.content_size} bytes, above {limit}")
    return zstandard.ZstdDecompressor().decompress(frame, max_output_size=limit, allow_extra_data=False)


def _decode_entry(view: memoryview, e: DeltaEntry) -> tuple[np.ndarray, np.ndarray]:
    """Decompress (checksum-verified) and decode one tensor's indices and values."""
    try:
        raw = _decompress(view[e.offset : e.offset + e.length], e.raw, e.raw)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"tensor {e.name!r}: corrupt data ({exc})") from None
    if len(raw) != e.raw:
        raise DeltaError(f"tensor {e.name!r}: {len(raw)} bytes decoded, header says {e.raw}")
    gaps, values = _from_planes(raw, e.count, e.gap_dtype)
    try:
        idx = decode_gaps(gaps, e.size)
    except DeltaError as exc:
        raise DeltaError(f"tensor {e.name!r}: {exc}") from None
    return idx, values


def apply_delta(
    base: Mapping[str, np.ndarray],
    blob: bytes,
    *,
    base_version: int | None = None,
    base_digest: str | None = None,
    threads: int = 0,
) -> Mapping[str, np.ndarray]:
    """Apply a delta blob to ``base`` in place (its ``uint16`` arrays are mutated) and return it.

    Refuses (:class:`DeltaError`) a delta whose recorded base version/digest differs from the
    ``base_version``/``base_digest`` given, a tensor missing from ``base`` or of another shape,
    and any corrupted data (zstd frame checksums, sizes, index bounds). All tensors are decoded
    and validated *before* the first write, so a corrupted delta leaves ``base`` untouched.
    Because values are absolute, applying the same delta again is a no-op. It does not compute
    SHA-256 checksums of the result: check it against the manifest with
    :func:`astralight.weights.artifacts.verify_state` (that is what catches a wrong base).
    """
    header = read_delta_header(blob)
    if base_version is not None and header.base_version is not None and header.base_version != base_version:
        raise DeltaError(f"delta applies onto version {header.base_version}, this state is version {base_version}")
    if base_digest is not None and header.base_digest is not None and header.base_digest != base_digest:
        raise DeltaError("delta was built on a different base state (base digest mismatch); pull a full version")
    for e in header.tensors:
        arr = base.get(e.name)
        if arr is None:
            raise DeltaError(f"tensor {e.name!r} is not in the base state")
        _check_array(arr, f"base[{e.name!r}]")
        if tuple(arr.shape) != e.shape:
            raise DeltaError(f"tensor {e.name!r}: base shape {tuple(arr.shape)} != delta shape {e.shape}")
        if not (arr.flags.writeable and arr.flags.c_contiguous):
            raise DeltaError(f"base[{e.name!r}] must be a writable C-contiguous array")

    view = memoryview(blob)

    def decode(e: DeltaEntry):
        return _decode_entry(view, e)

    def write(e: DeltaEntry, decoded) -> None:
        idx, values = decoded
        base[e.name].reshape(-1)[idx] = values

    def run(fn, items):
        if threads and threads > 0 and len(items) > 1:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                return list(pool.map(fn, items))
        return [fn(x) for x in items]

    if header.changed_elements * 10 <= APPLY_MEMORY_BUDGET:
        decoded = run(decode, header.tensors)  # validate everything, then write
        for e, d in zip(header.tensors, decoded):
            write(e, d)
    else:  # too large to hold: validate in a first pass, decode again to write
        run(lambda e: (decode(e), None)[1], header.tensors)
        run(lambda e: write(e, decode(e)), header.tensors)
    return base
