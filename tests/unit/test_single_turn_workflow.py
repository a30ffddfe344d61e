"""SingleTurnWorkflow: sample layout per the protocol, rewards, eval sampling, batching.

The main test runs a real (tiny) transformers model through HFEngine; the reward-path test uses
a scripted engine, because a random model never produces a correct answer.
"""

from __future__ import annotations

import numpy as np
import pytest

from astralight.engine import SamplingSpec
from astralight.protocol import Sample, Task, decode, encode
from astralight.rewards.toy import ExactMatchReward
from astralight.workflows.single_turn import SingleTurnWorkflow
from tests.unit.engine_fakes import ScriptedEngine, run_tasks


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    from astralight.raas.hf_engine import HFEngine

    engine = HFEngine(str(tiny_model_dir), seed=0, version=3)
    yield engine
    engine.close()


def _tasks():
    return [
        Task(task_id="t0", prompt="37+45=", n=3, model_ids=["policy"], metadata={"answer": "82"}),
        Task(task_id="t1", prompt="1+2=", n=2, model_ids=["policy"], metadata={"answer": "3"}),
        Task(task_id="e0", prompt="9+9=", n=2, model_ids=["policy"], kind="eval", eval_version=3,
             metadata={"answer": "18"}),
    ]


def test_samples_follow_the_protocol(hf_engine):
    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(temperature=0.7, max_tokens=5))
    out = run_tasks(wf, _tasks(), {"policy": hf_engine})
    assert sorted(out) == ["e0", "t0", "t1"]
    assert [len(out[t]) for t in ("t0", "t1", "e0")] == [3, 2, 2]
    tok = hf_engine.tokenizer
    for task_id, prompt in (("t0", "37+45="), ("t1", "1+2="), ("e0", "9+9=")):
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        for i, s in enumerate(out[task_id]):
            p = len(prompt_ids)
            assert s.sample_index == i and s.group_index == i and s.model_id == "policy"
            assert s.prompt_len == p
            assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
            assert s.loss_mask.dtype == np.uint8 and s.versions.dtype == np.int32
            assert len({len(s.token_ids), len(s.logprobs), len(s.loss_mask), len(s.versions)}) == 1
            assert s.token_ids[:p].tolist() == prompt_ids
            gen = len(s.token_ids) - p
            assert 1 <= gen <= 5
            assert s.loss_mask.tolist() == [0] * p + [1] * gen
            assert s.versions.tolist() == [-1] * p + [3] * gen
            assert np.all(s.logprobs[:p] == 0) and np.all(s.logprobs[p:] < 0)
            finish = s.metadata["finish_reason"]
            assert finish == ("stop" if s.token_ids[-1] == tok.eos_token_id else "length")
            assert s.reward == (1.0 if s.metadata["completion"] == {"t0": "82", "t1": "3",
                                                                    "e0": "18"}[task_id] else 0.0)
            expected_t = 1.0 if task_id == "e0" else 0.7
            assert s.metadata["temperature"] == expected_t
            # survives the wire unchanged
            back = decode(encode(s))
            assert isinstance(back, Sample) and back.token_ids.tolist() == s.token_ids.tolist()
    # n samples of one prompt are different draws, not copies
    assert len({tuple(s.token_ids.tolist()) for s in out["t0"]}) > 1


def test_behaviour_logprobs_match_a_forward_pass(hf_engine):
    import torch

    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(temperature=0.5, max_tokens=4))
    s = run_tasks(wf, _tasks()[:1], {"policy": hf_engine})["t0"][0]
    with torch.no_grad():
        logits = hf_engine.model(torch.tensor([s.token_ids.tolist()], dtype=torch.long)).logits[0]
    lp = torch.log_softmax(logits[:-1].float() / 0.5, -1)
    expected = lp.gather(-1, torch.tensor(s.token_ids[1:], dtype=torch.long)[:, None])[:, 0]
    gen = slice(s.prompt_len - 1, None)
    np.testing.assert_allclose(s.logprobs[s.prompt_len:], expected[gen].numpy(), atol=1e-4)


def test_rewards_eos_and_batching_with_a_scripted_engine():
    from astralight.trainer.tinymodel import build_tokenizer

    tok = build_tokenizer()
    engine = ScriptedEngine(tok, ["82", "81"])
    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(temperature=0.9, max_tokens=4))
    tasks = [Task(task_id=f"t{i}", prompt="37+45=", n=2, model_ids=["policy"],
                  metadata={"answer": "82"}) for i in range(3)]
    out = run_tasks(wf, tasks, {"policy": engine})
    assert engine.requests == 6  # one request per completion, all in flight together
    for t in tasks:
        rewards = [s.reward for s in out[t.task_id]]
        assert rewards == [1.0, 0.0]
        s = out[t.task_id][0]
        # EOS is part of the sample and trained on, but not part of the text the reward sees
        assert s.token_ids[-1] == tok.eos_token_id and s.loss_mask[-1] == 1
        assert s.metadata["completion"] == "82" and s.versions[-1] == 7


def test_eval_and_train_use_their_own_sampling_and_unknown_model_fails():
    from astralight.trainer.tinymodel import build_tokenizer

    engine = ScriptedEngine(build_tokenizer(), ["1"], finish="length")
    wf = SingleTurnWorkflow(ExactMatchReward(), sampling=SamplingSpec(temperature=0.6, max_tokens=3))
    tasks = _tasks()
    out = run_tasks(wf, tasks, {"policy": engine})
    temps = sorted({params.temperature for _, params in engine.calls})
    assert temps == [0.6, 1.0]
    assert out["e0"][0].metadata["finish_reason"] == "length"
    assert out["e0"][0].loss_mask[-1] == 1
    with pytest.raises(KeyError, match="no engine for 'other'"):
        run_tasks(wf, [Task(task_id="x", prompt="1+1=", n=1, model_ids=["other"])],
                  {"policy": engine})


def test_two_policies_get_distinct_sample_indices_and_roles():
    from astralight.trainer.tinymodel import build_tokenizer

    tok = build_tokenizer()
    engines = {"solver": ScriptedEngine(tok, ["2"], version=1),
               "verifier": ScriptedEngine(tok, ["2"], version=4)}
    wf = SingleTurnWorkflow(ExactMatchReward(), roles={"s": "solver", "v": "verifier"})
    out = run_tasks(wf, [Task(task_id="m", prompt="1+1=", n=2, model_ids=["solver", "verifier"],
                              metadata={"answer": "2"})], engines)["m"]
    assert [s.sample_index for s in out] == [0, 1, 2, 3]
    assert [(s.model_id, s.role, s.group_index, int(s.versions[-1])) for s in out] == [
        ("solver", "s", 0, 1), ("solver", "s", 1, 1),
        ("verifier", "v", 0, 4), ("verifier", "v", 1, 4)]
    assert all(s.reward == 1.0 for s in out)
