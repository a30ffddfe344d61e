"""ChatEnvWorkflow on a scripted engine and a tiny scripted environment: the token layout (actions
trained, observations masked, token-exact against the template), rewards summed over steps,
max_turns and the token budget, tool turns that do not act on the environment, and close()."""

from __future__ import annotations

import json

import numpy as np
import pytest

from astralight.agents.chat import encode, render
from astralight.engine import SamplingSpec
from astralight.protocol import Task
from astralight.trainer.tinymodel import build_chat_tokenizer
from astralight.workflows.chat_env import ChatEnvWorkflow, action_text
from astralight.workflows.multi_turn import Environment
from tests.unit.engine_fakes import ScriptedEngine, run_tasks

SYSTEM = "Play. One command per turn."


class DoorEnv(Environment):
    """Say ``look`` (0.5 the first time), then the secret word (1.0, done); anything else gets
    ``no <action>``. Every instance is recorded, with its actions and whether it was closed."""

    made: list["DoorEnv"] = []

    def __init__(self, bonus: float = 0.5):
        self.bonus, self.actions, self.closed, self.looked = bonus, [], False, False
        DoorEnv.made.append(self)

    def reset(self, task: Task) -> str:
        self.secret = task.metadata["secret"]
        return f"a door. say {self.secret}"

    def step(self, action: str):
        self.actions.append(action)
        if action == self.secret:
            return "", 1.0, True
        if action == "look" and not self.looked:
            self.looked = True
            return "a key", self.bonus, False
        return f"no {action}", 0.0, False

    def metrics(self) -> dict:
        return {"steps": len(self.actions)}

    def close(self) -> None:
        self.closed = True


@pytest.fixture()
def tok():
    DoorEnv.made.clear()
    return build_chat_tokenizer()


def _task(n: int = 1, secret: str = "open", kind: str = "train") -> Task:
    return Task(task_id="t0", prompt="door", n=n, model_ids=["p"], workflow="chat_env",
                kind=kind, metadata={"secret": secret})


def _run(wf, tok, texts, task=None, **engine_kw):
    engine = ScriptedEngine(tok, texts, max_model_len=engine_kw.pop("max_model_len", 512),
                            **engine_kw)
    out = run_tasks(wf, [task or _task()], {"p": engine})
    return out["t0"], engine


def _wf(**kw) -> ChatEnvWorkflow:
    kw.setdefault("sampling", SamplingSpec(temperature=1.0, max_tokens=32))
    return ChatEnvWorkflow(DoorEnv, system_prompt=SYSTEM, **kw)


def test_actions_reach_the_environment_and_rewards_sum(tok):
    (s,), engine = _run(_wf(), tok, ["look", "open"])
    env, = DoorEnv.made
    assert env.actions == ["look", "open"] and env.closed
    assert s.reward == pytest.approx(1.5)
    assert s.metadata["step_rewards"] == [0.5, 1.0]
    assert s.metadata["actions"] == ["look", "open"]
    assert s.metadata["end"] == "done" and s.metadata["turns"] == 2
    assert s.metadata["env"] == {"steps": 2}
    assert s.metadata["tool_calls"] == 0


def test_observations_are_masked_and_the_stream_is_the_template_rendering(tok):
    (s,), engine = _run(_wf(), tok, ["look", "open"])
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "a door. say open"},
                {"role": "assistant", "content": "look"},
                {"role": "user", "content": "a key"},
                {"role": "assistant", "content": "open"}]
    whole = encode(tok, render(tok, messages))
    assert list(s.token_ids) == whole[:len(s.token_ids)]
    assert tok.decode(whole[len(s.token_ids):]) == "\n"  # the sample ends on the last <|im_end|>
    mask, versions = np.asarray(s.loss_mask), np.asarray(s.versions)
    trained = tok.decode([t for t, m in zip(s.token_ids, mask) if m])
    assert trained == "look<|im_end|>open<|im_end|>"
    assert (versions[mask == 1] == engine.version).all()
    assert (versions[mask == 0] == -1).all() and (np.asarray(s.logprobs)[mask == 0] == 0).all()
    masked = tok.decode([t for t, m in zip(s.token_ids, mask) if not m])
    assert "a key" in masked and "a door. say open" in masked
    assert not mask[: s.prompt_len].any()


def test_max_turns_ends_without_the_last_observation(tok):
    (s,), _ = _run(_wf(max_turns=3), tok, ["wait"])
    env, = DoorEnv.made
    assert env.actions == ["wait"] * 3 and env.closed
    assert s.metadata["end"] == "max_turns" and s.metadata["turns"] == 3
    assert s.reward == 0.0
    text = tok.decode(list(s.token_ids))
    assert text.count("no wait") == 2  # observations 1 and 2 are in the context, 3 is not
    assert text.endswith("wait<|im_end|>")


def test_token_budget_ends_the_episode(tok):
    wf = _wf(max_total_tokens=75)
    (s,), engine = _run(wf, tok, ["wait"])
    assert s.metadata["end"] == "token_budget"
    assert 1 <= s.metadata["turns"] < 8
    # every turn may only fill what the budget leaves (the scripted engine ignores the cap)
    assert engine.calls[0][1].max_tokens == 75 - s.prompt_len


def test_a_tool_turn_runs_tools_and_does_not_act(tok):
    args = {"name": "add", "arguments": {"a": 2, "b": 3}}
    call = "<tool_call>" + json.dumps(args) + "</tool_call>"
    wf = _wf(tools=["astralight.agents.toy_tools.add"])
    (s,), _ = _run(wf, tok, [call, "5"], task=_task(secret="5"))
    env, = DoorEnv.made
    assert env.actions == ["5"]  # the tool turn never reached the environment
    assert s.metadata["turns"] == 2 and s.metadata["actions"] == ["5"]
    assert s.metadata["tool_calls"] == 1 and sum(s.metadata["tool_errors"].values()) == 0
    assert s.reward == 1.0 and s.metadata["end"] == "done"
    masked = tok.decode([t for t, m in zip(s.token_ids, s.loss_mask) if not m])
    assert "<tool_response>\n5\n</tool_response>" in masked
    assert "tools: add" in masked  # the template announced the tool


def test_a_failed_tool_call_is_counted_and_the_episode_goes_on(tok):
    wf = _wf(tools=["astralight.agents.toy_tools.add"])
    (s,), _ = _run(wf, tok, ["<tool_call>{oops</tool_call>", "open"])
    assert s.metadata["tool_errors"]["malformed"] == 1
    assert s.metadata["actions"] == ["open"] and s.reward == 1.0


def test_without_tools_a_tool_call_is_an_action(tok):
    call = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    (s,), _ = _run(_wf(max_turns=1), tok, [call])
    env, = DoorEnv.made
    assert env.actions == [call] and s.metadata["tool_calls"] == 0


def test_one_environment_per_episode(tok):
    (a, b, c), _ = _run(_wf(), tok, ["open"], task=_task(n=3))
    assert len(DoorEnv.made) == 3 and all(e.closed and e.actions == ["open"] for e in DoorEnv.made)
    assert [x.group_index for x in (a, b, c)] == [0, 1, 2]


def test_environment_kwargs_and_import_path(tok):
    wf = ChatEnvWorkflow(f"{__name__}.DoorEnv", environment_kwargs={"bonus": 0.25},
                         sampling=SamplingSpec(max_tokens=8))
    (s,), _ = _run(wf, tok, ["look", "open"])
    assert s.reward == pytest.approx(1.25)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="environment"):
        ChatEnvWorkflow("no_such_module.Env")
    with pytest.raises(ValueError, match="max_turns"):
        ChatEnvWorkflow(DoorEnv, max_turns=0)


def test_think_is_not_part_of_the_action():
    assert action_text("<think>the door?</think>\nopen") == "open"
    assert action_text("  go north ") == "go north"
