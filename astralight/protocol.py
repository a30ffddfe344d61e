"""Messages that cross process boundaries, and the one codec they cross in.

Every component (dataflow service, RaaS, trainer) speaks only these types. The wire format is
msgpack with a schema version; numpy arrays travel as raw bytes with their dtype and shape
(never pickle). Decoding validates every field and raises :class:`ProtocolError` naming the
field, so a service can answer a malformed body with a 4xx that says what is wrong (the field
checks and :class:`ProtocolError` live in :mod:`astralight.protocol_fields`; import them from here
or there).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from astralight.protocol_fields import (  # noqa: F401 (the field checks, re-exported)
    MAX_METADATA_COUNT, MAX_NAME_LEN, TEMPERATURE_RTOL, ProtocolError, _finite, _int_in, _known,
    _name, _opt, _req, _sha256_hex, check_sample_metadata, temperature_mismatch,
)

SCHEMA_VERSION = 1

#: dtypes allowed on the wire; anything else (object arrays in particular) is refused.
WIRE_DTYPES = frozenset(
    {"bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "int64", "uint64",
     "float16", "float32", "float64"}
)
#: the wire name of each allowed dtype, keyed by the dtype itself: ``ndarray.dtype.name`` is
#: computed in Python on every call, twice per array of every sample encoded
_WIRE_NAME_OF = {np.dtype(name): name for name in WIRE_DTYPES}
#: the plain msgpack scalars: what a message may hold besides maps and lists
_PLAIN_SCALARS = (str, bytes, int, float, bool, type(None))
MAX_ARRAY_ELEMENTS = 1 << 26  # 64M elements: far above any trajectory, far below an OOM
MAX_ARRAY_DIMS = 8  # numpy refuses more than 64; no message needs more than 2
MAX_DEPTH = 32  # nesting of maps/lists in a message (deeper input would exhaust the stack)
MAX_INDEX = 1 << 62  # sample_index, group_index: below SQLite's signed 64-bit integers
MAX_VERSION = (1 << 53) - 1  # policy versions: exact in a JSON number, far below SQLite's int64

#: Lowest behaviour log-prob a trainable sample may carry. The smallest positive float32 is
#: about 1.4e-45 (log: -103.3), so no engine can sample a token whose log-prob is below that;
#: -1000 leaves a wide margin for engines computing in other precisions and still bounds what a
#: loss sees. The dataflow refuses pushed samples with a lower log-prob
#: (``samples[i].logprobs``); the losses in :mod:`astralight.rl` stay finite even below it.
LOGPROB_FLOOR = -1000.0
#: Vocabulary sizes above this are refused (``vocab_sizes``, an engine's registered
#: ``vocab_size``), and so are token ids at or above it when no vocabulary of a policy is known:
#: no tokenizer comes near it (the largest are about 256k), and int32 token ids could name up to
#: 2^31 - 1, which an embedding lookup would turn into a crash.
MAX_VOCAB_SIZE = 1 << 24


# ----------------------------------------------------------------------------- arrays


def _pack_array(arr: np.ndarray) -> dict:
    name = _WIRE_NAME_OF.get(arr.dtype)
    if name is None:
        if arr.dtype.name not in WIRE_DTYPES:
            raise ProtocolError("array", f"dtype {arr.dtype} is not allowed on the wire")
        name = arr.dtype.name  # an allowed dtype in non-native byte order: sent natively
        arr = arr.astype(arr.dtype.newbyteorder("="))
    # tobytes() is C-ordered whatever the array's layout
    return {"__nd__": True, "dtype": name, "shape": list(arr.shape), "data": arr.tobytes()}


def _unpack_array(obj: Any, name: str) -> np.ndarray:
    if not isinstance(obj, dict) or not obj.get("__nd__"):
        raise ProtocolError(name, "expected an array {__nd__, dtype, shape, data}")
    dtype, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise ProtocolError(f"{name}.dtype", f"{dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    if type(shape) is not list or not all(  # exact int: bool is refused
            type(s) is int and 0 <= s <= MAX_ARRAY_ELEMENTS for s in shape):
        raise ProtocolError(f"{name}.shape", "must be a list of non-negative ints "
                                             f"(each <= {MAX_ARRAY_ELEMENTS})")
    if len(shape) > MAX_ARRAY_DIMS:
        raise ProtocolError(f"{name}.shape", f"{len(shape)} dimensions exceed {MAX_ARRAY_DIMS}")
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError(f"{name}.data", "must be raw bytes")
    count = math.prod(shape)
    if count > MAX_ARRAY_ELEMENTS:
        raise ProtocolError(f"{name}.shape", f"{count} elements exceeds {MAX_ARRAY_ELEMENTS}")
    dt = np.dtype(dtype)
    if len(data) != count * dt.itemsize:
        raise ProtocolError(
            f"{name}.data", f"{len(data)} bytes do not match shape {shape} of {dtype}"
        )
    return np.frombuffer(data, dtype=dt).reshape(shape).copy()


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return _pack_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


# ----------------------------------------------------------------------------- messages


def _min_versions(d: dict, where: str) -> dict:
    for k, v in d.items():
        if not isinstance(k, str) or not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ProtocolError(f"{where}.min_versions", "must map model_id -> version >= 0")
    return dict(d)


@dataclass
class Task:
    """One unit of rollout work leased to a RaaS: a prompt and how many samples to draw.

    ``prompt`` is text (or chat messages); the RaaS tokenizes it with its engine's tokenizer,
    and from then on only token ids travel. ``metadata`` carries what the reward needs (e.g. the
    reference answer). ``kind`` is ``train`` or ``eval``; eval tasks are scheduled by the dataflow
    for a given policy ``version`` and are never trained on. ``min_versions`` (synchronous mode)
    names, per model_id, the policy version a RaaS must hold before it runs the task.
    """

    task_id: str
    prompt: Any
    n: int
    model_ids: list[str]
    workflow: str = "single_turn"
    kind: str = "train"
    eval_version: int | None = None
    metadata: dict = field(default_factory=dict)
    lease_deadline: float = 0.0
    min_versions: dict = field(default_factory=dict)

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: Any, where: str = "task") -> "Task":
        if not isinstance(d, dict):
            raise ProtocolError(where, "expected a map")
        _known(d, cls, where)
        n = _req(d, "n", int, where)
        if n < 1:
            raise ProtocolError(f"{where}.n", "must be >= 1")
        kind = _opt(d, "kind", str, where, "train")
        if kind not in ("train", "eval"):
            raise ProtocolError(f"{where}.kind", "must be 'train' or 'eval'")
        model_ids = _req(d, "model_ids", list, where)
        if not model_ids or not all(isinstance(m, str) and m for m in model_ids):
            raise ProtocolError(f"{where}.model_ids", "must be a non-empty list of names")
        return cls(
            task_id=_req(d, "task_id", str, where),
            prompt=d.get("prompt"),
            n=n,
            model_ids=model_ids,
            workflow=_opt(d, "workflow", str, where, "single_turn"),
            kind=kind,
            eval_version=_opt(d, "eval_version", int, where, None),
            metadata=_opt(d, "metadata", dict, where, {}),
            lease_deadline=float(_opt(d, "lease_deadline", (int, float), where, 0.0)),
            min_versions=_min_versions(_opt(d, "min_versions", dict, where, {}), where),
        )


@dataclass
class Sample:
    """One trajectory for one policy: tokens in, tokens out.

    All four arrays have one entry per token of ``token_ids`` (prompt and completion together).
    ``logprobs`` is the behaviour log-probability of each generated token (0 where
    ``loss_mask`` is 0); ``versions`` the policy version that produced each token (-1 for prompt
    and environment tokens). ``advantage`` is filled by the dataflow on ingest from the group
    (same ``task_id`` and ``model_id``) statistics. Decoding checks the fields one by one; the
    dataflow checks more on ingest (``astralight.dataflow.ingest.validate_samples``: the
    vocabulary, the engine's context, published versions on every token, at least one
    loss-masked token, log-probs >= :data:`LOGPROB_FLOOR`, :func:`check_sample_metadata`), not
    here, so that samples
    stored by a build with fewer checks still decode.
    """

    task_id: str
    sample_index: int
    model_id: str
    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    versions: np.ndarray  # int32 [T]
    reward: float
    prompt_len: int = 0
    group_index: int = 0
    role: str = ""
    advantage: float = 0.0
    group_mean: float = 0.0
    group_std: float = 0.0
    metadata: dict = field(default_factory=dict)

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced any of this sample's tokens (staleness key)."""
        gen = self.versions[self.loss_mask.astype(bool)]
        return int(gen.min()) if gen.size else int(self.versions.max(initial=0))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def to_wire(self) -> dict:
        d = {name: getattr(self, name) for name in _SAMPLE_FIELDS}
        d["token_ids"] = self.token_ids.astype(np.int32, copy=False)
        d["logprobs"] = self.logprobs.astype(np.float32, copy=False)
        d["loss_mask"] = self.loss_mask.astype(np.uint8, copy=False)
        d["versions"] = self.versions.astype(np.int32, copy=False)
        return d

    @classmethod
    def from_wire(cls, d: Any, where: str = "sample") -> "Sample":
        if not isinstance(d, dict):
            raise ProtocolError(where, "expected a map")
        _known(d, cls, where)
        arrays = {}
        for name, dtype in (("token_ids", np.int32), ("logprobs", np.float32),
                            ("loss_mask", np.uint8), ("versions", np.int32)):
            arr = _unpack_array(d.get(name), f"{where}.{name}")
            if arr.ndim != 1:
                raise ProtocolError(f"{where}.{name}", "must be one-dimensional")
            if arr.dtype != dtype:
                raise ProtocolError(f"{where}.{name}", f"must be {np.dtype(dtype).name}")
            arrays[name] = arr
        length = arrays["token_ids"].shape[0]
        if length == 0:
            raise ProtocolError(f"{where}.token_ids", "must not be empty")
        for name, arr in arrays.items():
            if arr.shape[0] != length:
                raise ProtocolError(
                    f"{where}.{name}", f"length {arr.shape[0]} != token_ids length {length}"
                )
        # min/max of the (non-empty) arrays: a NaN fails both comparisons
        logprobs = arrays["logprobs"]
        if not (logprobs.max() <= 1e-3 and logprobs.min() > -np.inf):
            raise ProtocolError(f"{where}.logprobs", "must be finite log-probabilities (<= 0)")
        if arrays["loss_mask"].max() > 1:
            raise ProtocolError(f"{where}.loss_mask", "must hold only 0 and 1")
        if arrays["token_ids"].min() < 0:
            raise ProtocolError(f"{where}.token_ids", "must be non-negative")
        if arrays["versions"].min() < -1:
            raise ProtocolError(f"{where}.versions", "must be policy versions >= 0, or -1 for "
                                                     "prompt and environment tokens")
        reward = _req(d, "reward", (int, float), where)
        if not math.isfinite(reward):
            raise ProtocolError(f"{where}.reward", "must be finite")
        reward = _finite(reward, f"{where}.reward")
        model_id = _req(d, "model_id", str, where)
        if not model_id:
            raise ProtocolError(f"{where}.model_id", "must not be empty")
        _name(model_id, f"{where}.model_id", plain=False)
        sample_index = _req(d, "sample_index", int, where)
        if sample_index < 0:
            raise ProtocolError(f"{where}.sample_index", "must be >= 0")
        _int_in(sample_index, f"{where}.sample_index", 0, MAX_INDEX)
        prompt_len = _opt(d, "prompt_len", int, where, 0)
        if not 0 <= prompt_len <= length:
            raise ProtocolError(f"{where}.prompt_len", f"must be in [0, {length}]")
        floats = {k: _finite(_opt(d, k, (int, float), where, 0.0), f"{where}.{k}")
                  for k in ("advantage", "group_mean", "group_std")}
        return cls(
            task_id=_name(_req(d, "task_id", str, where), f"{where}.task_id", allow_empty=True,
                          plain=False),
            sample_index=sample_index,
            model_id=model_id,
            reward=reward,
            prompt_len=prompt_len,
            group_index=_int_in(_opt(d, "group_index", int, where, 0), f"{where}.group_index",
                                0, MAX_INDEX),
            role=_name(_opt(d, "role", str, where, ""), f"{where}.role", allow_empty=True,
                       plain=False),
            metadata=_opt(d, "metadata", dict, where, {}),
            **floats,
            **arrays,
        )


#: Sample's field names in declaration order (the wire's key order), read once
_SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))


@dataclass
class Batch:
    """Samples of one policy served to its trainer; acknowledged by ``batch_id`` once trained."""

    batch_id: str
    model_id: str
    policy_version: int
    samples: list[Sample]

    def to_wire(self) -> dict:
        return {
            "batch_id": self.batch_id,
            "model_id": self.model_id,
            "policy_version": self.policy_version,
            "samples": [s.to_wire() for s in self.samples],
        }

    @classmethod
    def from_wire(cls, d: Any, where: str = "batch") -> "Batch":
        if not isinstance(d, dict):
            raise ProtocolError(where, "expected a map")
        _known(d, cls, where)
        samples = _req(d, "samples", list, where)
        return cls(
            batch_id=_req(d, "batch_id", str, where),
            model_id=_req(d, "model_id", str, where),
            policy_version=_int_in(_req(d, "policy_version", int, where),
                                   f"{where}.policy_version", 0, MAX_VERSION),
            samples=[Sample.from_wire(s, f"{where}.samples[{i}]") for i, s in enumerate(samples)],
        )


@dataclass
class WeightManifest:
    """Version ``version`` of policy ``model_id``: what to fetch and how to verify it.

    ``files`` maps file name to ``{"sha256": hex, "bytes": int}``; ``tensors`` maps tensor name
    to ``{"dtype", "shape", "sha256"}`` of the reconstructed tensor, so a receiver can check
    what it built, not only what it downloaded. ``kind`` is ``full`` (safetensors) or ``delta``
    (applies onto exactly ``base_version``).
    """

    model_id: str
    version: int
    kind: str
    files: dict
    base_version: int | None = None
    tensors: dict = field(default_factory=dict)
    created: float = 0.0
    metadata: dict = field(default_factory=dict)

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: Any, where: str = "manifest") -> "WeightManifest":
        if not isinstance(d, dict):
            raise ProtocolError(where, "expected a map")
        _known(d, cls, where)
        kind = _req(d, "kind", str, where)
        if kind not in ("full", "delta"):
            raise ProtocolError(f"{where}.kind", "must be 'full' or 'delta'")
        version = _req(d, "version", int, where)
        if version < 0:
            raise ProtocolError(f"{where}.version", "must be >= 0")
        _int_in(version, f"{where}.version", 0, MAX_VERSION)
        base = _opt(d, "base_version", int, where, None)
        if kind == "delta" and (base is None or base >= version):
            raise ProtocolError(f"{where}.base_version", "a delta needs base_version < version")
        if base is not None:
            _int_in(base, f"{where}.base_version", 0, MAX_VERSION)
        files = _req(d, "files", dict, where)
        for name, info in files.items():
            if (not isinstance(name, str) or "/" in name or "\\" in name or name.startswith(".")
                    or not name or len(name) > MAX_NAME_LEN or "\x00" in name):
                raise ProtocolError(f"{where}.files", f"bad file name {name!r}")
            if not isinstance(info, dict) or not isinstance(info.get("sha256"), str):
                raise ProtocolError(f"{where}.files[{name}].sha256", "is required")
            _sha256_hex(info["sha256"], f"{where}.files[{name}].sha256")
            if info.get("bytes") is not None:
                _int_in(info["bytes"], f"{where}.files[{name}].bytes", 0, 1 << 62)
        tensors = _opt(d, "tensors", dict, where, {})
        for name, info in tensors.items():
            at = f"{where}.tensors[{name}]"
            if not isinstance(name, str) or not isinstance(info, dict):
                raise ProtocolError(at, "must map a tensor name to {dtype, shape, sha256}")
            if not isinstance(info.get("dtype"), str):
                raise ProtocolError(f"{at}.dtype", "is required (a dtype name)")
            shape = info.get("shape")
            if not isinstance(shape, list) or not all(
                    isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
                raise ProtocolError(f"{at}.shape", "must be a list of non-negative ints")
            _sha256_hex(info.get("sha256"), f"{at}.sha256")
        return cls(
            model_id=_name(_req(d, "model_id", str, where), f"{where}.model_id"),
            version=version,
            kind=kind,
            files=files,
            base_version=base,
            tensors=tensors,
            created=_finite(_opt(d, "created", (int, float), where, 0.0), f"{where}.created"),
            metadata=_opt(d, "metadata", dict, where, {}),
        )


# ----------------------------------------------------------------------------- codec

_TYPES = {"Task": Task, "Sample": Sample, "Batch": Batch, "WeightManifest": WeightManifest}
#: exact types :func:`encode` passes to msgpack as they are (ndarrays through ``_default``)
_LEAF_TYPES = frozenset((*_PLAIN_SCALARS, np.ndarray))


def encode(payload: Any) -> bytes:
    """Encode a message (a dataclass above, or a plain dict/list of them) as msgpack.

    The envelope is ``{"schema": SCHEMA_VERSION, "body": ...}``; dataclasses become maps with a
    ``__type__`` tag so :func:`decode` can rebuild and validate them.
    """

    def convert(obj: Any) -> Any:
        if type(obj) in _LEAF_TYPES:  # most values: nothing to convert, no dataclass check
            return obj
        if dataclasses.is_dataclass(obj) and type(obj).__name__ in _TYPES:
            body = {k: convert(v) for k, v in obj.to_wire().items()}
            body["__type__"] = type(obj).__name__
            return body
        if isinstance(obj, dict):
            return {k: convert(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [convert(v) for v in obj]
        return obj

    return msgpack.packb({"schema": SCHEMA_VERSION, "body": convert(payload)}, default=_default,
                         use_bin_type=True)


class _ExtRefused(ValueError):
    pass


def _refuse_ext(code: int, data: bytes) -> Any:
    raise _ExtRefused(code)


def decode(data: bytes, max_bytes: int | None = None) -> Any:
    """Decode and validate a message; raises :class:`ProtocolError` naming the bad field.

    Only plain msgpack values are accepted: maps, arrays, strings, bytes, numbers, booleans and
    nil. Extension types (and msgpack timestamps) are refused, so nothing in a message can ask
    the decoder to build an arbitrary object; nesting is bounded by ``MAX_DEPTH``.
    """
    if max_bytes is not None and len(data) > max_bytes:
        raise ProtocolError("body", f"{len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        env = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=len(data),
                              max_str_len=len(data), max_array_len=len(data),
                              max_map_len=len(data), max_ext_len=len(data), ext_hook=_refuse_ext)
    except _ExtRefused as exc:
        raise ProtocolError("body", f"msgpack extension type {exc.args[0]} is not accepted "
                                    "(plain maps, arrays, strings, bytes and numbers only)") from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError("body", f"not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(env, dict) or "schema" not in env or "body" not in env:
        raise ProtocolError("body", "expected an envelope {schema, body}")
    if env["schema"] != SCHEMA_VERSION:
        raise ProtocolError(
            "schema", f"version {env['schema']!r} not supported (this build speaks {SCHEMA_VERSION})"
        )

    if not _plain(env["body"]):
        _check_plain(env["body"], "body")  # raises, naming where

    def rebuild(obj: Any, where: str) -> Any:
        if isinstance(obj, dict):
            tag = obj.get("__type__")
            if tag is not None:
                cls = _TYPES.get(tag) if isinstance(tag, str) else None
                if cls is None:
                    raise ProtocolError(f"{where}.__type__", f"unknown type {tag!r}")
                return cls.from_wire(obj, where)
            if obj.get("__nd__"):
                return _unpack_array(obj, where)
            return {k: rebuild(v, f"{where}.{k}") for k, v in obj.items()}
        if isinstance(obj, list):
            return [rebuild(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return obj

    return rebuild(env["body"], "body")


def _plain(obj: Any) -> bool:
    """Whether ``obj`` holds only plain msgpack values nested at most MAX_DEPTH deep: the check
    of :func:`_check_plain` without building the path of every map and list (a push of 128
    samples has about 1,000). msgpack decodes to exactly these types, never to subclasses."""
    if type(obj) not in (dict, list):
        return type(obj) in _PLAIN_SCALARS
    stack = [(obj, 0)]
    while stack:
        obj, depth = stack.pop()
        if depth >= MAX_DEPTH:
            return False
        for v in (obj.values() if type(obj) is dict else obj):
            t = type(v)
            if t is dict or t is list:
                stack.append((v, depth + 1))
            elif t not in _PLAIN_SCALARS:
                return False
    return True


def _check_plain(obj: Any, where: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH and anything but plain msgpack values (iteratively:
    a hostile message must not exhaust the stack)."""
    stack = [(obj, where, 0)]
    while stack:
        obj, where, depth = stack.pop()
        if isinstance(obj, (dict, list)):
            if depth >= MAX_DEPTH:
                raise ProtocolError(where, f"nested deeper than {MAX_DEPTH} levels")
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            for k, v in items:
                if isinstance(v, (dict, list)) or not isinstance(v, _PLAIN_SCALARS):
                    stack.append((v, f"{where}.{k}" if isinstance(obj, dict) else f"{where}[{k}]",
                                  depth + 1))
        elif not isinstance(obj, _PLAIN_SCALARS):
            raise ProtocolError(where, f"{type(obj).__name__} is not a plain msgpack value")


def expect(obj: Any, cls: type, where: str = "body") -> Any:
    """Check that a decoded message is of ``cls``; raise :class:`ProtocolError` otherwise."""
    if not isinstance(obj, cls):
        raise ProtocolError(where, f"expected {cls.__name__}, got {type(obj).__name__}")
    return obj
