"""The field checks every wire message is decoded through (:mod:`astralight.protocol`), and the
error they raise: each names the offending field, so a service answers a malformed body with a
4xx that says what is wrong and how to fix it.

Why a module of its own: the checks (types, ids, bounded integers, finite numbers, sha256 hex,
sample metadata) are shared by every message type and by the dataflow's ingest, and read apart
from the message types they guard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

MAX_NAME_LEN = 256  # ids and names: task_id, model_id, role, file names
_HEX = frozenset("0123456789abcdef")
#: Sampling temperatures of a sample and of the trainer match when they differ by at most this
#: share of ``max(1, temperature)``: the check the trainer makes (``RLPolicy.check_batch``) and
#: the one the dataflow makes on ingest (:func:`check_sample_metadata`).
TEMPERATURE_RTOL = 1e-5
#: Largest episode count (``tool_calls``, ``turns``, ``tool_errors.*``, ``attempt``) a sample's
#: metadata may state; the dataflow sums them into 64-bit counters.
MAX_METADATA_COUNT = (1 << 31) - 1


class ProtocolError(ValueError):
    """A message does not match the schema; ``field`` names the offending field and
    ``message`` says what is wrong with it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


# ----------------------------------------------------------------------------- field checks


def _req(d: dict, key: str, types: type | tuple, where: str) -> Any:
    if key not in d:
        raise ProtocolError(f"{where}.{key}", "is required")
    value = d[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ProtocolError(f"{where}.{key}", f"expected {types}, got bool")
    if not isinstance(value, types):
        raise ProtocolError(f"{where}.{key}", f"expected {types}, got {type(value).__name__}")
    return value


@functools.cache
def field_names(cls: type) -> frozenset:
    """The fields of the message dataclass ``cls`` and ``__type__`` (its tag on the wire), read
    once per class: ``dataclasses.fields`` builds a tuple on every call, once per sample."""
    return frozenset(f.name for f in dataclasses.fields(cls)) | {"__type__"}


def _known(d: dict, cls: type, where: str) -> None:
    """Refuse fields ``cls`` does not have (a typo or a foreign message must not pass silently)."""
    names = field_names(cls)
    for key in d:
        if key not in names:
            raise ProtocolError(f"{where}.{str(key)[:64]}", f"unknown field of {cls.__name__}")


def _opt(d: dict, key: str, types: type | tuple, where: str, default: Any) -> Any:
    if d.get(key) is None:
        return default
    return _req(d, key, types, where)


def _name(value: Any, where: str, allow_empty: bool = False, plain: bool = True) -> str:
    """An id or name: a string of at most MAX_NAME_LEN characters (``plain``: and no control
    characters, for names that end up in paths and logs)."""
    if not isinstance(value, str):
        raise ProtocolError(where, f"expected str, got {type(value).__name__}")
    if (not value and not allow_empty) or len(value) > MAX_NAME_LEN:
        lo = 0 if allow_empty else 1
        raise ProtocolError(where, f"must be {lo}..{MAX_NAME_LEN} characters, got {len(value)}")
    if plain and any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ProtocolError(where, "must not contain control characters")
    return value


def _int_in(value: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(where, f"expected int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ProtocolError(where, f"must be in [{lo}, {hi}], got {value}")
    return value


def _finite(value: Any, where: str, bound: float = float("inf")) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(where, f"expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or abs(value) > bound:
        raise ProtocolError(where, f"must be finite{'' if bound == float('inf') else f' and |x| <= {bound:g}'}, "
                                   f"got {value!r}")
    return float(value)


def _sha256_hex(value: Any, where: str) -> str:
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX:
        raise ProtocolError(where, "must be a SHA-256 hex digest (64 lowercase hex characters)")
    return value


# ----------------------------------------------------------------------------- sample metadata


def temperature_mismatch(sample_temperature: float, policy_temperature: float) -> bool:
    """Whether a sample generated at ``sample_temperature`` cannot be trained by a policy whose
    log-probs are computed at ``policy_temperature`` (the behaviour log-probs would belong to a
    different distribution, so the importance ratio would be wrong): the two differ by more than
    :data:`TEMPERATURE_RTOL` of ``max(1, policy_temperature)``."""
    return abs(float(sample_temperature) - float(policy_temperature)) > (
        TEMPERATURE_RTOL * max(1.0, float(policy_temperature)))


def check_sample_metadata(metadata: Any, where: str, temperature: float | None = None,
                          trained: bool = True) -> None:
    """Refuse sample metadata that a consumer of the sample would fail on, naming the field.

    What is checked, and why:

    * ``temperature`` (what the trainer reads: ``collate_batch`` takes it, ``check_batch``
      compares it with the policy's own temperature and raises on a mismatch): absent or null,
      or a finite number >= 0 -- and > 0 on a ``trained`` sample, whose log-probs the trainer
      recomputes at a positive temperature; with ``temperature`` (the policy's, e.g. the
      dataflow's ``temperatures`` config) it must match it (:func:`temperature_mismatch`). So a
      sample the trainer would refuse is refused at the door instead of stopping the trainer.
    * ``attempt`` (eval summaries read ``int(attempt)``): absent, or an int in
      ``[0, MAX_METADATA_COUNT]``.
    * ``tool_calls``, ``turns`` and every value of ``tool_errors`` (the dataflow sums them into
      64-bit counters when they are ints): when an int, at most :data:`MAX_METADATA_COUNT`.

    Anything else in the metadata is the workflow's own business and is left alone.
    Raises :class:`ProtocolError` with ``field`` = ``{where}.metadata.<key>``.
    """
    if not isinstance(metadata, dict):
        raise ProtocolError(f"{where}.metadata", f"expected a map, got {type(metadata).__name__}")
    t = metadata.get("temperature")
    at = f"{where}.metadata.temperature"
    if t is not None:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ProtocolError(at, f"must be the sampling temperature (a finite number >= 0), "
                                    f"got {t!r}; the workflow writes the temperature it sampled at")
        if trained and t == 0:
            raise ProtocolError(at, "is 0 (greedy) on a train sample: its log-probs cannot be "
                                    "matched by a trainer (temperature > 0); sample train tasks "
                                    "at the policy's temperature")
        if trained and temperature is not None and temperature_mismatch(t, temperature):
            raise ProtocolError(at, (
                f"sample temperature {t:g} != the policy's temperature {temperature:g}: the "
                "behaviour log-probs were computed at the sampling temperature, so the ratio "
                "would be wrong and the trainer would refuse the batch; set the workflow's "
                f"sampling temperature to {temperature:g}, or the policy's temperature "
                f"(model.init_args.temperature and the dataflow's temperatures) to {t:g}"))
    attempt = metadata.get("attempt")
    if attempt is not None and (isinstance(attempt, bool) or not isinstance(attempt, int)
                                or not 0 <= attempt <= MAX_METADATA_COUNT):
        raise ProtocolError(f"{where}.metadata.attempt",
                            f"must be an int in [0, {MAX_METADATA_COUNT}] (0: a first attempt), "
                            f"got {attempt!r}")
    counts = [(k, metadata.get(k)) for k in ("tool_calls", "turns")]
    errors = metadata.get("tool_errors")
    if isinstance(errors, dict):
        counts += [(f"tool_errors.{k}", v) for k, v in errors.items()]
    for key, value in counts:
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_METADATA_COUNT:
            raise ProtocolError(f"{where}.metadata.{str(key)[:64]}",
                                f"{value} exceeds {MAX_METADATA_COUNT}; an episode count this "
                                "large is a bug in the workflow")
