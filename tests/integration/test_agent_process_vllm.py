"""An agent out of process (ProcessAgentWorkflow) trained through the RaaS's OpenAI-compatible
endpoint on a real vLLM engine (CPU) with a warm-started tiny chat model: the calculator agent of
examples/openai_agent/agent.py runs in an agent worker (another interpreter, driven over the
JSON-lines pipe of astralight/workflows/agent_runner.py) and makes its tool calls through the
endpoint over HTTP.

Checked, as for the in-process agent (tests/integration/test_openai_agent_vllm.py): its tool calls
reached it in the OpenAI schema and the tool results came back as masked tokens; the trained
tokens of every sample are exactly what the engine generated for the prompts it was sent, with
its log-probs and versions; the reward is computed here on the answer the child returned.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from astralight.rewards.toy import ExactMatchReward
from astralight.workflows.agent_process import ProcessAgentWorkflow
from tests.integration.calculator_agent import (  # noqa: F401  (fixtures)
    EXAMPLE_PATH, Recording, check_exact, endpoint, engine, model_dir, tasks)
from tests.unit.engine_fakes import run_tasks

pytestmark = pytest.mark.vllm

AGENT = f"{EXAMPLE_PATH}:calculator_agent"


def test_an_agent_in_a_worker_process_trains_through_the_endpoint(engine, endpoint):
    tok = engine.tokenizer
    rec = Recording(engine)
    wf = ProcessAgentWorkflow(AGENT, ExactMatchReward(), python=sys.executable, timeout_s=120,
                              endpoint=endpoint)
    try:
        out = run_tasks(wf, tasks("a"), {"policy": rec})
        worker = wf._worker
        assert worker is not None and worker.proc.pid != 0 and worker.alive
    finally:
        wf.close()
    samples = [s for ss in out.values() for s in ss]
    print(f"\nstats {wf.stats}; rewards {[s.reward for s in samples]}")
    assert wf.stats["agent_errors"] == 0 and wf.stats["agent_timeouts"] == 0
    assert samples and len(rec.calls) == wf.stats["calls"]
    check_exact(samples, rec)  # trained tokens: exactly the engine's completions
    assert sum(int(s.loss_mask.sum()) for s in samples) == sum(len(c.token_ids)
                                                               for _, c in rec.calls)
    # the tool results came back from the child as masked <tool_response> tokens between the
    # completions of an episode merged into one sample
    with_tools = [s for s in samples if s.metadata["tool_calls"] > 0]
    assert with_tools, "the warm-started model made no tool call"
    merged = [s for s in with_tools if s.metadata["segments"] == 1 and s.metadata["turns"] >= 2]
    assert merged
    for s in merged:
        after_prompt = s.token_ids[(s.loss_mask == 0) & (np.arange(s.num_tokens) >= s.prompt_len)]
        assert "<tool_response>" in tok.decode(after_prompt.tolist())
    assert any(s.reward == 1.0 for s in samples), "no episode answered right"
