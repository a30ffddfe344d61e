"""Shared parts of the calculator-agent tests on real vLLM (the in-process agent,
test_openai_agent_vllm.py, and the agent in a worker process, test_agent_process_vllm.py): the
example agent, the tiny chat model warm-started on its two sums, the engine, the endpoint, the
tasks, a recording engine, and the check that trained tokens are exactly the engine's.

Import the fixtures into a test module by name (``from tests.integration.calculator_agent
import endpoint, engine, model_dir``); each module gets its own module-scoped instances.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from astralight.protocol import Task
from astralight.raas.openai_endpoint import OpenAIEndpoint

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_PATH = ROOT / "examples" / "openai_agent" / "agent.py"
SUMS = [(123, 456), (200, 317)]


def _example():
    spec = importlib.util.spec_from_file_location("openai_agent_example", EXAMPLE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: examples/openai_agent/agent.py, loaded as a module
EXAMPLE = _example()


def conversations() -> list[list[dict]]:
    """The warm start's scripted episodes: each sum asked, the add tool called, its result
    copied (four times over)."""
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
    """The tiny chat model warm-started on :func:`conversations` (60 steps of one thread: with
    two threads on a busy two-core machine each step took 20x longer)."""
    from astralight.agents.tools import Tool
    from astralight.agents.toy_tools import add
    from astralight.tasks.chat_warmstart import build_chat_policy

    return build_chat_policy(tmp_path_factory.mktemp("calculator_agent") / "model", conversations,
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


def tasks(prefix: str) -> list[Task]:
    """One task per sum, two episodes each, the answer in the metadata the reward reads."""
    return [Task(task_id=f"{prefix}{i}", prompt=f"{a}+{b}=", n=2, model_ids=["policy"],
                 metadata={"answer": str(a + b)}) for i, (a, b) in enumerate(SUMS)]


def check_exact(samples, rec: Recording) -> None:
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
