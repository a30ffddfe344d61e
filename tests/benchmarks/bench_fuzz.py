"""Fuzz benchmark: thousands of generated bad requests against a real dataflow service process.

    python tests/benchmarks/bench_fuzz.py --json [--requests 10000] [--seed 0]

Starts ``python -m astralight.dataflow.service`` on 127.0.0.1 with small body limits and with
``ASTRALIGHT_TOKEN`` next to the scoped tokens ``ASTRALIGHT_ROLLOUT_TOKEN``,
``ASTRALIGHT_TRAINER_TOKEN`` and ``ASTRALIGHT_ADMIN_TOKEN`` (16+ characters each), prepares some
state with ``ASTRALIGHT_TOKEN`` (two registered instances, each with its instance secret: the
first holding a pushed and an open task, the second an open task; a published weight version),
then sends seeded, generated bad requests over every route, each drawn from one category of
:data:`CATEGORIES` (they share the request count):

* input: ``garbage`` bytes, ``malformed_msgpack``, ``wrong_type``, ``unknown_field``,
  ``huge_array`` (huge or inconsistent arrays), ``negative_size`` (negative and out-of-range
  sizes), ``unknown_model``, ``replayed_push``, ``out_of_order_version``, ``pickle_or_ext``
  (pickle payloads / msgpack extension types / object arrays), ``oversized`` bodies,
  ``bad_path`` (bad paths and methods), ``bad_sample`` (semantically bad samples) and ``auth``
  (missing or wrong tokens);
* the defects of issue 18: weight file names too long in bytes or with control characters
  (``weight_name``), samples that would never go stale (``never_stale``), log-probs below the
  floor (``extreme_logprob``), versions beyond ``max_version_jump`` (``version_jump``), token ids
  outside the vocabulary (``token_out_of_vocab``), samples longer than the engine's context
  (``oversized_sample``, against the limits the fuzz instance registers) and sample metadata the
  trainer would refuse (``bad_metadata``);
* the access model of issue 18, each a well-formed request with one thing wrong, which must get
  exactly one answer: ``scope`` (a rollout or trainer token, unbound or bound to this model_id,
  on a route its scope does not grant: 403 ``authorization``), ``instance_secret``
  (heartbeat, lease, deregister, return, drain or a new registration of one instance with no
  secret, the other instance's, a made-up one or its own altered: 403 ``instance_secret``),
  ``foreign_task`` (an instance pushing the task the other one holds: 409 ``task_id``),
  ``origin`` (any route with an ``Origin`` header, with or without a token: 403 ``origin``)
  and ``content_type`` (a registration, or another body or a weight upload, sent as text/plain,
  a form, multipart, JSON or without a type: 415 ``content-type``).

After the requests, ``killed_upload`` kills the service (``kill -9``) in the middle of a weight
upload, restarts it on the same state and counts the temporary upload files left behind (each
one an ``accepted_bad``); ``host`` sends requests with DNS-rebinding ``Host`` names to a second
service that has no token (each must be 403 ``host``; :func:`host_drill`); ``bound_model``
sends a trainer token bound to ``policy`` acting on ``other`` to a third service with both
model_ids (each must be 403 ``model_id``; :func:`bound_model_drill`); ``token_start``
starts the service with a blank token and on a public address with a short one (each must exit
2 without serving; :func:`token_start_drill`); ``slow_headers`` stalls 300 connections with half
a request head on a fourth service (``max_connections`` 128, ``header_timeout_s`` 3), then every
valid request must be answered and every stalled connection closed (:func:`slow_headers_drill`).
``openai`` sends the RaaS's OpenAI endpoint lone surrogates, 5,000-digit integers, calls whose
completion holds an unreadable tool call and 8 MiB conversations, and watches its episode loop
for freezes (issue 41, items 2, 4 and 8; :func:`openai_drill`).

It prints ``requests``, ``status_5xx`` (must be 0), ``crashes`` (the process died or stopped
answering ``/v1/info``: must be 0), ``accepted_bad`` (must be 0: a bad request answered 2xx --
a replayed push must be answered ``duplicate`` with nothing accepted --, plus every entry of
``state_changed``, the counters and instances of ``/v1/stats`` (:func:`state_of`) that differ
after the requests), ``unexpected_status`` (an access request refused with another status or
field than its own: reported, not part of the exit status), requests per second and a
per-category breakdown; exit status 1 if any of the three is not 0.

The generators are plain functions of a seeded :class:`random.Random` and a :class:`Context`,
shared with ``tests/unit/test_route_fuzz.py`` (which drives them with hypothesis against the
in-process app, with the same tokens and instances, and asserts the access categories' exact
answers); :data:`ROUTES` lists every route with its generators (:data:`ACCESS_ROUTES` the access
categories'), and that test checks the list against the app's routes so a new route cannot
escape fuzzing.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np

from astralight.dataflow import auth
from astralight.dataflow.auth import trainer_token
from astralight.launch.proc import stop_process
from astralight.protocol import LOGPROB_FLOOR, MAX_VOCAB_SIZE, Sample, WeightManifest, encode

MSGPACK = {"Content-Type": "application/msgpack"}
GHOST = "ghost-model"
#: what the fuzz instance registers for its engine (``limits``): the valid samples stay inside
LIMITS = {"vocab_size": 1000, "max_model_len": 64}
#: the policy temperature the benchmark's service is configured with (``temperatures``)
TEMPERATURE = 1.0


@dataclass
class BadRequest:
    category: str
    method: str
    path: str
    body: Any = None  # bytes, an iterator of bytes (chunked upload) or None
    headers: dict = field(default_factory=dict)
    replay: bool = False  # a replayed push: 200 with duplicate=True and accepted=0 is right
    no_auth: bool = False  # the generator sets (or omits) Authorization itself
    expect: int | None = None  # the one right answer's status (access categories), if any
    expect_field: str | None = None  # ... and the field its JSON error names


@dataclass
class Context:
    """State the generators aim at (set up by :func:`prepare`)."""

    token: str
    model_id: str
    instance_id: str
    pushed_task: str
    pushed_body: bytes
    open_task: str
    group_size: int
    version: int
    file_name: str
    file_bytes: int
    max_body_bytes: int
    max_weight_file_bytes: int
    max_version_jump: int = 1000
    temperature: float | None = None  # the service's temperatures[model_id], if configured
    # the access model (set when the service has scoped tokens, see :func:`prepare`)
    rollout_token: str = ""
    trainer_token: str = ""  # ASTRALIGHT_TRAINER_TOKEN itself (every model_id)
    admin_token: str = ""
    instance_secret: str = ""  # instance_id's, answered by its registration
    other_instance: str = ""  # a second instance, with a secret and an open task of its own
    other_secret: str = ""
    other_task: str = ""

    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def scoped(self) -> bool:
        """Whether the access categories that need scoped tokens and two instances can run."""
        return bool(self.rollout_token and self.trainer_token and self.instance_secret
                    and self.other_secret and self.other_task)


# ----------------------------------------------------------------------------- building blocks


def raw(obj: Any) -> Any:
    """The plain msgpack structure of a message (dataclasses as tagged maps), to mutate."""
    return msgpack.unpackb(encode(obj), raw=False)


def pack(env: Any) -> bytes:
    return msgpack.packb(env, use_bin_type=True)


def envelope(body: Any) -> dict:
    return {"schema": 1, "body": body}


def sample(ctx: Context, task_id: str, index: int = 0, T: int = 6, reward: float = 1.0,
           version: int = 0, model_id: str | None = None) -> Sample:
    gen = T - 3
    return Sample(task_id=task_id, sample_index=index, model_id=model_id or ctx.model_id,
                  token_ids=np.arange(T, dtype=np.int32) + 3,
                  logprobs=np.array([0, 0, 0] + [-0.5] * gen, np.float32),
                  loss_mask=np.array([0, 0, 0] + [1] * gen, np.uint8),
                  versions=np.array([-1, -1, -1] + [version] * gen, np.int32),
                  reward=float(reward), prompt_len=3)


def push_env(ctx: Context, samples: list, task_id: str | None = None) -> dict:
    """A raw push envelope for ``task_id`` (default: the open task) to mutate."""
    return raw({"instance_id": ctx.instance_id,
                "task_id": ctx.open_task if task_id is None else task_id,
                "samples": samples})


def push_item(body: dict) -> dict:
    """A raw push body as one item of a push_many body: everything but its ``instance_id``."""
    return {k: v for k, v in body.items() if k != "instance_id"}


def as_push_many(rng: random.Random, req: BadRequest) -> BadRequest:
    """The same bad push sent as ``POST /v1/push_many``: its body as the one item (or repeated:
    every item bad), its ``instance_id`` the request's. Bodies that are not a push map (garbage,
    malformed envelopes) stay pushes; the generic generators reach push_many directly."""
    try:
        env = msgpack.unpackb(req.body, raw=False, strict_map_key=False)
    except Exception:
        return req
    if not (isinstance(env, dict) and isinstance(env.get("body"), dict)
            and set(env) == {"schema", "body"}):
        return req
    body = env["body"]
    many = {"items": [push_item(body)] * rng.choice([1, 1, 2, 3])}
    if "instance_id" in body:
        many = {"instance_id": body["instance_id"], **many}
    return BadRequest(req.category, "POST", "/v1/push_many", pack({**env, "body": many}),
                      dict(req.headers), replay=req.replay, no_auth=req.no_auth,
                      expect=req.expect, expect_field=req.expect_field)


def valid_group(ctx: Context, task_id: str | None = None) -> list[Sample]:
    return [sample(ctx, task_id or ctx.open_task, i, reward=float(i % 2))
            for i in range(ctx.group_size)]


def manifest(ctx: Context, version: int, kind: str = "full", base: int | None = None,
             sha: str | None = None, model_id: str | None = None,
             name: str | None = None) -> WeightManifest:
    return WeightManifest(model_id=model_id or ctx.model_id, version=version, kind=kind,
                          base_version=base,
                          files={name or ctx.file_name: {"sha256": sha or "0" * 64,
                                                         "bytes": ctx.file_bytes}})


#: msgpack map bodies: route -> {field: kind}; kinds drive the wrong-type mutations
SCHEMAS: dict[str, dict[str, str]] = {
    "/v1/register": {"model_ids": "list_str", "capacity": "int", "instance_id": "str",
                     "meta": "dict", "capacity_units": "num", "limits": "dict"},
    "/v1/heartbeat": {"instance_id": "str", "in_flight": "int"},
    "/v1/return": {"instance_id": "str", "task_ids": "list_str", "failed": "bool"},
    "/v1/deregister": {"instance_id": "str"},
    "/v1/lease": {"instance_id": "str", "max_tasks": "int"},
    "/v1/push": {"instance_id": "str", "task_id": "str", "samples": "list"},
    "/v1/push_many": {"instance_id": "str", "items": "list"},
    "/v1/pull": {"model_id": "str", "size": "int", "timeout_s": "num", "trainer_id": "str"},
    "/v1/ack": {"batch_id": "str", "wait_s": "num", "step_s": "num", "step": "int"},
    "/v1/batches/extend": {"batch_id": "str"},
    "/v1/trainer/resumed": {"model_id": "str", "step": "int"},
    "/v1/eval": {"model_id": "str", "version": "int"},
}
BODY_ROUTES = list(SCHEMAS) + ["/v1/publish"]


def base_body(ctx: Context, path: str) -> dict:
    """A valid-looking body of ``path`` that the generators make invalid in one place."""
    return {
        "/v1/register": {"model_ids": [ctx.model_id], "capacity": 1, "instance_id": ctx.instance_id,
                         "meta": {"host": "fuzz"}, "capacity_units": 1.0,
                         "limits": {ctx.model_id: dict(LIMITS)}},
        "/v1/heartbeat": {"instance_id": ctx.instance_id, "in_flight": 0},
        "/v1/return": {"instance_id": ctx.instance_id, "task_ids": ["no-such-task"],
                       "failed": False},
        "/v1/deregister": {"instance_id": ctx.instance_id},
        "/v1/lease": {"instance_id": ctx.instance_id, "max_tasks": 0},
        "/v1/push": push_env(ctx, valid_group(ctx))["body"],
        "/v1/push_many": {"instance_id": ctx.instance_id, "items": [
            push_item(push_env(ctx, valid_group(ctx))["body"])]},
        "/v1/pull": {"model_id": ctx.model_id, "size": 1, "timeout_s": 0.0, "trainer_id": "t"},
        "/v1/ack": {"batch_id": "no-such-batch", "wait_s": 0.1, "step_s": 0.2, "step": 1},
        "/v1/trainer/resumed": {"model_id": ctx.model_id, "step": 10**6},
        "/v1/batches/extend": {"batch_id": "no-such-batch"},
        "/v1/eval": {"model_id": ctx.model_id, "version": ctx.version},
        "/v1/publish": raw(manifest(ctx, ctx.version + 1))["body"],
    }[path]


def wrong_value(rng: random.Random, kind: str) -> Any:
    """A value that is not of ``kind`` (and not nil, which means 'absent')."""
    pool: list[Any] = [1, -7, 2**64 - 1, 1.5, float("nan"), True, False, "x", "", b"\x80abc",
                       [], [1, "a"], {}, {"k": 1}]
    bad = {
        "str": lambda v: not isinstance(v, str),
        "int": lambda v: isinstance(v, bool) or not isinstance(v, int),
        "num": lambda v: isinstance(v, bool) or not isinstance(v, (int, float))
        or (isinstance(v, float) and math.isnan(v)),
        "bool": lambda v: not isinstance(v, bool),
        "dict": lambda v: not isinstance(v, dict),
        "list": lambda v: not isinstance(v, list) or v == [1, "a"],
        "list_str": lambda v: not isinstance(v, list) or v == [1, "a"],
    }[kind]
    return rng.choice([v for v in pool if bad(v)])


def mutate_map(rng: random.Random, ctx: Context, path: str) -> bytes:
    body = base_body(ctx, path)
    name = rng.choice(sorted(SCHEMAS[path]))
    body[name] = wrong_value(rng, SCHEMAS[path][name])
    return pack(envelope(body))


def pickle_blob(rng: random.Random) -> bytes:
    class Boom:  # would print if ever unpickled: the test asserts nothing unpickles
        def __reduce__(self):
            return (print, ("UNPICKLED CLIENT DATA",))

    obj = rng.choice([{"instance_id": "x"}, [1, 2, 3], Boom(), np.arange(3),
                      np.array([object()], dtype=object)])
    try:
        return pickle.dumps(obj, protocol=rng.randint(0, pickle.HIGHEST_PROTOCOL))
    except Exception:
        return pickle.dumps({"fallback": 1})


def object_array(rng: random.Random) -> dict:
    """A numpy object-dtype array as the wire would carry one (never allowed)."""
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    data = rng.choice([buf.getvalue(), pickle.dumps(np.array([1], dtype=object)), b"\x00" * 8])
    return {"__nd__": True, "dtype": rng.choice(["object", "O", "|O", "<f8", "V8", "S4", "float128"]),
            "shape": [1], "data": data}


def ext_value(rng: random.Random) -> Any:
    return rng.choice([msgpack.ExtType(rng.randint(0, 127), rng.randbytes(rng.randint(0, 16))),
                       msgpack.Timestamp(rng.randint(0, 2**32), 0)])


# ----------------------------------------------------------------------------- categories


def gen_garbage(rng: random.Random, ctx: Context) -> BadRequest:
    path = rng.choice(BODY_ROUTES)
    n = rng.choice([0, 1, 2, 7, 64, 1000])
    data = rng.randbytes(n)
    if n and (0x80 <= data[0] <= 0x8f or data[0] in (0xde, 0xdf)):
        data = b"\xc1" + data  # a random map header might decode; 0xc1 never does
    return BadRequest("garbage", "POST", path, data or b"", dict(MSGPACK))


def gen_malformed(rng: random.Random, ctx: Context) -> BadRequest:
    path = rng.choice(BODY_ROUTES)
    good = pack(envelope(base_body(ctx, path)))
    how = rng.randrange(7)
    if how == 0:
        data = good[:rng.randrange(len(good))]  # truncated: never a whole object
    elif how == 1:
        data = good + rng.randbytes(rng.randint(1, 8))  # trailing bytes
    elif how == 2:
        data = b"\xc1" + good  # never-used lead byte
    elif how == 3:
        data = pack(rng.choice([[1, 2], 5, "body", None, {"body": base_body(ctx, path)}]))
    elif how == 4:
        data = pack({"schema": rng.choice([0, 2, -1, "1", 1.0 + 1e-9, [1]]),
                     "body": base_body(ctx, path)})
    elif how == 5:
        data = pack(envelope(rng.choice([[base_body(ctx, path)], "x", 3, None])))
    else:
        data = pack({"schema": 1})  # no body
    return BadRequest("malformed_msgpack", "POST", path, data, dict(MSGPACK))


def gen_wrong_type(rng: random.Random, ctx: Context) -> BadRequest:
    path = rng.choice(BODY_ROUTES)
    if path == "/v1/publish":
        m = base_body(ctx, path)
        key = rng.choice(["model_id", "version", "kind", "files", "base_version", "tensors",
                          "created", "metadata", "files.sha256", "files.bytes", "__type__"])
        if key == "files.sha256":
            m["files"][ctx.file_name]["sha256"] = rng.choice([1, b"ab", "xyz", "A" * 64, None])
        elif key == "files.bytes":
            m["files"][ctx.file_name]["bytes"] = rng.choice(["10", -1, 1.5, [1]])
        elif key == "__type__":
            m["__type__"] = rng.choice(["Task", "Sample", "Nope", 3, ["WeightManifest"]])
        elif key == "kind":
            m["kind"] = rng.choice([1, "partial", "", b"full"])
        elif key == "base_version":
            m["base_version"] = rng.choice(["0", 1.5, -1, [0]])
        elif key == "tensors":
            m["tensors"] = rng.choice([[1], "t", {"w": 1}, {"w": {"dtype": "bf16", "shape": "2"}}])
        else:
            m[key] = wrong_value(rng, {"model_id": "str", "version": "int", "files": "dict",
                                       "created": "num", "metadata": "dict"}[key])
        return BadRequest("wrong_type", "POST", path, pack(envelope(m)), dict(MSGPACK))
    if path == "/v1/push" and rng.random() < 0.5:  # a wrong type inside a sample
        env = push_env(ctx, valid_group(ctx))
        s = rng.choice(env["body"]["samples"])
        key = rng.choice(["task_id", "sample_index", "model_id", "token_ids", "logprobs",
                          "loss_mask", "versions", "reward", "prompt_len", "group_index", "role",
                          "advantage", "metadata", "__type__"])
        s[key] = {"token_ids": [1, 2, 3], "logprobs": "x", "loss_mask": 1, "versions": None,
                  "task_id": 5, "model_id": ["policy"], "sample_index": "0", "reward": "1.0",
                  "prompt_len": 1.5, "group_index": [0], "role": 3, "advantage": "0",
                  "metadata": [1], "__type__": "Task"}[key]
        if key == "versions":  # nil would mean 'absent' for an optional field; this one is required
            s.pop("versions")
        return BadRequest("wrong_type", "POST", path, pack(env), dict(MSGPACK))
    return BadRequest("wrong_type", "POST", path, mutate_map(rng, ctx, path), dict(MSGPACK))


def gen_unknown_field(rng: random.Random, ctx: Context) -> BadRequest:
    path = rng.choice(list(SCHEMAS))
    body = base_body(ctx, path)
    body[rng.choice(["extra", "instanceId", "__proto__", "max_task", "Model_id", "x" * 40])] = 1
    return BadRequest("unknown_field", "POST", path, pack(envelope(body)), dict(MSGPACK))


def gen_huge_array(rng: random.Random, ctx: Context) -> BadRequest:
    env = push_env(ctx, valid_group(ctx))
    s = rng.choice(env["body"]["samples"])
    name = rng.choice(["token_ids", "logprobs", "loss_mask", "versions"])
    arr = s[name]
    how = rng.randrange(7)
    if how == 0:
        arr["shape"] = [rng.choice([2**26 + 1, 2**40, 2**63 - 1, 2**64 - 1])]
    elif how == 1:
        arr["shape"] = [0, rng.choice([2**62, 2**64 - 1])]  # zero elements, absurd extent
    elif how == 2:
        arr["shape"] = [1] * rng.choice([9, 33, 70])
    elif how == 3:
        arr["data"] = arr["data"][:-1]  # byte count does not match the shape
    elif how == 4:
        arr["shape"] = [arr["shape"][0] + rng.randint(1, 5)]  # claims more than it holds
    elif how == 5:
        arr["shape"], arr["data"] = [2, arr["shape"][0]], arr["data"] * 2  # two-dimensional
    else:  # consistent but longer than the other arrays
        extra = rng.randint(1, 64)
        arr["shape"] = [arr["shape"][0] + extra]
        arr["data"] = arr["data"] + bytes(extra * {"token_ids": 4, "logprobs": 4, "loss_mask": 1,
                                                   "versions": 4}[name])
    return BadRequest("huge_array", "POST", "/v1/push", pack(env), dict(MSGPACK))


def gen_negative_size(rng: random.Random, ctx: Context) -> BadRequest:
    big = [-1, -(2**63), 2**63, 2**64 - 1]
    how = rng.randrange(12)
    if how == 0:
        body = base_body(ctx, "/v1/lease") | {"max_tasks": rng.choice(big + [4097, 10**9])}
        return BadRequest("negative_size", "POST", "/v1/lease", pack(envelope(body)), dict(MSGPACK))
    if how == 1:
        body = base_body(ctx, "/v1/pull") | rng.choice(
            [{"size": rng.choice(big + [0, 10**7])},
             {"timeout_s": rng.choice([-1.0, -1e-9, float("nan"), float("inf"), 1e300])}])
        return BadRequest("negative_size", "POST", "/v1/pull", pack(envelope(body)), dict(MSGPACK))
    if how == 2:
        body = base_body(ctx, "/v1/register") | rng.choice(
            [{"capacity": rng.choice(big + [10**7])},
             {"capacity_units": rng.choice([0, -1, 1e6, 1e308, float("nan"), float("-inf")])}])
        return BadRequest("negative_size", "POST", "/v1/register", pack(envelope(body)),
                          dict(MSGPACK))
    if how == 3:
        body = base_body(ctx, "/v1/heartbeat") | {"in_flight": rng.choice(big + [10**7])}
        return BadRequest("negative_size", "POST", "/v1/heartbeat", pack(envelope(body)),
                          dict(MSGPACK))
    if how == 4:
        if rng.random() < 0.3:  # a negative or oversized optimizer step
            path = rng.choice(["/v1/ack", "/v1/trainer/resumed"])
            body = base_body(ctx, path) | {"step": rng.choice([-1, -(2**63), 2**63, 2**64 - 1])}
            return BadRequest("negative_size", "POST", path, pack(envelope(body)), dict(MSGPACK))
        body = base_body(ctx, "/v1/ack") | {rng.choice(["wait_s", "step_s"]):
                                            rng.choice([-1, -0.5, 1e7, 1e300, float("nan")])}
        return BadRequest("negative_size", "POST", "/v1/ack", pack(envelope(body)), dict(MSGPACK))
    if how == 5:
        env = push_env(ctx, valid_group(ctx))
        s = rng.choice(env["body"]["samples"])
        key, value = rng.choice([("sample_index", rng.choice(big)), ("prompt_len", -1),
                                 ("prompt_len", 10**6), ("group_index", rng.choice(big))])
        if key == "group_index" and 0 <= value <= 2**62:
            value = -1
        s[key] = value
        return BadRequest("negative_size", "POST", "/v1/push", pack(env), dict(MSGPACK))
    if how == 6:
        env = push_env(ctx, valid_group(ctx))
        s = rng.choice(env["body"]["samples"])
        s[rng.choice(["token_ids", "versions"])]["shape"] = [rng.choice([-1, -(2**63)])]
        return BadRequest("negative_size", "POST", "/v1/push", pack(env), dict(MSGPACK))
    if how == 7:
        v = rng.choice([-1, 2**53, 2**70, -(2**63)])
        method, path = rng.choice([("GET", f"/v1/manifest/{ctx.model_id}/{v}"),
                                   ("GET", f"/v1/weights/{ctx.model_id}/{v}/{ctx.file_name}"),
                                   ("PUT", f"/v1/weights/{ctx.model_id}/{v}/{ctx.file_name}")])
        return BadRequest("negative_size", method, path, b"x" if method == "PUT" else None)
    if how == 8:
        q = rng.choice(["window=0", "window=-5", f"window={10**9}", "pool=-1", f"pool={10**30}",
                        f"window={2**64}", "window=1e3", "pool=abc"])
        return BadRequest("negative_size", "GET", f"/v1/balance/{ctx.model_id}?{q}")
    if how == 9:
        if rng.random() < 0.5:  # the completions of an eval: version and limit bounded
            q = rng.choice(["-1/completions", f"{2**80}/completions", "x/completions",
                            "0/completions?limit=0", "0/completions?limit=-3",
                            f"0/completions?limit={10**9}", "0/completions?limit=abc"])
            return BadRequest("negative_size", "GET", f"/v1/eval/{ctx.model_id}/{q}")
        q = rng.choice(["since=-1", f"since={2**80}", "since=x", "since=1.5"])
        return BadRequest("negative_size", "GET", f"/v1/counters/{ctx.model_id}?{q}")
    if how == 10:
        m = raw(manifest(ctx, ctx.version + 1))["body"]
        key, value = rng.choice([("version", -1), ("version", 2**64 - 1), ("base_version", -1),
                                 ("version", 2**53)])
        m[key] = value
        if rng.random() < 0.5:
            m["files"][ctx.file_name]["bytes"] = -1
        return BadRequest("negative_size", "POST", "/v1/publish", pack(envelope(m)), dict(MSGPACK))
    body = base_body(ctx, "/v1/return") | {"task_ids": ["t"] * 4097}
    return BadRequest("negative_size", "POST", "/v1/return", pack(envelope(body)), dict(MSGPACK))


def gen_unknown_model(rng: random.Random, ctx: Context) -> BadRequest:
    g = rng.choice([GHOST, "", "policy ", "POLICY", "p" * 300, "../policy", "policy\x00"])
    how = rng.randrange(12)
    if how == 0:
        body = base_body(ctx, "/v1/pull") | {"model_id": g}
        return BadRequest("unknown_model", "POST", "/v1/pull", pack(envelope(body)), dict(MSGPACK))
    if how == 1:
        body = base_body(ctx, "/v1/register") | {"model_ids": [g]}
        return BadRequest("unknown_model", "POST", "/v1/register", pack(envelope(body)),
                          dict(MSGPACK))
    if how == 2:
        group = valid_group(ctx)
        group[rng.randrange(len(group))].model_id = g or GHOST
        return BadRequest("unknown_model", "POST", "/v1/push", pack(push_env(ctx, group)),
                          dict(MSGPACK))
    if how == 3:
        return BadRequest("unknown_model", "POST", "/v1/publish",
                          encode(manifest(ctx, ctx.version + 1, model_id=g or GHOST)), dict(MSGPACK))
    if how == 4:
        return BadRequest("unknown_model", "PUT", f"/v1/weights/{_seg(g)}/{ctx.version + 1}/m.bin",
                          b"weights")
    if how == 5:
        body = base_body(ctx, "/v1/trainer/resumed") | {"model_id": g}
        return BadRequest("unknown_model", "POST", "/v1/trainer/resumed", pack(envelope(body)),
                          dict(MSGPACK))
    route = rng.choice([f"/v1/eval/{_seg(g)}", f"/v1/eval/{_seg(g)}/0/completions",
                        f"/v1/balance/{_seg(g)}", f"/v1/counters/{_seg(g)}",
                        f"/v1/version/{_seg(g)}", f"/v1/manifest/{_seg(g)}/latest",
                        f"/v1/manifest/{_seg(g)}/1", f"/v1/weights/{_seg(g)}/1/{ctx.file_name}"])
    return BadRequest("unknown_model", "GET", route)


def _seg(name: str) -> str:
    """``name`` as one URL path segment (empty becomes a missing segment: still a bad request)."""
    from urllib.parse import quote

    return quote(name or GHOST, safe="")


def gen_replay(rng: random.Random, ctx: Context) -> BadRequest:
    if rng.random() < 0.5:
        body = ctx.pushed_body  # the exact push again
    else:  # the same task with other samples: still a duplicate, nothing accepted
        group = valid_group(ctx, ctx.pushed_task)
        for s in group:
            s.reward = rng.uniform(-1, 1)
        body = encode({"instance_id": ctx.instance_id, "task_id": ctx.pushed_task,
                       "samples": group})
    return BadRequest("replayed_push", "POST", "/v1/push", body, dict(MSGPACK), replay=True)


def gen_out_of_order(rng: random.Random, ctx: Context) -> BadRequest:
    how = rng.randrange(6)
    if how == 0:  # a version not newer than the current one
        v = rng.randint(0, ctx.version)
        return BadRequest("out_of_order_version", "POST", "/v1/publish",
                          encode(manifest(ctx, v)), dict(MSGPACK))
    if how == 1:  # a delta onto a base that is not published
        v = ctx.version + rng.randint(2, 9)
        return BadRequest("out_of_order_version", "POST", "/v1/publish",
                          encode(manifest(ctx, v, "delta", base=v - 1)), dict(MSGPACK))
    if how == 2:  # a file for an already-published version (published versions are immutable)
        v = rng.randint(0, ctx.version)
        return BadRequest("out_of_order_version", "PUT",
                          f"/v1/weights/{ctx.model_id}/{v}/{ctx.file_name}", b"other bytes")
    if how == 3:  # a newer version whose file was never uploaded
        return BadRequest("out_of_order_version", "POST", "/v1/publish",
                          encode(manifest(ctx, ctx.version + rng.randint(1, 5),
                                          name=f"never-{rng.randrange(10**6)}.bin")),
                          dict(MSGPACK))
    if how == 4:  # a delta whose base is not below its version
        m = raw(manifest(ctx, ctx.version + 1, "full"))["body"]
        m.update(kind="delta", base_version=rng.choice([ctx.version + 1, ctx.version + 2, None]))
        return BadRequest("out_of_order_version", "POST", "/v1/publish", pack(envelope(m)),
                          dict(MSGPACK))
    # samples generated by a version newer than the published one
    group = valid_group(ctx)
    for s in group:
        s.versions[s.loss_mask.astype(bool)] = ctx.version + rng.randint(1, 100)
    return BadRequest("out_of_order_version", "POST", "/v1/push", pack(push_env(ctx, group)),
                      dict(MSGPACK))


def gen_pickle(rng: random.Random, ctx: Context) -> BadRequest:
    path = rng.choice(BODY_ROUTES)
    how = rng.randrange(5)
    if how == 0:
        data = pickle_blob(rng)  # a pickle instead of msgpack
    elif how == 1:  # an object-dtype array where an array (or any value) goes
        if path == "/v1/push":
            env = push_env(ctx, valid_group(ctx))
            s = rng.choice(env["body"]["samples"])
            s[rng.choice(["token_ids", "logprobs", "loss_mask", "versions"])] = object_array(rng)
            data = pack(env)
        else:
            body = base_body(ctx, path)
            body[rng.choice(sorted(body))] = object_array(rng)
            data = pack(envelope(body))
    elif how == 2:  # msgpack extension types / timestamps anywhere
        body = base_body(ctx, path)
        body[rng.choice(sorted(body) + ["meta", "extra"])] = ext_value(rng)
        data = pack(envelope(body))
    elif how == 3:  # a pickle where a string goes
        body = base_body(ctx, path)
        body[rng.choice(sorted(body))] = pickle_blob(rng)
        data = pack(envelope(body))
    else:  # a pickle inside sample metadata -> still refused? metadata is opaque: put it in an
        # array's data with an object dtype instead
        body = base_body(ctx, path)
        body["__nd__"] = True
        body.update(object_array(rng))
        data = pack(envelope(body))
    return BadRequest("pickle_or_ext", "POST", path, data, dict(MSGPACK))


def gen_oversized(rng: random.Random, ctx: Context) -> BadRequest:
    if rng.random() < 0.25:  # a weight file over max_weight_file_bytes (declared or chunked)
        n = ctx.max_weight_file_bytes + rng.randint(1, 4096)
        path = f"/v1/weights/{ctx.model_id}/{ctx.version + 1}/big-{rng.randrange(10**6)}.bin"
        if rng.random() < 0.5:
            return BadRequest("oversized", "PUT", path, bytes(n))
        chunk = bytes(65536)
        return BadRequest("oversized", "PUT", path,
                          _Chunks(chunk, n // len(chunk) + 1))
    path = rng.choice(BODY_ROUTES)
    n = ctx.max_body_bytes + rng.choice([1, 17, 4096])
    prefix = pack(envelope(base_body(ctx, path)))
    return BadRequest("oversized", "POST", path, prefix + bytes(n - len(prefix)), dict(MSGPACK))


class _Chunks:
    """A re-iterable chunked body (no Content-Length): the service must stop it at the limit."""

    def __init__(self, chunk: bytes, count: int):
        self.chunk, self.count = chunk, count

    def __iter__(self):
        for _ in range(self.count):
            yield self.chunk


def gen_bad_path(rng: random.Random, ctx: Context) -> BadRequest:
    m = ctx.model_id
    choices = [
        ("GET", f"/v1/manifest/{m}/abc"), ("GET", f"/v1/manifest/{m}/1.5"),
        ("GET", f"/v1/weights/{m}/x/{ctx.file_name}"),
        ("GET", f"/v1/weights/{m}/{ctx.version}/.hidden"),
        ("GET", f"/v1/weights/{m}/{ctx.version}/..%2F..%2Fetc%2Fpasswd"),
        ("GET", f"/v1/weights/{m}/{ctx.version}/{'n' * 300}"),
        ("PUT", f"/v1/weights/{m}/{ctx.version + 1}/.hidden"),
        ("PUT", f"/v1/weights/{m}/{ctx.version + 1}/{'n' * 300}"),
        ("PUT", f"/v1/weights/{m}/{ctx.version + 1}/a%5Cb"),
        ("POST", "/v1/instances/no-such-instance/drain"),
        ("POST", f"/v1/instances/{'i' * 300}/drain"),
        ("POST", "/v1/instances/a%01b/drain"),
        ("GET", "/v1/nope"), ("GET", "/v2/info"), ("GET", "/docs"), ("GET", "/openapi.json"),
        ("GET", "/admin"), ("GET", "/"), ("DELETE", "/v1/push"), ("GET", "/v1/push"),
        ("POST", "/v1/info"), ("PUT", "/v1/stats"), ("DELETE", f"/v1/weights/{m}/1/x"),
        ("PATCH", "/v1/register"), ("POST", f"/v1/version/{m}"),
    ]
    if rng.random() < 0.15:  # a malformed or unsatisfiable Range on a real weight file
        rg = rng.choice(["bytes=abc", "bytes=5-2", "bytes=99999-", "bytes=-0", "items=0-1",
                         "bytes=0-0,5-2"])
        return BadRequest("bad_path", "GET", f"/v1/weights/{m}/{ctx.version}/{ctx.file_name}",
                          headers={"Range": rg})
    method, path = rng.choice(choices)
    return BadRequest("bad_path", method, path, b"x" if method in ("PUT", "POST", "PATCH") else None)


def gen_bad_sample(rng: random.Random, ctx: Context) -> BadRequest:
    group = valid_group(ctx)
    s = rng.choice(group)
    how = rng.randrange(13)
    if how == 0:
        s.logprobs[-1] = rng.choice([0.5, 3.0])
    elif how == 1:
        s.loss_mask[-1] = rng.choice([2, 255])
    elif how == 2:
        s.token_ids[0] = -rng.randint(1, 2**31 - 1)
    elif how == 3:
        s.versions[0] = rng.choice([-2, -(2**31)])
    elif how == 4:
        s.prompt_len = s.num_tokens + rng.randint(1, 5)
    elif how == 5:
        group[-1].sample_index = group[0].sample_index  # repeated index
    elif how == 6:
        s.task_id = rng.choice([ctx.pushed_task, "other-task", ""])
    elif how == 7:  # more samples than a task may hold (n * max_samples_per_rollout=32)
        group = [sample(ctx, ctx.open_task, i) for i in range(ctx.group_size * 32 + 1)]
    elif how == 8:
        group = []
    elif how == 9:
        s.reward = rng.choice([1e10, -1e300, 1.7e308])
    elif how == 10:
        s.logprobs[-1] = rng.choice([float("nan"), float("-inf")])
    elif how == 11:
        env = push_env(ctx, group)
        env["body"]["samples"][0]["reward"] = rng.choice([float("nan"), float("inf")])
        return BadRequest("bad_sample", "POST", "/v1/push", pack(env), dict(MSGPACK))
    else:
        env = push_env(ctx, group, task_id=rng.choice(["no-such-task", "", "t" * 300]))
        return BadRequest("bad_sample", "POST", "/v1/push", pack(env), dict(MSGPACK))
    return BadRequest("bad_sample", "POST", "/v1/push", pack(push_env(ctx, group)), dict(MSGPACK))


def gen_auth(rng: random.Random, ctx: Context) -> BadRequest:
    """A request (often an otherwise valid one) with a missing or wrong token."""
    header = rng.choice([None, "", "Bearer", f"Bearer {ctx.token}x",
                         f"Bearer {ctx.token[:-1]}", f"bearer {ctx.token}", f"Basic {ctx.token}",
                         f"Bearer  {ctx.token}", ctx.token, "Bearer wrong"])
    method, path, body = rng.choice([
        ("GET", "/v1/info", None), ("GET", "/v1/stats", None),
        ("GET", f"/v1/version/{ctx.model_id}", None),
        ("GET", f"/v1/weights/{ctx.model_id}/{ctx.version}/{ctx.file_name}", None),
        ("GET", f"/v1/manifest/{ctx.model_id}/latest", None),
        ("PUT", f"/v1/weights/{ctx.model_id}/{ctx.version + 1}/x.bin", b"w"),
        ("POST", "/v1/lease", encode({"instance_id": ctx.instance_id, "max_tasks": 1})),
        ("POST", "/v1/register", encode({"model_ids": [ctx.model_id], "capacity": 1})),
        ("POST", "/v1/batches/extend", encode({"batch_id": "no-such-batch"})),
        ("POST", "/v1/trainer/resumed", encode({"model_id": ctx.model_id, "step": 10**6})),
        ("POST", f"/v1/instances/{ctx.instance_id}/drain", None),
        ("GET", "/v1/nope", None)])
    headers = dict(MSGPACK) if body is not None else {}
    if header is not None:
        headers["Authorization"] = header
    return BadRequest("auth", method, path, body, headers, no_auth=True)


# ----------------------------------------------------------------------------- issue 18 drills


def _long_name(rng: random.Random) -> str:
    """A weight file name too long for its temporary upload name (more than 217 UTF-8 bytes:
    218..255 ASCII characters, or more than 255 bytes in at most 256 characters)."""
    return rng.choice([lambda: "a" * rng.randint(218, 255), lambda: "é" * rng.randint(128, 200),
                       lambda: "😀" * rng.randint(55, 64),
                       lambda: "w" * 200 + "é" * rng.randint(9, 28)])()


def gen_weight_name(rng: random.Random, ctx: Context) -> BadRequest:
    """Defect 1: names the file system would refuse (ENAMETOOLONG was a 500) or that hold
    control characters, on upload and in a manifest."""
    from urllib.parse import quote

    control = rng.choice(["a\nb", "a\rb", "\x01x", "tab\tname", "del\x7f", "c1\x85y", "x\x1b[2J"])
    name = _long_name(rng) if rng.random() < 0.6 else control
    if rng.random() < 0.6:
        return BadRequest("weight_name", "PUT",
                          f"/v1/weights/{ctx.model_id}/{ctx.version + 1}/{quote(name, safe='')}",
                          b"weights", {"Content-Type": "application/octet-stream"})
    return BadRequest("weight_name", "POST", "/v1/publish",
                      encode(manifest(ctx, ctx.version + 1, name=name)), dict(MSGPACK))


def gen_never_stale(rng: random.Random, ctx: Context) -> BadRequest:
    """Defect 2: a version newer than the published one on tokens outside the loss mask, or
    no loss-masked token at all (both once accepted and then never stale)."""
    group = valid_group(ctx)
    s = rng.choice(group)
    how = rng.randrange(3)
    if how == 0:  # the drill's sample: nothing trained, versions far ahead
        s.loss_mask[:] = 0
        s.versions[:] = rng.choice([10 ** 6, ctx.version + 1, 2 ** 31 - 1])
    elif how == 1:  # a future version on a prompt token only
        s.versions[rng.randrange(3)] = ctx.version + rng.randint(1, 10 ** 6)
    else:  # no loss-masked token, valid versions
        s.loss_mask[:] = 0
    return BadRequest("never_stale", "POST", "/v1/push", pack(push_env(ctx, group)), dict(MSGPACK))


def gen_extreme_logprob(rng: random.Random, ctx: Context) -> BadRequest:
    """Defect 3: behaviour log-probs below LOGPROB_FLOOR (-3e38 made the PPO loss inf)."""
    group = valid_group(ctx)
    s = rng.choice(group)
    s.logprobs[rng.randrange(3, s.num_tokens)] = rng.choice(
        [-3e38, -3.4e38, -1e30, LOGPROB_FLOOR * 1.001, LOGPROB_FLOOR - 1.0, -1e4])
    return BadRequest("extreme_logprob", "POST", "/v1/push", pack(push_env(ctx, group)),
                      dict(MSGPACK))


def gen_version_jump(rng: random.Random, ctx: Context) -> BadRequest:
    """Defect 4: a version more than max_version_jump ahead (2^53-1 locked the policy)."""
    v = rng.choice([2 ** 53 - 1, 2 ** 53 - 2, ctx.version + ctx.max_version_jump + 1,
                    ctx.version + ctx.max_version_jump + rng.randint(2, 10 ** 6)])
    if rng.random() < 0.4:  # and no file can be stored for such a version either
        return BadRequest("version_jump", "PUT", f"/v1/weights/{ctx.model_id}/{v}/{ctx.file_name}",
                          b"weights", {"Content-Type": "application/octet-stream"})
    return BadRequest("version_jump", "POST", "/v1/publish", encode(manifest(ctx, v)),
                      dict(MSGPACK))


def gen_token_out_of_vocab(rng: random.Random, ctx: Context) -> BadRequest:
    """Defect 6: ids at or above the registered vocabulary (2^31-1 crashed an embedding)."""
    group = valid_group(ctx)
    s = rng.choice(group)
    s.token_ids[rng.randrange(s.num_tokens)] = rng.choice(
        [2 ** 31 - 1, MAX_VOCAB_SIZE, LIMITS["vocab_size"], LIMITS["vocab_size"] + 1,
         rng.randint(LIMITS["vocab_size"], 2 ** 31 - 1)])
    return BadRequest("token_out_of_vocab", "POST", "/v1/push", pack(push_env(ctx, group)),
                      dict(MSGPACK))


def gen_oversized_sample(rng: random.Random, ctx: Context) -> BadRequest:
    """Defect 7: a consistent sample longer than the registered max_model_len."""
    group = valid_group(ctx)
    i = rng.randrange(len(group))
    T = LIMITS["max_model_len"] + rng.choice([1, 2, 100, 4000])
    group[i] = sample(ctx, ctx.open_task, group[i].sample_index, T=T)
    group[i].token_ids %= LIMITS["vocab_size"]
    return BadRequest("oversized_sample", "POST", "/v1/push", pack(push_env(ctx, group)),
                      dict(MSGPACK))


def gen_bad_metadata(rng: random.Random, ctx: Context) -> BadRequest:
    """Defect 8: metadata the trainer (or the service's own counters) would fail on."""
    group = valid_group(ctx)
    s = rng.choice(group)
    choices = [{"temperature": "hot"}, {"temperature": float("nan")},
               {"temperature": float("inf")}, {"temperature": -1.0}, {"temperature": 0},
               {"temperature": True}, {"attempt": "first"}, {"attempt": -1},
               {"attempt": 2 ** 40}, {"tool_calls": 2 ** 64 - 1},
               {"tool_calls": 3, "tool_errors": {"timeout": 2 ** 63}}, {"turns": 2 ** 62}]
    if ctx.temperature is not None:  # the drill's case needs the policy's temperature
        choices += [{"temperature": ctx.temperature * f} for f in (0.5, 0.999, 1.01, 2.0)]
    s.metadata = dict(rng.choice(choices))
    return BadRequest("bad_metadata", "POST", "/v1/push", pack(push_env(ctx, group)),
                      dict(MSGPACK))


# ----------------------------------------------------------------------------- issue 18: access


#: categories that need the service's scoped tokens and a second instance (:attr:`Context.scoped`)
SCOPED_CATEGORIES = ("scope", "instance_secret", "foreign_task")
#: what a web page sends without a CORS preflight, and other bodies that are not msgpack
BROWSER_TYPES = ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x")
ORIGINS = ("http://evil.example", "null", "http://127.0.0.1:8400", "http://localhost",
           "https://rebound.evil.example", "file://", "chrome-extension://abcdef")


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _secret(secret: str | None) -> dict:
    return {auth.INSTANCE_SECRET_HEADER: secret} if secret else {}


def _route_request(rng: random.Random, ctx: Context,
                   route: tuple[str, str]) -> tuple[str, str, bytes | None, dict]:
    """``(method, path, body, headers)``: a well-formed request of ``route`` aimed at the fuzz
    model and instance, which the access categories send with one thing wrong (so an answer
    2xx means the guard let it through). A registration names a new instance (accepted, it
    would show in ``/v1/stats``), an upload a new file of the next version."""
    method, template = route
    new = f"access-{rng.randrange(10 ** 6)}"
    put = method == "PUT"
    path = (template.replace("{model_id}", ctx.model_id)
            .replace("{instance_id}", ctx.instance_id)
            .replace("{version}", str(ctx.version + 1 if put else ctx.version))
            .replace("{name}", f"{new}.bin" if put else ctx.file_name))
    if put:
        return method, path, b"weights", {"Content-Type": "application/octet-stream"}
    if method == "POST" and template in BODY_ROUTES:
        body = base_body(ctx, template)
        if template == "/v1/register":
            body["instance_id"] = new
        return method, path, pack(envelope(body)), dict(MSGPACK)
    return method, path, None, {}


def gen_scope(rng: random.Random, ctx: Context) -> BadRequest:
    """A rollout or trainer token (unbound, or bound to this model_id) on a route its scope
    does not grant (``auth.ROUTES``), with the instance's own secret: 403 naming
    ``authorization``."""
    tokens = [(auth.ROLLOUT, ctx.rollout_token), (auth.TRAINER, ctx.trainer_token),
              (auth.TRAINER, trainer_token(ctx.trainer_token, ctx.model_id))]
    choices = []
    for route in sorted(ROUTES):
        rule = auth.ROUTES.get(route)
        for scope, token in tokens:
            if rule is None or scope not in rule.scopes:
                choices.append((route, token))
    route, token = rng.choice(choices)
    method, path, body, headers = _route_request(rng, ctx, route)
    headers.update(_bearer(token), **_secret(ctx.instance_secret))
    return BadRequest("scope", method, path, body, headers, no_auth=True, expect=403,
                      expect_field="authorization")


def gen_instance_secret(rng: random.Random, ctx: Context) -> BadRequest:
    """The rollout scope acting as one of the two instances without its secret (none, the other
    instance's, a made-up one, its own with one character changed): heartbeat, lease,
    deregister, return, drain and registering it again while it is live -- 403 naming
    ``instance_secret``."""
    a = (ctx.instance_id, ctx.instance_secret, ctx.open_task)
    b = (ctx.other_instance, ctx.other_secret, ctx.other_task)
    (iid, own, task), other = (a, b) if rng.random() < 0.5 else (b, a)
    changed = own[:-1] + ("A" if own[-1] != "A" else "B")
    secret = rng.choice([None, other[1], "x" * 43, changed])
    how = rng.choice(["heartbeat", "lease", "deregister", "return", "drain", "register"])
    if how == "drain":
        method, path, body = "POST", f"/v1/instances/{iid}/drain", None
    else:
        path = f"/v1/{how}"
        body = pack(envelope({
            "heartbeat": {"instance_id": iid, "in_flight": 0},
            "lease": {"instance_id": iid, "max_tasks": 1},
            "deregister": {"instance_id": iid},
            "return": {"instance_id": iid, "task_ids": [task], "failed": False},
            "register": {"model_ids": [ctx.model_id], "capacity": 1, "instance_id": iid,
                         "limits": {ctx.model_id: dict(LIMITS)}},
        }[how]))
        method = "POST"
    headers = {**(MSGPACK if body is not None else {}), **_bearer(ctx.rollout_token),
               **_secret(secret)}
    return BadRequest("instance_secret", method, path, body, headers, no_auth=True, expect=403,
                      expect_field="instance_secret")


def gen_foreign_task(rng: random.Random, ctx: Context) -> BadRequest:
    """An instance (with its own secret) pushing valid samples of the task the other instance
    holds: 409 naming ``task_id`` (as push_many too: ``items[i].task_id``)."""
    if rng.random() < 0.5:
        iid, secret, task = ctx.instance_id, ctx.instance_secret, ctx.other_task
    else:
        iid, secret, task = ctx.other_instance, ctx.other_secret, ctx.open_task
    body = encode({"instance_id": iid, "task_id": task, "samples": valid_group(ctx, task)})
    headers = {**MSGPACK, **_bearer(ctx.rollout_token), **_secret(secret)}
    return BadRequest("foreign_task", "POST", "/v1/push", body, headers, no_auth=True,
                      expect=409, expect_field="task_id")


def gen_origin(rng: random.Random, ctx: Context) -> BadRequest:
    """Any route, a well-formed request with an ``Origin`` header (with the service's token, a
    scoped token and the instance's secret, or no token at all): 403 naming ``origin``."""
    route = rng.choice(sorted(ROUTES))
    method, path, body, headers = _route_request(rng, ctx, route)
    headers["Origin"] = rng.choice(ORIGINS)
    who = rng.randrange(3)
    if who == 1:
        headers.update(_bearer(rng.choice([ctx.rollout_token, ctx.admin_token]) or ctx.token),
                       **_secret(ctx.instance_secret))
    return BadRequest("origin", method, path, body, headers, no_auth=who != 0, expect=403,
                      expect_field="origin")


def gen_content_type(rng: random.Random, ctx: Context) -> BadRequest:
    """A valid body declared as text, a form or multipart (what a page sends without a CORS
    preflight), as JSON, or with no type: mostly a registration (the drill's), else another
    body route or a weight upload. 415 naming ``content-type``."""
    if rng.random() < 0.6:
        route = ("POST", "/v1/register")
    else:
        route = rng.choice([("POST", p) for p in BODY_ROUTES if p != "/v1/register"]
                           + [("PUT", "/v1/weights/{model_id}/{version}/{name}")])
    method, path, data, _ = _route_request(rng, ctx, route)
    ctype = rng.choice(BROWSER_TYPES + ("application/json", None))
    if ctype == "application/x-www-form-urlencoded" and rng.random() < 0.5:
        data = f"model_ids={ctx.model_id}&capacity=1".encode()
    elif ctype is not None and ctype.startswith("multipart/"):
        data = (b'--x\r\nContent-Disposition: form-data; name="body"\r\n\r\n' + data
                + b"\r\n--x--\r\n")
    elif ctype == "application/json" and route[1] == "/v1/register":
        data = json.dumps({"model_ids": [ctx.model_id], "capacity": 1}).encode()
    headers = {"Content-Type": ctype} if ctype else {}
    no_auth = False
    if route[1] == "/v1/register" and ctx.rollout_token and rng.random() < 0.5:
        headers.update(_bearer(ctx.rollout_token))  # the scope that may register
        no_auth = True
    body: Any = _Chunks(data, 1) if rng.random() < 0.2 else data  # chunked: no Content-Length
    return BadRequest("content_type", method, path, body, headers, no_auth=no_auth, expect=415,
                      expect_field="content-type")


CATEGORIES: dict[str, Callable[[random.Random, Context], BadRequest]] = {
    "garbage": gen_garbage,
    "malformed_msgpack": gen_malformed,
    "wrong_type": gen_wrong_type,
    "unknown_field": gen_unknown_field,
    "huge_array": gen_huge_array,
    "negative_size": gen_negative_size,
    "unknown_model": gen_unknown_model,
    "replayed_push": gen_replay,
    "out_of_order_version": gen_out_of_order,
    "pickle_or_ext": gen_pickle,
    "oversized": gen_oversized,
    "bad_path": gen_bad_path,
    "bad_sample": gen_bad_sample,
    "auth": gen_auth,
    "weight_name": gen_weight_name,
    "never_stale": gen_never_stale,
    "extreme_logprob": gen_extreme_logprob,
    "version_jump": gen_version_jump,
    "token_out_of_vocab": gen_token_out_of_vocab,
    "oversized_sample": gen_oversized_sample,
    "bad_metadata": gen_bad_metadata,
    "scope": gen_scope,
    "instance_secret": gen_instance_secret,
    "foreign_task": gen_foreign_task,
    "origin": gen_origin,
    "content_type": gen_content_type,
}
#: the bad-sample drills of issue 18 (all pushes: also sent as push_many)
SAMPLE_DRILLS = ("never_stale", "extreme_logprob", "token_out_of_vocab", "oversized_sample",
                 "bad_metadata")

#: every route of the app -> the categories that send bad requests to it (checked against
#: ``app.routes`` by tests/unit/test_route_fuzz.py: add a new route here with its generators)
ROUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("GET", "/v1/info"): ("auth", "bad_path"),
    ("GET", "/v1/stats"): ("auth", "bad_path"),
    ("GET", "/v1/eval/{model_id}"): ("unknown_model",),
    ("GET", "/v1/eval/{model_id}/{version}/completions"): ("unknown_model", "negative_size"),
    ("POST", "/v1/eval"): ("garbage", "malformed_msgpack", "wrong_type", "unknown_field",
                           "pickle_or_ext", "oversized"),
    ("GET", "/v1/balance/{model_id}"): ("unknown_model", "negative_size"),
    ("GET", "/v1/counters/{model_id}"): ("unknown_model", "negative_size"),
    ("POST", "/v1/register"): ("garbage", "malformed_msgpack", "wrong_type", "unknown_field",
                               "negative_size", "unknown_model", "pickle_or_ext", "oversized",
                               "auth"),
    ("POST", "/v1/heartbeat"): ("garbage", "malformed_msgpack", "wrong_type", "unknown_field",
                                "negative_size", "pickle_or_ext", "oversized"),
    ("POST", "/v1/instances/{instance_id}/drain"): ("bad_path", "auth"),
    ("POST", "/v1/return"): ("garbage", "malformed_msgpack", "wrong_type", "unknown_field",
                             "negative_size", "pickle_or_ext", "oversized"),
    ("POST", "/v1/deregister"): ("garbage", "malformed_msgpack", "wrong_type", "unknown_field",
                                 "pickle_or_ext", "oversized"),
    ("POST", "/v1/lease"): ("garbage", "malformed_msgpack", "wrong_type", "unknown_field",
                            "negative_size", "pickle_or_ext", "oversized", "auth"),
    ("POST", "/v1/push"): ("garbage", "malformed_msgpack", "wrong_type", "unknown_field",
                           "huge_array", "negative_size", "unknown_model", "replayed_push",
                           "out_of_order_version", "pickle_or_ext", "oversized", "bad_sample",
                           *SAMPLE_DRILLS),
    ("POST", "/v1/push_many"): ("garbage", "malformed_msgpack", "wrong_type", "unknown_field",
                                "huge_array", "negative_size", "unknown_model", "replayed_push",
                                "out_of_order_version", "pickle_or_ext", "oversized",
                                "bad_sample", *SAMPLE_DRILLS),
    ("POST", "/v1/pull"): ("garbage", "malformed_msgpack", "wrong_type", "unknown_field",
                           "negative_size", "unknown_model", "pickle_or_ext", "oversized"),
    ("POST", "/v1/ack"): ("garbage", "malformed_msgpack", "wrong_type", "unknown_field",
                          "negative_size", "pickle_or_ext", "oversized"),
    ("POST", "/v1/batches/extend"): ("garbage", "malformed_msgpack", "wrong_type",
                                     "unknown_field", "pickle_or_ext", "oversized", "auth"),
    ("POST", "/v1/trainer/resumed"): ("garbage", "malformed_msgpack", "wrong_type",
                                      "unknown_field", "negative_size", "unknown_model",
                                      "pickle_or_ext", "oversized", "auth"),
    ("GET", "/v1/version/{model_id}"): ("unknown_model", "auth"),
    ("PUT", "/v1/weights/{model_id}/{version}/{name}"): ("unknown_model", "negative_size",
                                                         "out_of_order_version", "oversized",
                                                         "bad_path", "auth", "weight_name",
                                                         "version_jump"),
    ("GET", "/v1/weights/{model_id}/{version}/{name}"): ("unknown_model", "negative_size",
                                                         "bad_path", "auth"),
    ("POST", "/v1/publish"): ("garbage", "malformed_msgpack", "wrong_type", "negative_size",
                              "unknown_model", "out_of_order_version", "pickle_or_ext",
                              "oversized", "weight_name", "version_jump"),
    ("GET", "/v1/manifest/{model_id}/latest"): ("unknown_model", "auth"),
    ("GET", "/v1/manifest/{model_id}/{version}"): ("unknown_model", "negative_size", "bad_path"),
}
_PUT = ("PUT", "/v1/weights/{model_id}/{version}/{name}")
#: the access categories of issue 18 -> the routes they send to (added to :data:`ROUTES`):
#: ``origin`` every route; ``scope`` every route that the rollout or the trainer scope may not
#: call (``auth.ROUTES``); ``content_type`` every route with a body
ACCESS_ROUTES: dict[str, tuple[tuple[str, str], ...]] = {
    "origin": tuple(ROUTES),
    "scope": tuple(r for r in ROUTES if r not in auth.ROUTES
                   or not {auth.ROLLOUT, auth.TRAINER} <= auth.ROUTES[r].scopes),
    "content_type": tuple(("POST", p) for p in BODY_ROUTES) + (_PUT,),
    "instance_secret": (("POST", "/v1/register"), ("POST", "/v1/heartbeat"),
                        ("POST", "/v1/lease"), ("POST", "/v1/deregister"),
                        ("POST", "/v1/return"), ("POST", "/v1/instances/{instance_id}/drain")),
    "foreign_task": (("POST", "/v1/push"), ("POST", "/v1/push_many")),
}
for _category, _routes in ACCESS_ROUTES.items():
    for _route in _routes:
        ROUTES[_route] = ROUTES[_route] + (_category,)


#: share of the push-specific bad requests sent as push_many instead (:func:`as_push_many`)
PUSH_MANY_SHARE = 0.35


def available(ctx: Context) -> list[str]:
    """The categories ``ctx`` can send: ``auth`` needs a token, :data:`SCOPED_CATEGORIES` the
    scoped tokens and the second instance."""
    return sorted(c for c in CATEGORIES if (ctx.token or c != "auth")
                  and (ctx.scoped or c not in SCOPED_CATEGORIES))


def generate(rng: random.Random, ctx: Context, category: str | None = None) -> BadRequest:
    name = category or rng.choice(available(ctx))
    req = CATEGORIES[name](rng, ctx)
    if req.path == "/v1/push" and isinstance(req.body, bytes) and rng.random() < PUSH_MANY_SHARE:
        req = as_push_many(rng, req)
    return req


# ----------------------------------------------------------------------------- sending


def prepare(http, token: str = "", model_id: str = "policy", group_size: int = 2,
            max_body_bytes: int = 64 * 1024, max_weight_file_bytes: int = 256 * 1024,
            scoped: dict[str, str] | None = None) -> Context:
    """Set up the state the generators aim at with valid requests (``http``: an httpx.Client or
    a FastAPI TestClient on the service): two registered instances (``fuzz-raas`` holding a
    pushed and an open task, ``fuzz-raas-b`` an open task, each with its instance secret), a
    published weight version. ``scoped``: the service's scoped tokens (``{"rollout": ...,
    "trainer": ..., "admin": ...}``, :data:`astralight.dataflow.auth.SCOPE_VARS`), for the
    access categories; ``token`` (every scope) sets the state up."""
    bearer = _bearer(token)
    hdr = {**MSGPACK, **bearer}

    def call(method, path, body=None, content=None):
        r = http.request(method, path, content=encode(body) if body is not None else content,
                         headers=hdr)
        assert r.status_code == 200, (path, r.status_code, r.text)
        return msgpack.unpackb(r.content, raw=False)["body"] if r.content[:1] != b"{" else r.json()

    def register(instance_id: str, leases: int) -> tuple[str, str, list]:
        reply = call("POST", "/v1/register", {"model_ids": [model_id], "capacity": 4,
                                              "instance_id": instance_id,
                                              "limits": {model_id: dict(LIMITS)}})
        tasks = call("POST", "/v1/lease", {"instance_id": reply["instance_id"],
                                           "max_tasks": leases})["tasks"]
        assert len(tasks) == leases, tasks
        return reply["instance_id"], reply.get("instance_secret", ""), tasks

    iid, secret, tasks = register("fuzz-raas", 2)
    other, other_secret, [other_task] = register("fuzz-raas-b", 1)
    scoped = scoped or {}
    ctx = Context(token=token, model_id=model_id, instance_id=iid, pushed_task=tasks[0]["task_id"],
                  pushed_body=b"", open_task=tasks[1]["task_id"], group_size=group_size,
                  version=0, file_name="model.safetensors", file_bytes=0,
                  max_body_bytes=max_body_bytes, max_weight_file_bytes=max_weight_file_bytes,
                  rollout_token=scoped.get(auth.ROLLOUT, ""),
                  trainer_token=scoped.get(auth.TRAINER, ""),
                  admin_token=scoped.get(auth.ADMIN, ""), instance_secret=secret,
                  other_instance=other, other_secret=other_secret,
                  other_task=other_task["task_id"])
    info = http.get("/v1/info", headers=bearer).json()
    ctx.max_version_jump = int(info.get("max_version_jump", ctx.max_version_jump))
    ctx.temperature = (info.get("temperatures") or {}).get(model_id)
    push = {"instance_id": iid, "task_id": ctx.pushed_task,
            "samples": valid_group(ctx, ctx.pushed_task)}
    ctx.pushed_body = encode(push)
    assert call("POST", "/v1/push", content=ctx.pushed_body)["accepted"] == group_size
    data = b"fuzz weights v1"
    call("PUT", f"/v1/weights/{model_id}/1/{ctx.file_name}", content=data)
    m = manifest(ctx, 1, sha=hashlib.sha256(data).hexdigest())
    m.files[ctx.file_name]["bytes"] = len(data)
    call("POST", "/v1/publish", m)
    ctx.version, ctx.file_bytes = 1, len(data)
    return ctx


@dataclass
class Outcome:
    status: int | None  # None: no answer (timeout or connection error)
    accepted_bad: bool
    detail: str = ""
    unexpected: bool = False  # refused, but not with the request's ``expect`` status and field


def refused_field(r) -> str | None:
    """The ``field`` of a JSON error answer (None if it is not one)."""
    try:
        body = r.json()
    except Exception:
        return None
    return body.get("field") if isinstance(body, dict) else None


def send(http, req: BadRequest, ctx: Context, timeout: float | None = 30.0) -> Outcome:
    headers = dict(req.headers)
    if not req.no_auth:
        headers.update(ctx.auth())
    if (req.category != "content_type" and req.body is not None
            and not any(k.lower() == "content-type" for k in headers)):
        # the declared type every client sends, so that a category reaches the check it is
        # written for instead of the content-type guard's 415 (that guard has its own category)
        headers["Content-Type"] = ("application/octet-stream" if req.method == "PUT"
                                   else "application/msgpack")
    body = req.body
    if isinstance(body, _Chunks):
        body = iter(body)
    import httpx

    extra = {} if timeout is None else {"timeout": timeout}
    try:
        r = http.request(req.method, req.path, content=body, headers=headers, **extra)
    except httpx.LocalProtocolError as exc:  # never left this process: a generator bug
        raise RuntimeError(f"unsendable request from {req.category}: {exc}") from exc
    except Exception as exc:  # httpx transport errors: the service did not answer
        return Outcome(None, False, f"{type(exc).__name__}: {exc}")
    ok = 200 <= r.status_code < 300
    bad = ok
    if ok and req.replay:
        try:
            answer = msgpack.unpackb(r.content, raw=False)["body"]
            replies = ([x.get("reply") or {} for x in answer["results"]]
                       if req.path == "/v1/push_many" else [answer])
            bad = not all(a.get("duplicate") is True and a.get("accepted") == 0 for a in replies)
        except Exception:
            bad = True
    unexpected = False
    if req.expect is not None and not bad:
        got = refused_field(r)
        unexpected = r.status_code != req.expect or not (
            req.expect_field is None or got == req.expect_field
            or str(got).endswith("." + req.expect_field))  # push_many: items[0].task_id
    detail = r.text[:300] if (bad or unexpected or r.status_code >= 500) else ""
    if unexpected:
        detail = f"expected {req.expect} {req.expect_field}: {detail}"
    return Outcome(r.status_code, bad, detail, unexpected)


#: what no refused request may change (``/v1/stats``): the model's counters ...
STATE_COUNTERS = ("samples_accepted", "tasks_issued", "tasks_returned", "batches_served",
                  "batches_acked", "batches_extended", "batches_rolled_back", "current_version",
                  "weight_versions_stored")
#: ... and each registered instance's state and task counts (a new instance shows too)
INSTANCE_FIELDS = ("state", "tasks_leased", "tasks_done", "tasks_returned", "samples_pushed")


def state_of(stats: dict, model_id: str) -> dict:
    """The part of a ``/v1/stats`` answer that bad requests must leave as it is."""
    model = stats["models"][model_id]
    out = {k: model.get(k) for k in STATE_COUNTERS}
    for inst in stats["instances"]:
        out[f"instances.{inst['instance_id']}"] = {k: inst.get(k) for k in INSTANCE_FIELDS}
    return out


def state_changes(before: dict, after: dict) -> dict:
    """``{key: [before, after]}`` for every key of :func:`state_of` that changed."""
    return {k: [before.get(k), after.get(k)] for k in sorted(set(before) | set(after))
            if before.get(k) != after.get(k)}


# ----------------------------------------------------------------------------- the benchmark


def start_service(tmp: Path, token: str, max_body_bytes: int, max_weight_file_bytes: int,
                  scoped: dict[str, str] | None = None, model_ids: tuple[str, ...] = ("policy",),
                  overrides: dict | None = None):
    """The service on 127.0.0.1 with ``ASTRALIGHT_TOKEN`` = ``token`` (none when empty) and,
    from ``scoped``, the scoped tokens ``ASTRALIGHT_ROLLOUT_TOKEN`` / ``..._TRAINER_...`` /
    ``..._ADMIN_...``; ``overrides``: more config keys."""
    cfg = tmp / "dataflow.yaml"
    cfg.write_text(json.dumps({"host": "127.0.0.1", "port": 0, "state_dir": str(tmp / "state"),
                               "group_size": 2, "log_level": "ERROR", "lease_seconds": 3600,
                               "max_body_bytes": max_body_bytes,
                               "max_weight_file_bytes": max_weight_file_bytes,
                               "model_ids": list(model_ids),
                               "temperatures": {m: TEMPERATURE for m in model_ids},
                               **(overrides or {})}))
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("ASTRALIGHT_") and k.endswith(("_TOKEN", "_TOKEN_FILE")))}
    if token:  # (set but empty would stop the service: a blank token is refused)
        env["ASTRALIGHT_TOKEN"] = token
    for scope, value in (scoped or {}).items():
        env[auth.SCOPE_VARS[scope]] = value
    log = open(tmp / "dataflow.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "astralight.dataflow.service", "--config",
                             str(cfg)], stdout=subprocess.PIPE, stderr=log, env=env)
    line = proc.stdout.readline().decode()
    if "serving on" not in line:
        proc.kill()
        raise RuntimeError(f"service did not start: {(tmp / 'dataflow.log').read_text()[-2000:]}")
    return proc, line.split(" on ", 1)[1].strip()


def healthy(http, ctx: Context, proc) -> bool:
    if proc.poll() is not None:
        return False
    try:
        return http.get("/v1/info", headers=ctx.auth(), timeout=10.0).status_code == 200
    except Exception:
        return False


def killed_upload(tmp: Path, token: str, proc, url: str, ctx: Context, max_body: int,
                  max_file: int, scoped: dict[str, str] | None = None
                  ) -> tuple[Counter, Any, str]:
    """Defect 5: ``kill -9`` the service while a weight upload is streaming, start it again on
    the same state and count the temporary upload files (``.{name}.{uuid}.tmp``) that stay:
    each one is an ``accepted_bad`` (they used to stay for good). Returns the counts and the new
    service process and URL."""
    import threading

    import httpx

    weights = tmp / "state" / "weights"
    release = threading.Event()

    def body():
        yield b"x" * 65536
        release.wait(30)  # the service is killed meanwhile
        yield b"y"

    def upload():
        try:
            with httpx.Client(base_url=url, timeout=60.0) as c:
                c.put(f"/v1/weights/{ctx.model_id}/{ctx.version + 1}/killed.bin", content=body(),
                      headers={**ctx.auth(), "Content-Type": "application/octet-stream"})
        except Exception:  # the service died under it: expected
            pass

    thread = threading.Thread(target=upload, daemon=True)
    thread.start()
    left: list[Path] = []
    deadline = time.time() + 20
    while time.time() < deadline and not left:
        left = list(weights.glob("*/*/.*.tmp"))
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    release.set()
    thread.join(10)
    proc, url = start_service(tmp, token, max_body, max_file, scoped)
    after = list(weights.glob("*/*/.*.tmp"))
    return (Counter(requests=1, temp_files_left_by_kill=len(left),
                    temp_files_after_restart=len(after)), proc, url)


#: requests of the ``host`` drill (on its own service, after the main requests)
HOST_DRILL_REQUESTS = 200
#: Host names a DNS-rebinding page would send (the service binds 127.0.0.1)
REBOUND_HOSTS = ("rebound.evil.example", "evil.example:8400", "attacker.test", "10.0.0.5",
                 "127.0.0.1.evil.example", "localhost.evil.example", "[::2]")
NO_TOKEN_ROUTES = (("GET", "/v1/info"), ("GET", "/v1/stats"), ("GET", "/v1/version/policy"),
                   ("GET", "/v1/manifest/policy/latest"), ("POST", "/v1/register"),
                   ("POST", "/v1/lease"), ("POST", "/v1/pull"), ("POST", "/v1/publish"))


def _refusal_drill(proc, url: str, model_id: str, admin: dict, n: int,
                   draw: Callable[[], tuple[str, str, Any, dict]], field: str) -> Counter:
    """Send ``n`` requests ``draw()`` (method, path, body, headers) to the service ``proc`` at
    ``url``; each must be 403 naming ``field`` and change nothing. A 2xx or a state change of
    ``model_id`` is an ``accepted_bad``, another refusal an ``unexpected_status``. Stops the
    service."""
    import httpx

    counts: Counter = Counter()
    try:
        with httpx.Client(base_url=url, timeout=30.0) as http:
            before = state_of(http.get("/v1/stats", headers=admin).json(), model_id)
            for _ in range(n):
                method, path, body, headers = draw()
                counts["requests"] += 1
                try:
                    r = http.request(method, path, content=body, headers=headers)
                except Exception:  # noqa: BLE001 - no answer
                    counts["no_answer"] += 1
                    continue
                counts[f"status_{r.status_code}"] += 1
                if 200 <= r.status_code < 300:
                    counts["accepted_bad"] += 1
                elif r.status_code >= 500:
                    counts["status_5xx"] += 1
                elif r.status_code != 403 or refused_field(r) != field:
                    counts["unexpected_status"] += 1
            alive = proc.poll() is None and http.get("/v1/info", headers=admin).status_code == 200
            counts["crashes"] += 0 if alive else 1
            if alive:
                counts["accepted_bad"] += len(state_changes(
                    before, state_of(http.get("/v1/stats", headers=admin).json(), model_id)))
    finally:
        stop_process(proc)
    return counts


def host_drill(tmp: Path, rng: random.Random, n: int, max_body: int, max_file: int) -> Counter:
    """``host``: a second service, without any token, must refuse every request whose ``Host``
    is not a loopback name or its configured host (403 ``host``: DNS rebinding), on every kind
    of route, and change nothing."""
    folder = tmp / "no-token"
    folder.mkdir()
    proc, url = start_service(folder, "", max_body, max_file)

    def draw():
        method, path = rng.choice(NO_TOKEN_ROUTES)
        headers = {"Host": rng.choice(REBOUND_HOSTS)}
        if method != "POST":
            return method, path, None, headers
        headers["Content-Type"] = "application/msgpack"
        return method, path, pack(envelope({"model_ids": ["policy"], "capacity": 1})), headers

    return _refusal_drill(proc, url, "policy", {}, n, draw, "host")


def bound_model_drill(tmp: Path, rng: random.Random, n: int, max_body: int, max_file: int,
                      token: str, scoped: dict[str, str]) -> Counter:
    """``bound_model``: on a second service with two model_ids (``policy``, ``other``), a trainer
    token bound to ``policy`` acting on ``other`` (pull, trainer/resumed, a weight upload, a
    publish, its eval results, balance report and counters) must be refused: 403 ``model_id``."""
    folder = tmp / "two-models"
    folder.mkdir()
    proc, url = start_service(folder, token, max_body, max_file, scoped,
                              model_ids=("policy", "other"))
    bound = {"Authorization": f"Bearer {trainer_token(scoped[auth.TRAINER], 'policy')}"}
    other_manifest = WeightManifest(model_id="other", version=1, kind="full", base_version=None,
                                    files={"model.safetensors": {"sha256": "0" * 64, "bytes": 7}})
    requests = [
        ("POST", "/v1/pull", {"model_id": "other", "size": 1, "timeout_s": 0}),
        ("POST", "/v1/trainer/resumed", {"model_id": "other", "step": 0}),
        ("POST", "/v1/publish", raw(other_manifest)["body"]),
        ("PUT", "/v1/weights/other/1/model.safetensors", b"weights"),
        ("GET", "/v1/eval/other", None), ("GET", "/v1/balance/other", None),
        ("GET", "/v1/counters/other", None)]

    def draw():
        method, path, body = rng.choice(requests)
        headers = dict(bound)
        if isinstance(body, bytes):
            headers["Content-Type"] = "application/octet-stream"
        elif body is not None:
            headers["Content-Type"] = "application/msgpack"
            body = pack(envelope(body))
        return method, path, body, headers

    return _refusal_drill(proc, url, "other", {"Authorization": f"Bearer {token}"}, n, draw,
                          "model_id")


#: the ``openai`` drill (:func:`openai_drill`): bad requests sent to the RaaS's OpenAI endpoint
OPENAI_DRILL_REQUESTS = 200
#: ... and how many 8 MiB conversations (4,096 messages) it sends, each with calls beside it
OPENAI_HUGE_CONVERSATIONS = 2
#: a gap of the episode loop longer than this is a freeze (counted in ``crashes``): the loop
#: only waits for the interpreter lock now (a few 0.1 s at most for an 8 MiB body's JSON)
OPENAI_LOOP_FREEZE_S = 1.0
#: a lone UTF-16 surrogate as the JSON escape a client can send (json.dumps never writes one)
_LONE = "\\ud800"
_DEEP = "[" * 1200 + "]" * 1200
#: what the drill's scripted policy answers to a prompt holding ``reply NAME`` (issue 41, item 4:
#: tool calls no JSON parser here can read; each must be a malformed call, never a 500)
OPENAI_BAD_REPLIES = {
    "deep_object": '<tool_call>{"name": "add", "arguments": {"a": ' + _DEEP + "}}</tool_call>",
    "deep_string": "<tool_call>" + json.dumps({"name": "add", "arguments": '{"a": ' + _DEEP + "}"})
                   + "</tool_call>",
    "huge_int": '<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>",
    "unclosed_tags": "<tool_call>" * 20_000,
}
_ADD_TOOL = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]


def _openai_body(rng: random.Random, **raw_fields: str) -> bytes:
    """A chat request body as raw JSON text (so it can hold escapes json.dumps never writes):
    ``model`` and one user message unless given, then ``raw_fields`` (raw JSON values)."""
    fields = {"model": '"policy"',
              "messages": json.dumps([{"role": "user", "content": f"{rng.randrange(999)}+1="}]),
              **raw_fields}
    return ("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}").encode()


def gen_openai_surrogate(rng: random.Random) -> tuple[bytes, str]:
    """Issue 41, item 8: a lone surrogate in a message, ``stop``, a tool name or a field name."""
    text = "".join(rng.choice("ab ") for _ in range(rng.randrange(8)))
    bad = text + rng.choice([_LONE, "\\udfff", "\\udc00"]) + text
    where = rng.randrange(7)
    if where == 0:
        return _openai_body(rng, messages=f'[{{"role": "user", "content": "{bad}"}}]'), \
            "messages[0].content"
    if where == 1:
        return _openai_body(rng, stop=f'"{bad}"'), "stop"
    if where == 2:
        return _openai_body(rng, stop=f'["x", "{bad}"]'), "stop[1]"
    if where == 3:
        tools = f'[{{"type": "function", "function": {{"name": "{bad}"}}}}]'
        return _openai_body(rng, tools=tools), "tools[0].function.name"
    if where == 4:
        return b"{" + f'"{bad}": 1, '.encode() + _openai_body(rng)[1:], "body"
    if where == 5:
        message = f'[{{"role": "user", "content": "1+1=", "{bad}": 2}}]'
        return _openai_body(rng, messages=message), "messages[0]"
    params = f'{{"type": "object", "properties": {{"{bad}": {{}}}}}}'
    tools = f'[{{"type": "function", "function": {{"name": "add", "parameters": {params}}}}}]'
    return _openai_body(rng, tools=tools), "tools[0].function.parameters.properties"


def gen_openai_huge_int(rng: random.Random) -> tuple[bytes, str]:
    """Issue 41, item 8: an integer of 5,000 digits (past Python's 4,300-digit limit) in any
    field: a 400 naming ``body`` (the parser cannot read it, so no field is known)."""
    big = "9" * rng.randrange(4400, 6000)
    name = rng.choice(["seed", "max_tokens", "temperature", "n", "top_logprobs"])
    return _openai_body(rng, **{name: big}), "body"


def _huge_conversation(rng: random.Random, max_body: int) -> bytes:
    """Issue 41, item 2: 4,096 messages filling a body just under ``max_body`` bytes."""
    size = (max_body - 4096) // 4096 - len('{"role": "assistant", "content": ""}, ')
    texts = ["".join(rng.choices("abcdefgh ", k=size)) for _ in range(16)]
    messages = [{"role": ("user", "assistant")[i % 2], "content": rng.choice(texts)}
                for i in range(4096)]
    return json.dumps({"model": "policy", "messages": messages}).encode()


def _drill_policy(prompt: str, k: int) -> str:
    """The drill's scripted policy: one of :data:`OPENAI_BAD_REPLIES` when the prompt asks for
    it, else a short answer."""
    for name, reply in OPENAI_BAD_REPLIES.items():
        if f"reply {name}" in prompt:
            return reply
    return "2"


class _LoopWatch:
    """A stand-in for the RaaS's event loop (the one its episodes, leases, pushes and weight
    refreshes share), on its own thread: a ticker records the longest gap between its ticks."""

    def __init__(self, tick_s: float = 0.005):
        import asyncio
        import threading

        self.tick_s, self.max_gap_s, self._stopping = tick_s, 0.0, False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="drill-raas-loop")
        self.thread.start()
        self._ticker = asyncio.run_coroutine_threadsafe(self._tick(), self.loop)

    async def _tick(self) -> None:
        import asyncio

        last = time.perf_counter()
        while not self._stopping:
            await asyncio.sleep(self.tick_s)
            now = time.perf_counter()
            self.max_gap_s = max(self.max_gap_s, now - last - self.tick_s)
            last = now

    def close(self) -> None:
        self._stopping = True
        self._ticker.result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def _judge_openai(counts: Counter, r, expect: str | None) -> None:
    """Count one answer: ``expect`` is the field its 400 must name, or None for a call that
    must be served (200) without returning a tool call (its completion's were unreadable)."""
    counts["requests"] += 1
    if r is None:
        counts["no_answer"] += 1
        return
    counts[f"status_{r.status_code}"] += 1
    if r.status_code >= 500:
        counts["status_5xx"] += 1
    elif expect is None:
        if r.status_code != 200:
            counts["unexpected_status"] += 1
        elif r.json()["choices"][0]["message"].get("tool_calls"):
            counts["accepted_bad"] += 1  # an unreadable tool call handed to the agent
    elif 200 <= r.status_code < 300:
        counts["accepted_bad"] += 1
    elif r.status_code != 400 or (r.json().get("error") or {}).get("param") != expect:
        counts["unexpected_status"] += 1


def _post(http, url: str, body: bytes):
    try:
        return http.post(url, content=body)
    except Exception:  # noqa: BLE001 - no answer
        return None


def _huge_with_calls_beside(http, url: str, body: bytes, watch: _LoopWatch,
                            counts: Counter) -> None:
    """Send one huge conversation; while it is served, small calls go on beside it, and the
    episode loop's longest gap is measured. The huge one must be a 400 naming ``messages``."""
    import threading

    import httpx

    answer: list = []

    def send_huge() -> None:
        t0 = time.perf_counter()
        answer.append(_post(http, url, body))
        answer.append(time.perf_counter() - t0)

    sender = threading.Thread(target=send_huge)
    beside = []
    with httpx.Client(timeout=60.0, headers=http.headers) as other:
        watch.max_gap_s = 0.0
        sender.start()
        while sender.is_alive():
            t1 = time.perf_counter()
            r = _post(other, url, _openai_body(random.Random(len(beside))))
            beside.append(time.perf_counter() - t1)
            _judge_openai(counts, r, None)
    sender.join()
    counts["huge_answer_ms"] = max(counts["huge_answer_ms"], round(answer[1] * 1000))
    counts["calls_beside_huge"] += len(beside)
    counts["calls_beside_huge_slowest_ms"] = max(counts["calls_beside_huge_slowest_ms"],
                                                 round(max(beside, default=0) * 1000))
    counts["loop_gap_during_huge_ms"] = max(counts["loop_gap_during_huge_ms"],
                                            round(watch.max_gap_s * 1000))
    _judge_openai(counts, answer[0], "messages")
    if answer[0] is not None and answer[0].status_code == 400:
        error = answer[0].json()["error"]
        counts["huge_refused_" + str(error["code"])] += 1
        counts["huge_refused_before_tokenizing"] += "at least" in error["message"]
    if watch.max_gap_s > OPENAI_LOOP_FREEZE_S:
        counts["loop_freezes"] += 1
        counts["crashes"] += 1  # every episode, lease, push and weight refresh stood still


def openai_drill(rng: random.Random, n: int, huge: int = OPENAI_HUGE_CONVERSATIONS) -> Counter:
    """``openai`` (issue 41, items 2, 4 and 8): the RaaS's OpenAI endpoint (its real server,
    started in this process as the RaaS starts it), serving a scripted policy with the tiny chat
    tokenizer and a 512-token context, whose episode runs on a stand-in for the RaaS's event loop
    (:class:`_LoopWatch`). It gets ``n`` bad requests -- a lone surrogate in a message, ``stop``,
    a tool name or a field name, an integer of 5,000 digits (each a 400 naming the field), or a
    call whose completion holds a tool call no parser reads (nested 1,200 deep, 5,000 digits,
    20,000 unclosed tags: each served 200 with no tool call) -- then ``huge`` conversations of
    4,096 messages just under the 8 MiB body limit (each a 400 naming ``messages``, refused
    before tokenizing) with small calls served beside them. A 5xx counts in ``status_5xx``, a
    2xx refusal or a returned unreadable tool call in ``accepted_bad``; an episode loop that
    stood still longer than :data:`OPENAI_LOOP_FREEZE_S` (``loop_freezes``) or an endpoint that
    stopped serving counts in ``crashes``."""
    repo = str(Path(__file__).resolve().parents[2])
    if repo not in sys.path:  # run as a script: the shared engine fakes live in the tests package
        sys.path.insert(0, repo)
    import httpx

    from astralight.raas.openai_endpoint import EpisodeSettings, OpenAIEndpoint
    from astralight.raas.openai_requests import MAX_BODY_BYTES
    from astralight.trainer.tinymodel import build_chat_tokenizer
    from tests.unit.engine_fakes import PromptScriptEngine

    counts: Counter = Counter()
    watch = _LoopWatch()
    engine = PromptScriptEngine(_drill_policy, build_chat_tokenizer(), max_model_len=512)
    endpoint = OpenAIEndpoint().start()
    try:
        ep = endpoint.open_episode(engine, "policy", EpisodeSettings(max_calls=1 << 30),
                                   loop=watch.loop)
        url = endpoint.base_url(ep.id) + "/chat/completions"
        headers = {"Authorization": f"Bearer {endpoint.token}",
                   "Content-Type": "application/json"}
        with httpx.Client(timeout=120.0, headers=headers) as http:
            for _ in range(n):
                kind = rng.choice(["surrogate", "huge_int", "bad_tool_call"])
                counts[f"sent_{kind}"] += 1
                if kind == "bad_tool_call":
                    reply = rng.choice(sorted(OPENAI_BAD_REPLIES))
                    body, expect = _openai_body(rng, messages=json.dumps(
                        [{"role": "user", "content": f"reply {reply}"}]),
                        tools=json.dumps(_ADD_TOOL)), None
                else:
                    body, expect = (gen_openai_surrogate if kind == "surrogate"
                                    else gen_openai_huge_int)(rng)
                r = _post(http, url, body)
                _judge_openai(counts, r, expect)
                if kind == "bad_tool_call" and r is not None and r.status_code == 200 and \
                        ep.calls[-1].tool_call_errors["malformed"] < 1:
                    counts["malformed_not_counted"] += 1  # passed over silently
                    counts["accepted_bad"] += 1
            counts["loop_gap_during_bad_requests_ms"] = round(watch.max_gap_s * 1000)
            for _ in range(huge):
                _huge_with_calls_beside(http, url, _huge_conversation(rng, MAX_BODY_BYTES),
                                        watch, counts)
            after = _post(http, url, _openai_body(rng))
            serving = after is not None and after.status_code == 200
            counts["crashes"] += 0 if serving and watch.thread.is_alive() else 1
    finally:
        endpoint.close()
        engine.close()
        watch.close()
    return counts


def token_start_drill(tmp: Path) -> Counter:
    """``blank_token`` / ``short_public_token``: a service started with a blank
    ``ASTRALIGHT_TOKEN``, or on a public address with a token under 16 bytes, must refuse to
    start (exit status 2, before it serves). Each start that serves is an ``accepted_bad``."""
    counts: Counter = Counter()
    env_base = {k: v for k, v in os.environ.items()
                if not (k.startswith("ASTRALIGHT_") and k.endswith(("_TOKEN", "_TOKEN_FILE")))}
    for name, host, token in (("blank_token", "127.0.0.1", "   "),
                              ("blank_token", "127.0.0.1", ""),
                              ("short_public_token", "0.0.0.0", "short-token")):
        folder = tmp / f"start-{counts['requests']}"
        folder.mkdir()
        cfg = folder / "dataflow.yaml"
        cfg.write_text(json.dumps({"host": host, "port": 0, "state_dir": str(folder / "state"),
                                   "log_level": "ERROR"}))
        proc = subprocess.run([sys.executable, "-m", "astralight.dataflow.service", "--config",
                               str(cfg)], env={**env_base, "ASTRALIGHT_TOKEN": token},
                              capture_output=True, text=True, timeout=60)
        counts["requests"] += 1
        counts[f"{name}_exit_{proc.returncode}"] += 1
        if "serving on" in proc.stdout or proc.returncode != 2:
            counts["accepted_bad"] += 1
    return counts


#: the ``slow_headers`` drill: stalled connections (more than its service's max_connections) ...
SLOW_HEADER_STALLED = 300
#: ... then valid requests, each on a new connection, that must all be answered ...
SLOW_HEADER_VALID = 50
#: ... by a service with these limits
SLOW_HEADER_LIMITS = {"header_timeout_s": 3.0, "max_connections": 128}


def _stalled_connections(url: str, rng: random.Random, n: int, token: str) -> list:
    """``n`` connections, each sending a random prefix (possibly empty) of a valid request head
    and then nothing."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    head = (f"GET /v1/info HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: Bearer {token}\r\n\r\n").encode()
    out = []
    for _ in range(n):
        sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        try:
            sock.sendall(head[:rng.randrange(0, len(head) - 1)])  # never the final CRLF
        except OSError:  # already closed to make room for a newer one
            pass
        out.append(sock)
    return out


def _wait_closed(socks: list, bound_s: float) -> list:
    """What each socket received until the service closed it, waiting up to ``bound_s`` in all
    (None: still open then)."""
    import select

    got = {s: b"" for s in socks}
    open_ = set(socks)
    deadline = time.monotonic() + bound_s
    while open_ and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_), [], [], 0.5)
        for sock in ready:
            try:
                chunk = sock.recv(65536)
            except OSError:
                chunk = b""
            got[sock] += chunk
            if not chunk:
                open_.discard(sock)
    return [None if s in open_ else got[s] for s in socks]


def slow_headers_drill(tmp: Path, rng: random.Random, stalled: int, valid: int, max_body: int,
                       max_file: int, token: str) -> Counter:
    """``slow_headers`` (issue 41, item 3): on a service with :data:`SLOW_HEADER_LIMITS` and a
    token, ``stalled`` connections each send part of a request head and stall; then ``valid``
    requests with the token, each on a new connection, must all be answered 200 (one that is
    not counts as a ``crashes``: the service stopped serving), and every stalled connection must
    be closed (evicted at ``max_connections``, or a 408 after ``header_timeout_s``) within a
    generous bound: one the service still holds then is an ``accepted_bad``.
    ``episode_warnings``: the service's log lines for the flood (one is right)."""
    import httpx

    folder = tmp / "slow-headers"
    folder.mkdir()
    proc, url = start_service(folder, token, max_body, max_file,
                              overrides={**SLOW_HEADER_LIMITS, "log_level": "WARNING"})
    counts: Counter = Counter()
    socks: list = []
    try:
        socks = _stalled_connections(url, rng, stalled, token)
        counts["requests"] += stalled
        slowest = 0.0
        for _ in range(valid):
            counts["requests"] += 1
            t0 = time.perf_counter()
            try:
                r = httpx.get(f"{url}/v1/info", headers={"Authorization": f"Bearer {token}"},
                              timeout=30.0)
            except Exception:  # noqa: BLE001 - no answer
                counts["no_answer"] += 1
                continue
            slowest = max(slowest, time.perf_counter() - t0)
            counts[f"status_{r.status_code}"] += 1
            counts["status_5xx"] += r.status_code >= 500
            counts["valid_answered_200"] += r.status_code == 200
        counts["valid_slowest_ms"] = round(slowest * 1000)
        # a valid request left unanswered: the service stopped serving, what the drill is for
        counts["crashes"] += counts["valid_answered_200"] != valid
        t0 = time.perf_counter()
        answers = _wait_closed(socks, SLOW_HEADER_LIMITS["header_timeout_s"] + 30.0)
        counts["stalled_all_closed_after_ms"] = round((time.perf_counter() - t0) * 1000)
        counts["stalled_timed_out_408"] = sum(1 for a in answers
                                              if a and a.startswith(b"HTTP/1.1 408"))
        counts["stalled_closed_silently"] = sum(1 for a in answers if a == b"")
        counts["stalled_left_open"] = sum(1 for a in answers if a is None)
        counts["accepted_bad"] += counts["stalled_left_open"]
        alive = proc.poll() is None and httpx.get(
            f"{url}/v1/info", headers={"Authorization": f"Bearer {token}"},
            timeout=30.0).status_code == 200
        counts["crashes"] += 0 if alive else 1
    finally:
        for sock in socks:
            sock.close()
        stop_process(proc)
    counts["episode_warnings"] = sum("slow or excess connections:" in line for line in
                                     (folder / "dataflow.log").read_text(errors="replace")
                                     .splitlines())
    return counts


def run(requests: int, seed: int, check_every: int = 250) -> dict:
    import httpx

    digest = hashlib.sha256(str(seed).encode()).hexdigest()
    token = "fuzz-" + digest[:24]
    scoped = {scope: f"fuzz-{scope}-{digest[24 + 8 * i:32 + 8 * i]}"  # 16+ characters
              for i, scope in enumerate(auth.SCOPES)}
    max_body, max_file = 64 * 1024, 256 * 1024
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_service(Path(tmp), token, max_body, max_file, scoped)
        try:
            with httpx.Client(base_url=url, timeout=30.0) as http:
                ctx = prepare(http, token=token, max_body_bytes=max_body,
                              max_weight_file_bytes=max_file, scoped=scoped)
                stats_before = http.get("/v1/stats", headers=ctx.auth()).json()
                before = stats_before["models"]["policy"]
                rng = random.Random(seed)
                per_cat: dict[str, Counter] = defaultdict(Counter)
                examples: list[dict] = []
                status_5xx = accepted_bad = no_answer = crashes = unexpected = 0
                t0 = time.perf_counter()
                sent = 0
                for sent in range(1, requests + 1):
                    req = generate(rng, ctx)
                    out = send(http, req, ctx)
                    c = per_cat[req.category]
                    c["requests"] += 1
                    c[f"status_{out.status}" if out.status else "no_answer"] += 1
                    if out.status is None:
                        no_answer += 1
                    elif out.status >= 500:
                        status_5xx += 1
                    if out.accepted_bad:
                        accepted_bad += 1
                    if out.unexpected:
                        unexpected += 1
                        c["unexpected_status"] += 1
                    if (out.status is None or out.status >= 500 or out.accepted_bad
                            or out.unexpected) and len(examples) < 10:
                        examples.append({"category": req.category, "method": req.method,
                                         "path": req.path[:120], "status": out.status,
                                         "detail": out.detail})
                    if (out.status is None or sent % check_every == 0) and \
                            not healthy(http, ctx, proc):
                        crashes += 1
                        break
                elapsed = time.perf_counter() - t0
                alive = healthy(http, ctx, proc)
                crashes += 0 if alive or crashes else 1
                after = (http.get("/v1/stats", headers=ctx.auth()).json() if alive else {})
                clients = after.get("clients", {})
                model_after = after.get("models", {}).get("policy", {})
                changed = (state_changes(state_of(stats_before, ctx.model_id),
                                         state_of(after, ctx.model_id)) if alive else {})
                accepted_bad += len(changed)  # something a refused request did anyway
            if alive:
                counts, proc, url = killed_upload(Path(tmp), token, proc, url, ctx, max_body,
                                                  max_file, scoped)
                per_cat["killed_upload"] = counts
                accepted_bad += counts["temp_files_after_restart"]
                with httpx.Client(base_url=url, timeout=30.0) as http:
                    crashes += 0 if healthy(http, ctx, proc) else 1
            per_cat["host"] = host_drill(Path(tmp), rng, HOST_DRILL_REQUESTS, max_body, max_file)
            per_cat["bound_model"] = bound_model_drill(Path(tmp), rng, HOST_DRILL_REQUESTS,
                                                       max_body, max_file, token, scoped)
            per_cat["slow_headers"] = slow_headers_drill(Path(tmp), rng, SLOW_HEADER_STALLED,
                                                         SLOW_HEADER_VALID, max_body, max_file,
                                                         token)
            per_cat["openai"] = openai_drill(rng, OPENAI_DRILL_REQUESTS)
            for drill in (per_cat["host"], per_cat["bound_model"], per_cat["slow_headers"],
                          per_cat["openai"]):
                status_5xx += drill["status_5xx"]
                accepted_bad += drill["accepted_bad"]
                crashes += drill["crashes"]
                no_answer += drill["no_answer"]
                unexpected += drill["unexpected_status"]
            starts = token_start_drill(Path(tmp))
            per_cat["token_start"] = starts
            accepted_bad += starts["accepted_bad"]
        finally:
            stop_process(proc)
    return {
        "requests": sent, "status_5xx": status_5xx, "crashes": crashes,
        "accepted_bad": accepted_bad, "no_answer": no_answer,
        "unexpected_status": unexpected, "state_changed": changed,
        "requests_per_s": round(sent / elapsed, 1) if elapsed > 0 else None,
        "elapsed_s": round(elapsed, 2), "seed": seed,
        "samples_accepted_during_fuzz": (model_after.get("samples_accepted", 0)
                                         - before.get("samples_accepted", 0)) if model_after else None,
        "duplicates_ignored_during_fuzz": (model_after.get("duplicates_ignored", 0)
                                           - before.get("duplicates_ignored", 0)) if model_after else None,
        "client_failures_4xx": {a: c["failures_4xx"] for a, c in clients.items()},
        "categories": {k: dict(sorted(v.items())) for k, v in sorted(per_cat.items())},
        "examples": examples,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    result = run(args.requests, args.seed)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key in ("requests", "status_5xx", "crashes", "accepted_bad", "unexpected_status",
                    "state_changed", "requests_per_s"):
            print(f"{key}: {result[key]}")
        for cat, counts in result["categories"].items():
            print(f"  {cat}: {counts}")
    bad = result["status_5xx"] or result["crashes"] or result["accepted_bad"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
