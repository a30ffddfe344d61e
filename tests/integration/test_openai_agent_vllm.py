"""The example ``openai``-client agent (examples/openai_agent/agent.py) trained through the RaaS's
OpenAI-compatible endpoint on a real vLLM engine (CPU) with a warm-started tiny chat model.

The model is warm-started on the calculator conversations of two fixed sums (it memorises the
tool call and the copied result in a few dozen steps of one thread: with two threads on a busy
two-core machine each step took 20x longer);
everything after that is real: vLLM generates, the endpoint renders with the model's chat
template and records, the workflow merges the calls into samples.

Checked: the agent's tool calls reached it through the OpenAI schema and the tool results came
back as masked tokens; the trained tokens of every sample are exactly what the engine generated
for the prompts it was sent, with its log-probs; rewards arrive; after an in-place weight update
new samples carry the new version.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from astralight.protocol import Task
from astralight.raas.openai_endpoint import OpenAIEndpoint
from astralight.rewards.toy import ExactMatchReward
from astralight.workflows.openai_agent import OpenAIAgentWorkflow
from tests.unit.engine_fakes import run_tasks

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
SUMS = [(123, 456), (200, 317)]


def _example():
    spec = importlib.util.spec_from_file_location("openai_agent_example",
                                                  ROOT / "examples/openai_agent/agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()


def _conversations():
    from astralight.tasks.tool_warmstart import tool_call_text

    out = []
    for a, b in SUMS:
        out.append([{"role": "system", "content": EXAMPLE.SYSTEM_PROMPT},
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

    return build_chat_policy(tmp_path_factory.mktemp("openai_agent") / "model", _conversations,
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


def _tasks(prefix: str):
    return [Task(task_id=f"{prefix}{i}", prompt=f"{a}+{b}=", n=2, model_ids=["policy"],
                 metadata={"answer": str(a + b)}) for i, (a, b) in enumerate(SUMS)]


def _check_exact(samples, rec: Recording):
    """Every sample's trained tokens are the engine's completions, in order, for prompts that
    are prefixes of the sample; masked tokens carry version -1 and log-prob 0."""
    by_prompt: dict[tuple, list] = {}
    for p, c in rec.calls:  # episodes of one task share their first prompt
        by_prompt.setdefault(tuple(p), []).append(c)
    for s in samples:
        ids, mask = s.token_ids.tolist(), s.loss_mask.tolist()
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        assert starts and starts[0] == s.prompt_len
        for start in starts:
            # the engine saw exactly this prompt and generated exactly these tokens
            [comp] = [c for c in by_prompt[tuple(ids[:start])]
                      if ids[start:start + len(c.token_ids)] == list(c.token_ids)][:1]
            end = start + len(comp.token_ids)
            assert all(mask[start:end]) and (end == len(mask) or not mask[end])
            assert np.allclose(s.logprobs[start:end], comp.logprobs)
            assert s.versions[start:end].tolist() == list(comp.versions)
        assert np.all(s.versions[s.loss_mask == 0] == -1)
        assert np.all(s.logprobs[s.loss_mask == 0] == 0.0)


def test_example_agent_trains_through_the_endpoint(engine, endpoint, model_dir):
    from safetensors.torch import load_file

    tok = engine.tokenizer
    rec = Recording(engine)
    wf = OpenAIAgentWorkflow(EXAMPLE.calculator_agent, ExactMatchReward(), timeout_s=120,
                             endpoint=endpoint)
    out = run_tasks(wf, _tasks("a"), {"policy": rec})
    samples = [s for ss in out.values() for s in ss]
    print(f"\nstats {wf.stats}; rewards {[s.reward for s in samples]}")
    assert wf.stats["agent_errors"] == 0 and wf.stats["agent_timeouts"] == 0
    assert samples and len(rec.calls) == wf.stats["calls"]
    _check_exact(samples, rec)
    # every generated token is in exactly one sample (merged or split, nothing dropped)
    assert sum(int(s.loss_mask.sum()) for s in samples) == sum(len(c.token_ids)
                                                               for _, c in rec.calls)
    # the agent's tool calls came back as tool messages: masked <tool_response> tokens after the
    # episode's first prompt -- between two completions of a merged sample, or in the prompt of a
    # later segment when the episode was split (a sampled tool call the template re-renders
    # differently, or one cut off at max_tokens, does not extend the earlier tokens)
    episodes: dict[tuple, list] = {}
    for s in samples:
        episodes.setdefault((s.task_id, s.metadata["episode"]), []).append(s)
    with_tools = {k: ss for k, ss in episodes.items() if ss[0].metadata["tool_calls"] > 0}
    assert with_tools, "the warm-started model made no tool call"
    for ss in with_tools.values():
        ss.sort(key=lambda s: s.metadata["segment"])
        assert [s.metadata["segment"] for s in ss] == list(range(ss[0].metadata["segments"]))
        assert ss[0].metadata["turns"] >= 2
        after_first_prompt = [s.token_ids[(s.loss_mask == 0) & (
            np.arange(s.num_tokens) >= (s.prompt_len if j == 0 else 0))] for j, s in enumerate(ss)]
        assert "<tool_response>" in tok.decode(np.concatenate(after_first_prompt).tolist())
    # the usual case, an agent appending to its conversation, merges its calls into one sample
    assert any(len(ss) == 1 for ss in with_tools.values()), [
        [tok.decode(s.token_ids.tolist()) for s in ss] for ss in with_tools.values()]
    assert all(np.all(s.versions[s.loss_mask == 1] == 0) for s in samples)
    assert any(s.reward == 1.0 for s in samples), "no episode answered right"
    # an in-place weight update (same weights, a new version): new samples carry it
    engine.update_weights(load_file(str(Path(model_dir) / "model.safetensors")), version=1)
    rec.calls.clear()
    after = [s for ss in run_tasks(wf, _tasks("b")[:1], {"policy": rec}).values() for s in ss]
    assert after
    _check_exact(after, rec)
    assert all(np.all(s.versions[s.loss_mask == 1] == 1) for s in after)
