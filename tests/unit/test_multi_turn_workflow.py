"""MultiTurnWorkflow: loss masks cover exactly the action tokens; episodes end at done or
max_turns; rewards recorded; versions per token; episodes advance independently (a slow
environment step never holds another episode).

A scripted engine (char tokenizer, actions served in order per episode) forces each branch; one
test runs the real tiny model through HFEngine.
"""

from __future__ import annotations

import numpy as np
import pytest

from astralight.engine import SamplingSpec
from astralight.protocol import Sample, Task, decode, encode
from astralight.trainer.tinymodel import build_tokenizer
from astralight.workflows.multi_turn import ArithmeticHintEnv, Environment, MultiTurnWorkflow
from tests.unit.engine_fakes import TurnScriptEngine, run_tasks

TOK = build_tokenizer()
EOS = TOK.eos_token_id
ENV = "astralight.workflows.multi_turn.ArithmeticHintEnv"


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def ScriptedEngine(script, version=3, max_model_len=64):
    return TurnScriptEngine(TOK, script, version=version, max_model_len=max_model_len)


def _task(task_id, prompt, answer, n=1, kind="train"):
    return Task(task_id=task_id, prompt=prompt, n=n, model_ids=["policy"], kind=kind,
                workflow="multi_turn", metadata={"answer": answer})


def test_masks_cover_exactly_the_actions_and_episodes_end_right():
    engine = ScriptedEngine({"1+2=": ["5", "4", "3"],          # solved on turn 3
                             "9+9=": ["18"],                   # solved on turn 1
                             "4+4=": ["1", "2", "3", "4"]})    # never solved: max_turns
    wf = MultiTurnWorkflow(ENV, max_turns=3, sampling=SamplingSpec(temperature=1.0, max_tokens=4))
    out = run_tasks(wf, [_task("a", "1+2=", "3"), _task("b", "9+9=", "18"),
                         _task("c", "4+4=", "8")], {"policy": engine})
    # one request per turn of every episode: a 3, b 1, c 3
    assert sum(engine.calls) == 7
    a, b, c = out["a"][0], out["b"][0], out["c"][0]
    # a: "1+2=" 5<eos> "?down;1+2=" 4<eos> "?down;1+2=" 3<eos> (5 and 4 are too large)
    expected = (ids("1+2=") + ids("5") + [EOS] + ids("?down;1+2=") + ids("4") + [EOS]
                + ids("?down;1+2=") + ids("3") + [EOS])
    assert a.token_ids.tolist() == expected
    p, obs = len(ids("1+2=")), len(ids("?down;1+2="))
    mask = [0] * p + [1, 1] + [0] * obs + [1, 1] + [0] * obs + [1, 1]
    assert a.loss_mask.tolist() == mask
    assert a.prompt_len == p
    m = np.asarray(mask, bool)
    assert np.all(a.logprobs[m] == -0.25) and np.all(a.logprobs[~m] == 0)
    # versions per token: each action carries the version that sampled it
    assert a.versions.tolist() == ([-1] * p + [3, 3] + [-1] * obs + [4, 4] + [-1] * obs + [5, 5])
    assert a.reward == 1.0 and a.metadata["end"] == "done" and a.metadata["turns"] == 3
    assert a.metadata["step_rewards"] == [0.0, 0.0, 1.0] and a.metadata["actions"] == ["5", "4", "3"]
    assert b.reward == 1.0 and b.metadata["turns"] == 1 and b.metadata["end"] == "done"
    assert b.loss_mask.tolist() == [0] * 4 + [1, 1, 1]
    assert c.reward == 0.0 and c.metadata["end"] == "max_turns" and c.metadata["turns"] == 3
    # the episode ends on the policy's own last token: no dangling observation
    assert c.loss_mask[-1] == 1 and c.token_ids[-1] == EOS
    assert int(c.loss_mask.sum()) == 6
    for s in (a, b, c):
        back = decode(encode(s))
        assert isinstance(back, Sample) and back.loss_mask.tolist() == s.loss_mask.tolist()


def test_context_full_ends_the_episode_and_n_episodes_per_task():
    engine = ScriptedEngine({"1+2=": ["5", "5", "5", "5"]}, max_model_len=20)
    wf = MultiTurnWorkflow(ENV, max_turns=4)
    out = run_tasks(wf, [_task("a", "1+2=", "3", n=2)], {"policy": engine})
    assert [s.sample_index for s in out["a"]] == [0, 1]
    assert [s.group_index for s in out["a"]] == [0, 1]
    for s in out["a"]:
        # 4 + 2 + 10 = 16 tokens, then 2 + 10 -> 28 >= 20: no room for a third action
        assert s.metadata["end"] == "context_full" and s.metadata["turns"] == 2
        assert s.loss_mask[-1] == 1


def test_eval_sampling_and_custom_environment():
    class CountDown(Environment):
        """Done after three actions whatever they are; reward 0.5 per step."""

        def reset(self, task):
            self.k = 0
            return task.prompt

        def step(self, action):
            self.k += 1
            return "?x", 0.5, self.k == 3

    engine = ScriptedEngine({"1+2=": ["1", "2", "3", "4"]})
    wf = MultiTurnWorkflow(CountDown, max_turns=5, sampling=SamplingSpec(temperature=0.9),
                           eval_sampling=SamplingSpec(temperature=0.3), role="actor")
    out = run_tasks(wf, [_task("e", "1+2=", "3", kind="eval")], {"policy": engine})
    s = out["e"][0]
    assert s.reward == pytest.approx(1.5) and s.metadata["end"] == "done" and s.role == "actor"
    assert engine.temperatures == [0.3, 0.3, 0.3] and s.metadata["temperature"] == 0.3


def test_bad_configuration_errors():
    with pytest.raises(ValueError, match="environment"):
        MultiTurnWorkflow("no_such_module.Env")
    with pytest.raises(ValueError, match="max_turns"):
        MultiTurnWorkflow(ENV, max_turns=0)
    wf = MultiTurnWorkflow(ENV)
    with pytest.raises(KeyError, match="policy"):
        run_tasks(wf, [_task("a", "1+2=", "3")], {})
    with pytest.raises(KeyError, match="answer"):
        ArithmeticHintEnv().reset(Task(task_id="x", prompt="1+1=", n=1, model_ids=["p"]))


def test_real_tiny_model(tiny_model_dir):
    from astralight.raas.hf_engine import HFEngine

    engine = HFEngine(str(tiny_model_dir), seed=0, version=6)
    wf = MultiTurnWorkflow(ENV, max_turns=3, sampling=SamplingSpec(temperature=1.0, max_tokens=3))
    out = run_tasks(wf, [_task("a", "37+45=", "82", n=2)], {"policy": engine})
    for s in out["a"]:
        m = s.loss_mask.astype(bool)
        assert s.token_ids[:s.prompt_len].tolist() == ids("37+45=")
        assert 1 <= s.metadata["turns"] <= 3
        assert np.all(s.logprobs[m] < 0) and np.all(s.logprobs[~m] == 0)
        assert set(s.versions[m].tolist()) == {6} and set(s.versions[~m].tolist()) == {-1}
        # one run of masked-in tokens per action, separated by (masked-out) observations
        runs = np.flatnonzero(np.diff(np.concatenate([[0], m.astype(int)])) == 1)
        assert len(runs) == s.metadata["turns"]
        assert s.loss_mask[-1] == 1


def test_episodes_advance_independently_of_a_blocked_environment_step():
    """A fast episode plays all its turns while another episode's environment step is blocked
    (on an executor thread): nothing advances in lock step, and the loop is never blocked."""
    import asyncio
    import threading

    gate = threading.Event()

    class Gated(ArithmeticHintEnv):
        def step(self, action):
            if self.problem == "9+9=":  # the slow episode: its first step waits for the gate
                assert gate.wait(30), "the gate was never opened"
            return super().step(action)

    engine = ScriptedEngine({"1+2=": ["5", "4", "3"], "9+9=": ["18"]})
    wf = MultiTurnWorkflow(Gated, max_turns=3)

    async def main():
        slow = asyncio.create_task(wf.run(_task("slow", "9+9=", "18"), {"policy": engine}))
        fast = await wf.run(_task("fast", "1+2=", "3"), {"policy": engine})
        slow_was_done = slow.done()
        gate.set()
        return fast, slow_was_done, await slow

    fast, slow_was_done, slow = asyncio.run(main())
    assert fast[0].metadata["turns"] == 3 and fast[0].metadata["end"] == "done"
    assert not slow_was_done  # the fast episode finished while the slow step was blocked
    assert slow[0].metadata["turns"] == 1 and slow[0].reward == 1.0
