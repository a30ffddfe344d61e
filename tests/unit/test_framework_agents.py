"""The framework agents of examples/agents/ trained unchanged: each example's agent against the
real endpoint and a scripted engine (tests/unit/engine_fakes.py), several episodes at once.

- ``openai_agents_sdk``: the OpenAI Agents SDK on its default provider (``OpenAIProvider``: the
  Responses API, the SDK's per-process HTTP client), async, on the RaaS's one agent loop;
- ``mcp_tools``: the same SDK with its tool behind a real MCP server (stdio), one server process
  shared by every episode; the SDK sends the tool's result as ``input_text`` parts;
- ``anthropic_client``: the ``anthropic`` client on the Messages API.

Checked for each: no agent error and no refused call; every episode's two calls (the ``add``
call, then the answer after the tool result) merge into one sample whose trained tokens are the
model's and whose tool result (the plain number) is masked; no call reached another episode.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from astralight.protocol import Task
from astralight.raas.openai_endpoint import OpenAIEndpoint
from astralight.rewards.toy import ExactMatchReward
from astralight.trainer.tinymodel import build_chat_tokenizer
from astralight.workflows.openai_agent import OpenAIAgentWorkflow, describe_error, is_async_agent
from tests.unit.engine_fakes import PromptScriptEngine, calculator, run_tasks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {  # example folder -> (its agent function, runs on the agent loop)
    "openai_agents_sdk": ("sdk_agent", True),
    "mcp_tools": ("mcp_agent", True),
    "anthropic_client": ("claude_style_agent", False),
}


def _agent(example: str, name: str):
    path = ROOT / "examples" / "agents" / example / "agent.py"
    spec = importlib.util.spec_from_file_location(f"{example}_example_agent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_each_framework_agent_trains_unchanged(example):
    name, is_async = EXAMPLES[example]
    tok = build_chat_tokenizer()
    engine = PromptScriptEngine(calculator, tok, version=3, max_model_len=512)
    endpoint = OpenAIEndpoint().start()
    try:
        agent = _agent(example, name)
        assert is_async_agent(agent) == is_async
        wf = OpenAIAgentWorkflow(agent, ExactMatchReward(), endpoint=endpoint, timeout_s=60)
        tasks = [Task(task_id=f"t{i}", prompt="123+456=", n=3, model_ids=["policy"],
                      metadata={"answer": "579"}) for i in range(4)]
        out = run_tasks(wf, tasks, {"policy": engine})
    finally:
        endpoint.close()
        engine.close()
    assert wf.stats["agent_errors"] == 0 and wf.stats["agent_timeouts"] == 0, wf.stats
    assert endpoint.counters["wrong_episode"] == 0 and endpoint.counters["refused"] == 0
    samples = [s for ss in out.values() for s in ss]
    assert len(samples) == 12 and wf.stats["calls"] == 24
    for s in samples:
        assert s.reward == 1.0
        assert (s.metadata["turns"], s.metadata["segments"], s.metadata["tool_calls"]) == (2, 1, 1)
        trained = tok.decode(s.token_ids[s.loss_mask == 1].tolist())
        masked = tok.decode(s.token_ids[(s.loss_mask == 0)
                                        & (np.arange(s.num_tokens) >= s.prompt_len)].tolist())
        assert "<tool_call>" in trained and trained.rstrip().endswith("579<|im_end|>")
        assert "<tool_response>\n579\n</tool_response>" in masked  # the number, not a JSON dump
        assert "<tool_response>" not in trained


def test_an_exception_group_is_described_by_its_first_leaf():
    """An agent whose TaskGroup failed (an MCP client whose server died) says what failed."""
    try:
        raise ExceptionGroup("unhandled errors in a TaskGroup", [ConnectionError("closed")])
    except ExceptionGroup as exc:
        text = describe_error(exc)
    assert text == ("ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception) "
                    "(first: ConnectionError: closed)")
    assert describe_error(ValueError("x")) == "ValueError: x"
