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
from pathlib import Path

import numpy as np
import pytest

from astralight.protocol import Task
from astralight.raas.openai_endpoint import OpenAIEndpoint
from astralight.rewards.toy import ExactMatchReward
from astralight.workflows.agent_process import ProcessAgentWorkflow
from tests.unit.engine_fakes import run_tasks

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
AGENT = f"{ROOT / 'examples/openai_agent/agent.py'}:calculator_agent"
SUMS = [(123, 456), (200, 317)]
SYSTEM_PROMPT = "Answer with the number."  # the example agent's


def _conversations():
    from astralight.tasks.tool_warmstart import tool_call_text

    out = []
    for a, b in SUMS:
        out.append([{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"{a}+{b}="},
                    {"role": "assistant", "content": tool_call_text("add", {"a": a, "b": b})},
                    {"role": "tool", "name": "add", "content": str(a + b)},
                    {"role": "assistant", "content": str(a + b)}])
    return out * 4


class Recording:
    """The real engine, with every ``generate`` call's prompt and completion kept."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[list[int], object]] = []

    async def generate(self, prompt_token_ids, params):
        completion = await self.inner.generate(prompt_token_ids, params)
        self.calls.append((list(prompt_token_ids), completion))
        return completion

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from astralight.agents.tools import Tool
    from astralight.agents.toy_tools import add
    from astralight.tasks.chat_warmstart import build_chat_policy

    return build_chat_policy(tmp_path_factory.mktemp("agent_process") / "model", _conversations,
                             [Tool(add).schema], sft_steps=60, lr=5e-3, batch_size=4,
                             progress=False, num_threads=1)


@pytest.fixture(scope="module")
def engine(model_dir):
    from astralight.raas.vllm_engine import VLLMEngine

    eng = VLLMEngine(str(model_dir), dtype="bfloat16", max_model_len=256, seed=0,
                     kv_cache_memory_bytes=64 << 20, enforce_eager=True, warmup=True)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def endpoint():
    ep = OpenAIEndpoint().start()
    yield ep
    ep.close()


def test_an_agent_in_a_worker_process_trains_through_the_endpoint(engine, endpoint):
    tok = engine.tokenizer
    rec = Recording(engine)
    wf = ProcessAgentWorkflow(AGENT, ExactMatchReward(), python=sys.executable, timeout_s=120,
                              endpoint=endpoint)
    tasks = [Task(task_id=f"a{i}", prompt=f"{a}+{b}=", n=2, model_ids=["policy"],
                  metadata={"answer": str(a + b)}) for i, (a, b) in enumerate(SUMS)]
    try:
        out = run_tasks(wf, tasks, {"policy": rec})
        worker = wf._worker
        assert worker is not None and worker.proc.pid != 0 and worker.alive
    finally:
        wf.close()
    samples = [s for ss in out.values() for s in ss]
    print(f"\nstats {wf.stats}; rewards {[s.reward for s in samples]}")
    assert wf.stats["agent_errors"] == 0 and wf.stats["agent_timeouts"] == 0
    assert samples and len(rec.calls) == wf.stats["calls"]
    by_prompt: dict[tuple, list] = {}
    for p, c in rec.calls:
        by_prompt.setdefault(tuple(p), []).append(c)
    for s in samples:  # trained tokens: exactly the engine's completions for those prompts
        ids, mask = s.token_ids.tolist(), s.loss_mask.tolist()
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        assert starts and starts[0] == s.prompt_len
        for start in starts:
            [comp] = [c for c in by_prompt[tuple(ids[:start])]
                      if ids[start:start + len(c.token_ids)] == list(c.token_ids)][:1]
            end = start + len(comp.token_ids)
            assert all(mask[start:end]) and (end == len(mask) or not mask[end])
            assert np.allclose(s.logprobs[start:end], comp.logprobs)
            assert s.versions[start:end].tolist() == list(comp.versions)
        assert np.all(s.versions[s.loss_mask == 0] == -1)
        assert np.all(s.logprobs[s.loss_mask == 0] == 0.0)
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
