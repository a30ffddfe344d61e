"""What the dataflow refuses on ingest so that no sample can stall staleness or crash a trainer
(issue 18, defects 2, 3, 6, 7 and 8): future versions on any token, samples with nothing to
train, log-probs below the floor, token ids outside the vocabulary, samples longer than the
engine's context (limits the RaaS registers), and metadata the trainer would refuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from astralight.dataflow.config import DataflowConfig
from astralight.dataflow.core import Dataflow
from astralight.dataflow.errors import ServiceError
from astralight.engine import engine_limits
from astralight.protocol import LOGPROB_FLOOR, MAX_VOCAB_SIZE, Sample, temperature_mismatch
from tests.unit.dataflow_fakes import publish, samples


def _flow(tmp_path, **kw) -> Dataflow:
    return Dataflow(DataflowConfig(state_dir=str(tmp_path / "state"), group_size=2, **kw))


def _lease(flow: Dataflow, limits: dict | None = None, n: int = 1):
    iid = flow.register(["policy"], 8, None, {}, limits=limits)["instance_id"]
    return iid, flow.lease(iid, n)


def _refused(flow, iid, task, group) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        flow.push(iid, task.task_id, group)
    assert info.value.status == 422
    return info.value


# ----------------------------------------------------------------------------- defect 2


def test_a_future_version_on_an_unmasked_token_is_refused(tmp_path):
    """loss_mask all 0 with versions 10^6 was accepted and then never went stale."""
    flow = _flow(tmp_path)
    iid, (task,) = _lease(flow)
    group = samples(task, [1, 0])
    group[1].versions[0] = 10 ** 6  # the prompt token's version, outside the loss mask
    err = _refused(flow, iid, task, group)
    assert err.field == "samples[1].versions" and "newer than the published version 0" in err.message
    flow.close()


def test_a_sample_without_a_loss_masked_token_is_refused(tmp_path):
    """Decision: refused (422 naming the field), like every other untrainable sample, rather
    than accepted with a made-up staleness."""
    flow = _flow(tmp_path)
    iid, (task,) = _lease(flow)
    group = samples(task, [1, 0])
    group[0].loss_mask[:] = 0
    err = _refused(flow, iid, task, group)
    assert err.field == "samples[0].loss_mask" and "no trained token" in err.message
    assert flow.stats()["models"]["policy"]["samples_accepted"] == 0
    flow.push(iid, task.task_id, samples(task, [1, 0]))  # the task is still open for a good push
    assert flow.stats()["models"]["policy"]["samples_accepted"] == 2
    flow.close()


# ----------------------------------------------------------------------------- defect 3


def test_log_probs_below_the_floor_are_refused(tmp_path):
    flow = _flow(tmp_path)
    iid, (task,) = _lease(flow)
    group = samples(task, [1, 0])
    group[1].logprobs[2] = -3e38
    err = _refused(flow, iid, task, group)
    assert err.field == "samples[1].logprobs" and "LOGPROB_FLOOR" in err.message
    group[1].logprobs[2] = LOGPROB_FLOOR  # the floor itself is a log-prob an engine may report
    assert flow.push(iid, task.task_id, group)["accepted"] == 2
    flow.close()


# ----------------------------------------------------------------------------- defects 6 and 7


def test_without_any_vocabulary_ids_no_tokenizer_has_are_refused(tmp_path):
    """No vocab_sizes and no registered limits: 2^31-1 reached the trainer's embedding."""
    flow = _flow(tmp_path)
    iid, (task,) = _lease(flow)
    group = samples(task, [1, 0])
    group[0].token_ids[1] = 2 ** 31 - 1
    err = _refused(flow, iid, task, group)
    assert err.field == "samples[0].token_ids" and f"[0, {MAX_VOCAB_SIZE})" in err.message
    flow.close()


def test_registered_engine_limits_bound_ids_and_length_without_config(tmp_path):
    flow = _flow(tmp_path)
    iid, (task,) = _lease(flow, limits={"policy": {"vocab_size": 64, "max_model_len": 3}})
    group = samples(task, [1, 0])
    group[0].token_ids[1] = 64
    err = _refused(flow, iid, task, group)
    assert err.field == "samples[0].token_ids" and "[0, 64)" in err.message
    long = samples(task, [1, 0])
    long[1] = Sample(task_id=task.task_id, sample_index=1, model_id="policy",
                     token_ids=np.ones(4, np.int32), logprobs=np.array([0, -1, -1, -1], np.float32),
                     loss_mask=np.array([0, 1, 1, 1], np.uint8),
                     versions=np.array([-1, 0, 0, 0], np.int32), reward=0.0)
    err = _refused(flow, iid, task, long)
    assert err.field == "samples[1].token_ids" and "max_model_len=3" in err.message
    assert flow.push(iid, task.task_id, samples(task, [1, 0]))["accepted"] == 2
    assert flow.info()["limits"]["policy"] == {"vocab_size": 64, "max_model_len": 3}
    flow.close()


def test_limits_survive_a_restart_and_apply_to_an_instance_that_registered_none(tmp_path):
    flow = _flow(tmp_path)
    _lease(flow, limits={"policy": {"vocab_size": 64, "max_model_len": 8}})
    flow.close()
    again = _flow(tmp_path)
    iid, (task,) = _lease(again)  # an older RaaS that says nothing: the pool's limits apply
    group = samples(task, [1, 0])
    group[1].token_ids[2] = 100
    assert _refused(again, iid, task, group).field == "samples[1].token_ids"
    again.close()


def test_a_registration_must_agree_with_vocab_sizes_and_with_the_pool(tmp_path):
    flow = _flow(tmp_path, vocab_sizes={"policy": 64})
    with pytest.raises(ServiceError) as info:
        flow.register(["policy"], 1, "r1", {}, limits={"policy": {"vocab_size": 65}})
    assert (info.value.status, info.value.field) == (422, "limits.policy.vocab_size")
    assert "vocab_sizes.policy" in info.value.message and "model_path" in info.value.message
    flow.close()
    free = _flow(tmp_path / "b")
    free.register(["policy"], 1, "r1", {}, limits={"policy": {"vocab_size": 64}})
    with pytest.raises(ServiceError) as info:
        free.register(["policy"], 1, "r2", {}, limits={"policy": {"vocab_size": 128}})
    assert info.value.field == "limits.policy.vocab_size" and "r1" in info.value.message
    free.register(["policy"], 1, "r1", {}, limits={"policy": {"vocab_size": 128}})  # its own: ok
    for bad, field in (({"other": {"vocab_size": 8}}, "limits.other"),
                       ({"policy": {"vocab_size": 0}}, "limits.policy.vocab_size"),
                       ({"policy": {"vocab_size": MAX_VOCAB_SIZE + 1}}, "limits.policy.vocab_size"),
                       ({"policy": {"max_model_len": True}}, "limits.policy.max_model_len"),
                       ({"policy": {"colour": 1}}, "limits.policy.colour"),
                       ({"policy": 5}, "limits.policy")):
        with pytest.raises(ServiceError) as info:
            free.register(["policy"], 1, "r3", {}, limits=bad)
        assert (info.value.status, info.value.field) == (422, field)
    free.close()


def test_engine_limits_read_what_an_engine_has():
    class Engine:
        vocab_size, max_model_len = 151936, 4096

    class Partial:
        max_model_len = None

    assert engine_limits(Engine()) == {"vocab_size": 151936, "max_model_len": 4096}
    assert engine_limits(Partial()) == {}


def test_the_raas_registers_its_engines_limits():
    """The RaaS says each engine's vocabulary and context at registration (no dataflow config)."""
    from astralight.raas.config import RaaSConfig
    from astralight.engine import SamplingSpec
    from astralight.raas.service import RaaSService
    from astralight.rewards.toy import ExactMatchReward
    from astralight.trainer.tinymodel import build_tokenizer
    from astralight.workflows.single_turn import SingleTurnWorkflow
    from tests.unit.engine_fakes import ScriptedEngine
    from tests.fakes import FakeDataflow

    engine = ScriptedEngine(build_tokenizer(), ["82"], max_model_len=32)
    engine.vocab_size = 96
    fake = FakeDataflow()
    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(max_tokens=4))
    cfg = RaaSConfig(dataflow="mem://", engines={"policy": {"model_path": "unused"}}, workflow=wf,
                     model_ids=["policy"])
    svc = RaaSService(cfg, client_factory=lambda: fake, engines={"policy": engine})
    svc.register(fake)
    assert fake.registered_limits == {"policy": {"vocab_size": 96, "max_model_len": 32}}


# ----------------------------------------------------------------------------- defect 8


def test_a_temperature_the_trainer_would_refuse_is_refused_on_ingest(tmp_path):
    """metadata {"temperature": 0.5} was accepted, then check_batch raised in the trainer."""
    flow = _flow(tmp_path, temperatures={"policy": 1.0})
    iid, (task,) = _lease(flow)
    group = samples(task, [1, 0])
    group[0].metadata = {"temperature": 0.5}
    err = _refused(flow, iid, task, group)
    assert err.field == "samples[0].metadata.temperature"
    assert "temperature 0.5 != the policy's temperature 1" in err.message
    assert temperature_mismatch(0.5, 1.0) and not temperature_mismatch(1.0 + 1e-7, 1.0)
    group[0].metadata = {"temperature": 1.0}
    assert flow.push(iid, task.task_id, group)["accepted"] == 2
    flow.close()


@pytest.mark.parametrize("metadata, field", [
    ({"temperature": "hot"}, "samples[0].metadata.temperature"),
    ({"temperature": float("nan")}, "samples[0].metadata.temperature"),
    ({"temperature": 0.0}, "samples[0].metadata.temperature"),
    ({"attempt": "first"}, "samples[0].metadata.attempt"),
    ({"tool_calls": 2 ** 64 - 1}, "samples[0].metadata.tool_calls"),
    ({"tool_errors": {"timeout": 2 ** 63}}, "samples[0].metadata.tool_errors.timeout"),
])
def test_metadata_a_consumer_would_fail_on_is_refused_without_config(tmp_path, metadata, field):
    flow = _flow(tmp_path)
    iid, (task,) = _lease(flow)
    group = samples(task, [1, 0])
    group[0].metadata = metadata
    assert _refused(flow, iid, task, group).field == field
    flow.close()


def test_temperatures_config_is_validated():
    with pytest.raises(ValueError, match="temperatures: 'x' is not one of model_ids"):
        DataflowConfig(temperatures={"x": 1.0})
    with pytest.raises(ValueError, match=r"temperatures.policy: must be the policy's sampling"):
        DataflowConfig(temperatures={"policy": 0})


def test_the_trainers_check_and_the_ingest_check_agree():
    """check_batch uses the same temperature_mismatch as the dataflow."""
    from astralight.policy import _BATCH_KEYS, RLPolicy

    policy = RLPolicy.__new__(RLPolicy)  # check_batch needs no model
    policy.temperature, policy.model_id = 1.0, "policy"
    keys = dict.fromkeys(_BATCH_KEYS)
    policy.check_batch({**keys, "temperature": torch.tensor([1.0 + 1e-7, float("nan")])})
    with pytest.raises(ValueError, match="sample temperature 0.5 != module temperature 1"):
        policy.check_batch({**keys, "temperature": torch.tensor([0.5])})


# ----------------------------------------------------------------------------- staleness after all


def test_samples_of_published_versions_still_go_stale(tmp_path):
    """With future versions refused, every accepted sample ages with the policy."""
    flow = _flow(tmp_path, max_staleness=1)
    iid, (task,) = _lease(flow)
    flow.push(iid, task.task_id, samples(task, [1, 0]))
    publish(flow, 1)
    publish(flow, 2)
    assert flow.pull("policy", 2) is None
    assert flow.stats()["models"]["policy"]["stale_dropped"] == 2
    flow.close()
