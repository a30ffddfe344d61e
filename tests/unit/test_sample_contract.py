"""The sample contract stated in :class:`astralight.workflows.base.Workflow` is the one the code
keeps: the metadata keys it lists are exactly those the readers read (a key read but not
documented, or documented but read nowhere, fails here), and each stated rule holds when samples
are built and fed to the code that reads them (pass@k's reward > 0.5, first attempts only,
``team_correct``, the temperature check that a missing key skips, ``sample_index`` unique per
task and model_id, the engine's ``max_model_len``)."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import numpy as np
import pytest

from astralight.agents import stats as agent_stats
from astralight.dataflow import evals, sample_filters
from astralight.dataflow.errors import ServiceError
from astralight.datamodules.rollout import collate_batch
from astralight.engine import Engine, engine_limits
from astralight.policy import RLPolicy
from astralight.protocol import Batch, Sample, check_sample_metadata
from astralight.workflows.base import Workflow
from tests.unit.batch_ack_flow import make

#: the code that reads sample metadata: the trainer's collate, the ingest check, the eval
#: summary, the agent counters, the sample filters
READERS = (collate_batch, check_sample_metadata, evals.summarize, agent_stats, sample_filters)


def documented_keys() -> set[str]:
    return set(re.findall(r'metadata\["(\w+)"\]', Workflow.__doc__))


#: how a reader looks a key up, on a line that mentions ``metadata``: ``.get("k")``,
#: ``["k"]``, ``"k" in s.metadata``, or a loop over a tuple of keys
LOOKUPS = (r'\.get\(\s*"(\w+)"', r'\[\s*"(\w+)"\s*\]', r'"(\w+)"\s+in\s+[\w.]*metadata')
KEY_TUPLE = r'for \w+ in \(([^)]*)\)'


def read_keys() -> set[str]:
    """The metadata keys the readers look up (see :data:`LOOKUPS`)."""
    keys: set[str] = set()
    for reader in READERS:
        for line in inspect.getsource(reader).splitlines():
            if "metadata" not in line:
                continue
            for pattern in LOOKUPS:
                keys.update(re.findall(pattern, line))
            for group in re.findall(KEY_TUPLE, line):
                keys.update(re.findall(r'"(\w+)"', group))
    return keys


def test_the_documented_metadata_keys_are_exactly_the_ones_the_code_reads():
    assert documented_keys() == read_keys()
    assert {"temperature", "attempt", "team_correct"} <= documented_keys()


def _sample(reward: float, index: int = 0, **metadata) -> Sample:
    return Sample(task_id="t", sample_index=index, model_id="policy",
                  token_ids=np.array([1, 2, 3], np.int32),
                  logprobs=np.array([0, -1, -1], np.float32),
                  loss_mask=np.array([0, 1, 1], np.uint8),
                  versions=np.array([-1, 4, 5], np.int32), reward=reward, metadata=metadata)


def test_correct_for_pass_at_k_means_reward_above_one_half():
    assert "reward > 0.5" in Workflow.__doc__ and evals.CORRECT_THRESHOLD == 0.5
    report = evals.summarize([_sample(0.5, 0), _sample(0.51, 1), _sample(1.0, 2)])
    assert report["n_correct"] == 2 and report["sum_reward"] == pytest.approx(2.01)
    assert (report["min_version"], report["max_version"]) == (4, 5)  # generated-token versions


def test_only_first_attempts_count_and_team_correct_gives_the_team_accuracy():
    samples = [_sample(0.0, 0, attempt=0, team_correct=True),
               _sample(1.0, 1, attempt=1, team_correct=True),  # a retry: not the policy's
               _sample(1.0, 2, attempt=0, team_correct=False)]
    report = evals.summarize(samples)
    assert (report["n_samples"], report["n_correct"], report["n_team_correct"]) == (2, 1, 1)
    # without team_correct on every first attempt there is no team accuracy
    assert evals.summarize([_sample(1.0, 0, attempt=0)])["n_team_correct"] is None


def test_the_temperature_check_runs_only_when_the_sample_says_its_temperature():
    policy = SimpleNamespace(model_id="policy", temperature=1.0)

    def batch(**metadata):
        return collate_batch(Batch(batch_id="b", model_id="policy", policy_version=5,
                                   samples=[_sample(1.0, 0, **metadata)]))

    with pytest.raises(ValueError, match="sample temperature 0.7 != module temperature 1"):
        RLPolicy.check_batch(policy, batch(temperature=0.7))
    RLPolicy.check_batch(policy, batch(temperature=1.0))
    silent = batch()  # no key: NaN, and the check has nothing to compare -- skipped
    assert np.isnan(silent["temperature"].numpy()).all()
    RLPolicy.check_batch(policy, silent)


def test_a_sample_index_repeated_within_a_task_and_model_refuses_the_push(tmp_path):
    flow = make(tmp_path)
    iid = flow.register(["policy"], 4, None, {})["instance_id"]
    task = flow.lease(iid, 1)[0]

    def pushed(indices):
        return [Sample(task_id=task.task_id, sample_index=i, model_id="policy",
                       token_ids=np.array([5, 6, 7], np.int32),
                       logprobs=np.array([0, -1, -1], np.float32),
                       loss_mask=np.array([0, 1, 1], np.uint8),
                       versions=np.array([-1, 0, 0], np.int32), reward=float(i))
                for i in indices]

    with pytest.raises(ServiceError) as info:
        flow.push(iid, task.task_id, pushed([0, 0]))
    assert info.value.status == 422 and info.value.field == "samples[1].sample_index"
    assert flow.push(iid, task.task_id, pushed([0, 1]))["accepted"] == 2
    flow.close()


def test_the_engine_contract_states_max_model_len_and_registers_it():
    assert "max_model_len" in Engine.__doc__ and "vocab_size" in Engine.__doc__
    engine = SimpleNamespace(max_model_len=128, vocab_size=50)
    assert engine_limits(engine) == {"max_model_len": 128, "vocab_size": 50}
    assert engine_limits(SimpleNamespace(max_model_len=None)) == {}
