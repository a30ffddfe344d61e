"""Request bodies of the dataflow's HTTP face: read within ``max_body_bytes``, decoded from
msgpack, each field checked, and answered in msgpack.

Every msgpack body is read through :func:`read_body` (413 before parsing once it exceeds the
limit) and decoded by :func:`decode_map` (:func:`astralight.protocol.decode` refuses anything
but plain msgpack values: no extension types, no object arrays, bounded nesting). A route then
accepts only its own fields (:func:`only_fields`: an unknown field is a 422), each read with its
type, range and length checked (:func:`field`, :func:`id_field`, :func:`int_field`,
:func:`num_field`, :func:`check_json_value`): ids are 1..256 printable characters, counts and
versions fit SQLite's integers, every float is finite. A refusal is a
:class:`~astralight.protocol.ProtocolError` naming the field.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from astralight.dataflow.errors import ServiceError
from astralight.dataflow.http_stats import note_request
from astralight.protocol import MAX_VERSION, ProtocolError, decode, encode

MSGPACK = "application/msgpack"
_REQUIRED = object()

MAX_ID_LEN = 256  # instance, task, batch, trainer ids
MAX_COUNT = 1_000_000  # capacities and in-flight counts
MAX_LIST = 4096  # model_ids or task_ids in one request
MAX_SECONDS = 1e7  # timings and timeouts
MAX_INT64 = (1 << 63) - 1


def msgpack_response(obj: Any, status: int = 200) -> Response:
    return Response(encode(obj), status_code=status, media_type=MSGPACK)


def field(msg: dict, name: str, types: type | tuple, default: Any = _REQUIRED) -> Any:
    """Read one request field, raising ProtocolError(name) if it is missing or mistyped."""
    if msg.get(name) is None:
        if default is _REQUIRED:
            raise ProtocolError(name, "is required")
        return default
    value = msg[name]
    allowed = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        names = "/".join(t.__name__ for t in allowed)
        raise ProtocolError(name, f"expected {names}, got {type(value).__name__}")
    return value


def check_id(value: Any, name: str) -> str:
    """An id (instance, task, batch, trainer, model): 1..MAX_ID_LEN printable characters."""
    if not isinstance(value, str):
        raise ProtocolError(name, f"expected str, got {type(value).__name__}")
    if not 0 < len(value) <= MAX_ID_LEN:
        raise ProtocolError(name, f"must be 1..{MAX_ID_LEN} characters, got {len(value)}")
    if not value.isprintable():
        raise ProtocolError(name, "must hold printable characters only")
    return value


def id_field(msg: dict, name: str, default: Any = _REQUIRED) -> Any:
    value = field(msg, name, str, default)
    return value if value is default and default is not _REQUIRED else check_id(value, name)


def int_field(msg: dict, name: str, lo: int, hi: int, default: Any = _REQUIRED) -> Any:
    value = field(msg, name, int, default)
    if value is not default and not lo <= value <= hi:
        raise ProtocolError(name, f"must be in [{lo}, {hi}], got {value}")
    return value


def num_field(msg: dict, name: str, lo: float, hi: float, default: Any = _REQUIRED) -> Any:
    """A finite number in ``[lo, hi]`` (ints accepted), as float."""
    value = field(msg, name, (int, float), default)
    if value is default:
        return value
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ProtocolError(name, f"must be a finite number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def only_fields(msg: dict, allowed: tuple[str, ...]) -> dict:
    """Refuse fields a route does not know (a typo would otherwise be ignored silently)."""
    for key in msg:
        if key not in allowed:
            raise ProtocolError(str(key)[:64], f"unknown field; this route takes {list(allowed)}")
    return msg


def check_json_value(value: Any, name: str, depth: int = 0) -> Any:
    """Free-form metadata stored as JSON: str keys; str, int64, finite float, bool, nil, lists
    and maps only (no bytes, no arrays, no NaN)."""
    if depth > 16:
        raise ProtocolError(name, "nested deeper than 16 levels")
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        if not -MAX_INT64 - 1 <= value <= MAX_INT64:
            raise ProtocolError(name, "integer does not fit 64 signed bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ProtocolError(name, f"must be finite, got {value!r}")
        return value
    if isinstance(value, list):
        for i, v in enumerate(value):
            check_json_value(v, f"{name}[{i}]", depth + 1)
        return value
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError(name, f"keys must be strings, got {type(k).__name__}")
            check_json_value(v, f"{name}.{k}", depth + 1)
        return value
    raise ProtocolError(name, f"{type(value).__name__} is not allowed here (JSON values only)")


def check_version(version: int, name: str = "version") -> int:
    if not 0 <= version <= MAX_VERSION:
        raise ProtocolError(name, f"must be in [0, {MAX_VERSION}], got {version}")
    return version


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it exceeds ``limit`` bytes."""
    declared = request.headers.get("content-length")
    too_big = ServiceError(413, "body", f"request body exceeds max_body_bytes={limit}")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise too_big
    return bytes(buf)


def decode_map(data: bytes, limit: int, allowed: tuple[str, ...] | None = None) -> dict:
    """Decode a request map; with ``allowed``, refuse any other field. An ``instance_id`` in it
    is noted for :class:`~astralight.dataflow.http_stats.ClientStats`."""
    msg = decode(data, max_bytes=limit)
    if not isinstance(msg, dict):
        raise ProtocolError("body", "expected a map of request fields")
    iid = msg.get("instance_id")
    if isinstance(iid, str) and 0 < len(iid) <= MAX_ID_LEN and iid.isprintable():
        note_request(instance_id=iid)
    if allowed is not None:
        only_fields(msg, allowed)
    return msg


def msgpack_post(app: FastAPI, path: str, limit: int, handler: Callable[[bytes], Any],
                 then: Callable[[Any], None] | None = None) -> None:
    """Route ``POST path``: its body (within ``limit`` bytes, :func:`read_body`) goes to
    ``handler`` in the thread pool (it blocks on SQLite commits), whose result is the msgpack
    answer. ``then(result)`` runs on the event loop after a handler that succeeded (e.g. a
    wake-up of long polls: :class:`~astralight.dataflow.http_wakeups.Wakeups`)."""

    async def endpoint(request: Request):
        result = await run_in_threadpool(handler, await read_body(request, limit))
        if then is not None:
            then(result)
        return msgpack_response(result)

    endpoint.__name__ = endpoint.__qualname__ = handler.__name__.lstrip("_")
    endpoint.__doc__ = handler.__doc__
    app.post(path)(endpoint)
