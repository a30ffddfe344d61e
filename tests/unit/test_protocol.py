"""The wire codec: every message round-trips bit-exactly, and every kind of bad input is refused
with a ProtocolError naming the offending field."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astralight.protocol import (SCHEMA_VERSION, Batch, ProtocolError, Sample, Task, WeightManifest,
                                 decode, encode, expect)


def make_sample(T: int = 6, task_id: str = "t0", index: int = 0, reward: float = 1.0) -> Sample:
    rng = np.random.default_rng(index)
    return Sample(task_id=task_id, sample_index=index, model_id="policy",
                  token_ids=rng.integers(0, 1000, T).astype(np.int32),
                  logprobs=np.concatenate([np.zeros(2), -rng.random(T - 2)]).astype(np.float32),
                  loss_mask=np.array([0, 0] + [1] * (T - 2), np.uint8),
                  versions=np.array([-1, -1] + [3] * (T - 2), np.int32),
                  reward=reward, prompt_len=2, group_index=1, role="solver", advantage=0.5,
                  group_mean=0.25, group_std=0.1, metadata={"temperature": 1.0, "finish_reason": "stop"})


def assert_same_sample(a: Sample, b: Sample) -> None:
    for name in ("token_ids", "logprobs", "loss_mask", "versions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
    for name in ("task_id", "sample_index", "model_id", "reward", "prompt_len", "group_index",
                 "role", "advantage", "group_mean", "group_std", "metadata"):
        assert getattr(a, name) == getattr(b, name), name


def wire(obj) -> dict:
    """The msgpack envelope of ``obj`` as a mutable dict, to corrupt it field by field."""
    return msgpack.unpackb(encode(obj), raw=False)


def pack(env: dict) -> bytes:
    return msgpack.packb(env, use_bin_type=True)


def refused(data: bytes, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(data, **kw)
    return info.value


# ----------------------------------------------------------------------------- round trips


def test_task_round_trip():
    task = Task(task_id="train:7", prompt="37+45=", n=8, model_ids=["policy", "critic"],
                workflow="single_turn", kind="eval", eval_version=5, metadata={"answer": "82"},
                lease_deadline=1234.5)
    assert decode(encode(task)) == task


def test_sample_round_trip_is_bit_exact():
    s = make_sample()
    s.logprobs[3] = np.float32(-0.0)  # signed zero and subnormals survive as raw bytes
    s.logprobs[4] = np.float32(-1e-42)
    back = decode(encode(s))
    assert isinstance(back, Sample)
    assert_same_sample(s, back)
    assert back.min_version == 3


def test_batch_round_trip():
    batch = Batch(batch_id="b1", model_id="policy", policy_version=4,
                  samples=[make_sample(index=i, T=5 + i) for i in range(3)])
    back = expect(decode(encode(batch)), Batch)
    assert (back.batch_id, back.model_id, back.policy_version) == ("b1", "policy", 4)
    assert len(back.samples) == 3
    for a, b in zip(batch.samples, back.samples):
        assert_same_sample(a, b)


def test_manifest_round_trip():
    m = WeightManifest(model_id="policy", version=3, kind="delta", base_version=2,
                       files={"delta.zst": {"sha256": "ab" * 32, "bytes": 10}},
                       tensors={"w": {"dtype": "bfloat16", "shape": [2, 2], "sha256": "cd" * 32}},
                       created=1.5, metadata={"step": 30})
    assert decode(encode(m)) == m


def test_plain_request_map_with_nested_messages_round_trips():
    msg = {"instance_id": "raas-1", "task_id": "t0", "samples": [make_sample(), make_sample(index=1)]}
    back = decode(encode(msg))
    assert back["instance_id"] == "raas-1"
    assert_same_sample(msg["samples"][1], back["samples"][1])
    assert decode(encode(None)) is None


# ----------------------------------------------------------------------------- rejections


def test_wrong_dtype_is_refused_naming_the_array():
    env = wire(make_sample())
    arr = env["body"]["token_ids"]
    arr["dtype"], arr["data"] = "float32", np.zeros(6, np.float32).tobytes()
    assert refused(pack(env)).field == "body.token_ids"


def test_dtype_not_allowed_on_the_wire_is_refused():
    env = wire(make_sample())
    env["body"]["logprobs"]["dtype"] = "complex64"
    assert refused(pack(env)).field == "body.logprobs.dtype"


def test_shape_data_mismatch_is_refused():
    env = wire(make_sample())
    env["body"]["versions"]["data"] = env["body"]["versions"]["data"][:-4]
    assert refused(pack(env)).field == "body.versions.data"


def test_length_mismatch_between_arrays_is_refused():
    env = wire(make_sample())
    env["body"]["loss_mask"] = {"__nd__": True, "dtype": "uint8", "shape": [5],
                                "data": np.ones(5, np.uint8).tobytes()}
    err = refused(pack(env))
    assert err.field == "body.loss_mask" and "length 5" in str(err)


def test_two_dimensional_array_is_refused():
    env = wire(make_sample())
    env["body"]["token_ids"]["shape"] = [2, 3]
    assert refused(pack(env)).field == "body.token_ids"


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_refused(reward):
    env = wire(make_sample())
    env["body"]["reward"] = reward
    assert refused(pack(env)).field == "body.reward"


def test_positive_logprob_is_refused():
    s = make_sample()
    s.logprobs[3] = 0.7
    assert refused(encode(s)).field == "body.logprobs"


@pytest.mark.parametrize("bad", [np.nan, -np.inf, np.inf])
def test_non_finite_logprob_is_refused(bad):
    s = make_sample()
    s.logprobs[4] = bad
    assert refused(encode(s)).field == "body.logprobs"


def test_nesting_deeper_than_the_limit_is_refused_naming_where():
    from astralight.protocol import MAX_DEPTH

    def nested(levels: int):
        obj: object = 1
        for i in range(levels):
            obj = {"k": obj} if i % 2 else [obj]
        return obj

    err = refused(pack({"schema": SCHEMA_VERSION, "body": {"deep": nested(MAX_DEPTH)}}))
    assert "nested deeper" in str(err) and err.field.startswith("body.deep")
    assert decode(pack({"schema": SCHEMA_VERSION, "body": nested(MAX_DEPTH)})) == nested(MAX_DEPTH)


def test_array_in_foreign_byte_order_arrives_with_its_values():
    s = make_sample()
    s.token_ids = s.token_ids.astype(">i4")
    back = decode(encode(s))
    assert back.token_ids.dtype == np.int32
    assert back.token_ids.tolist() == s.token_ids.tolist()


def test_containers_that_are_not_plain_dicts_or_lists_encode_as_maps_and_arrays():
    from collections import OrderedDict

    body = OrderedDict(a=(1, 2), b=[np.int64(3), np.float32(0.5)], s=make_sample())
    back = decode(encode(body))
    assert back["a"] == [1, 2] and back["b"] == [3, 0.5]
    assert_same_sample(back["s"], body["s"])


def test_missing_required_field_is_refused():
    env = wire(make_sample())
    del env["body"]["model_id"]
    assert refused(pack(env)).field == "body.model_id"


def test_nested_bad_sample_in_a_batch_is_located():
    batch = Batch(batch_id="b", model_id="policy", policy_version=0,
                  samples=[make_sample(), make_sample(index=1)])
    env = wire(batch)
    env["body"]["samples"][1]["reward"] = "high"
    assert refused(pack(env)).field == "body.samples[1].reward"


def test_bad_schema_version_is_refused():
    env = wire(make_sample())
    env["schema"] = SCHEMA_VERSION + 1
    err = refused(pack(env))
    assert err.field == "schema" and str(SCHEMA_VERSION + 1) in str(err)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"not msgpack at all", b"\x92\x01\x02",
                                  msgpack.packb({"schema": 1})])
def test_garbage_bytes_are_refused(data):
    assert refused(data).field == "body"


def test_oversized_body_is_refused_before_parsing():
    data = encode(make_sample(T=1000))
    err = refused(data, max_bytes=len(data) - 1)
    assert err.field == "body" and "exceeds" in str(err)
    assert isinstance(decode(data, max_bytes=len(data)), Sample)


def test_unknown_type_tag_is_refused():
    env = wire(make_sample())
    env["body"]["__type__"] = "Pickle"
    assert refused(pack(env)).field == "body.__type__"


def test_bad_manifest_file_name_is_refused():
    m = WeightManifest(model_id="p", version=1, kind="full", files={"../etc": {"sha256": "00"}})
    assert refused(encode(m)).field == "body.files"


def test_expect_names_the_wrong_type():
    with pytest.raises(ProtocolError) as info:
        expect(make_sample(), Batch, "batch")
    assert info.value.field == "batch"


# ----------------------------------------------------------------------------- property-based

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def samples(draw) -> Sample:
    T = draw(st.integers(1, 48))
    prompt_len = draw(st.integers(0, T))
    ids = draw(st.lists(st.integers(0, 2**31 - 1), min_size=T, max_size=T))
    lps = draw(st.lists(st.floats(-50.0, 0.0, width=32), min_size=T, max_size=T))
    mask = draw(st.lists(st.integers(0, 1), min_size=T, max_size=T))
    vers = draw(st.lists(st.integers(-1, 2**31 - 1), min_size=T, max_size=T))
    return Sample(task_id=draw(st.text(max_size=20)), sample_index=draw(st.integers(0, 2**40)),
                  model_id=draw(st.text(min_size=1, max_size=10)),
                  token_ids=np.array(ids, np.int32), logprobs=np.array(lps, np.float32),
                  loss_mask=np.array(mask, np.uint8), versions=np.array(vers, np.int32),
                  reward=draw(finite), prompt_len=prompt_len, advantage=draw(finite),
                  group_mean=draw(finite), group_std=draw(finite),
                  metadata=draw(st.dictionaries(st.text(max_size=8),
                                                st.one_of(st.integers(-2**31, 2**31), st.text(max_size=8),
                                                          finite, st.booleans()), max_size=4)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples())
def test_property_sample_round_trip(sample):
    assert_same_sample(sample, decode(encode(sample)))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(samples(), min_size=0, max_size=4), st.integers(0, 2**31))
def test_property_batch_round_trip(items, version):
    back = decode(encode(Batch(batch_id="b", model_id="m", policy_version=version, samples=items)))
    assert back.policy_version == version and len(back.samples) == len(items)
    for a, b in zip(items, back.samples):
        assert_same_sample(a, b)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=256))
def test_property_random_bytes_never_crash_the_decoder(data):
    try:
        decode(data)
    except ProtocolError as exc:
        assert exc.field  # always names a field
