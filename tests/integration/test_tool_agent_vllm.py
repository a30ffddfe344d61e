"""The tool-agent workflow through real vLLM on CPU: chat episodes rendered by the template,
tool calls run, their results masked, rewards, and versions that advance with a weight update."""

from __future__ import annotations

import pytest

from astralight.engine import SamplingSpec
from astralight.protocol import Task
from astralight.rewards.toy import ExactMatchReward
from astralight.tasks.arithmetic import ArithmeticSource
from astralight.tasks.tool_warmstart import TOOL_SOURCE_KWARGS, TOOL_SYSTEM_PROMPT
from astralight.workflows.tool_agent import ToolAgentWorkflow
from tests.unit.engine_fakes import run_tasks

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tool_policy_dir):
    from astralight.raas.vllm_engine import VLLMEngine

    eng = VLLMEngine(str(tool_policy_dir), dtype="bfloat16", max_model_len=256, seed=0,
                     kv_cache_memory_bytes=64 << 20, enforce_eager=True, warmup=True)
    yield eng
    eng.close()


def _tasks(prefix: str, count: int = 16, n: int = 4) -> list[Task]:
    """The prompts the fixture's policy was warm-started on (train split, seed 0)."""
    src = ArithmeticSource(split="train", seed=0, **TOOL_SOURCE_KWARGS)
    return [Task(task_id=f"{prefix}{i}", prompt=src.get(i).prompt, metadata=src.get(i).metadata,
                 model_ids=["policy"], n=n, workflow="tool_agent") for i in range(count)]


def _workflow() -> ToolAgentWorkflow:
    return ToolAgentWorkflow(tools=["astralight.agents.toy_tools.add"], reward=ExactMatchReward(),
                             sampling=SamplingSpec(temperature=1.0, max_tokens=64), max_turns=3,
                             max_total_tokens=256, system_prompt=TOOL_SYSTEM_PROMPT)


def test_tools_are_called_masked_and_rewarded_and_versions_advance(engine, tool_policy_dir):
    import torch
    from safetensors.torch import load_file

    tok = engine.tokenizer
    samples = [s for ss in run_tasks(_workflow(), _tasks("a"), {"policy": engine}).values() for s in ss]
    assert len(samples) == 64
    called = [s for s in samples if s.metadata["tool_calls"] > 0]
    assert called, "the warm-started policy called no tool in 64 episodes"
    for s in called:
        text = tok.decode(s.token_ids.tolist())
        assert "<tool_response>" in text
        # the tool's result tokens are context: mask 0, no version, no log-prob
        start = text.index("<tool_response>")
        prefix_len = len(tok(text[:start], add_special_tokens=False)["input_ids"])
        assert s.loss_mask[prefix_len] == 0 and s.versions[prefix_len] == -1
        assert s.logprobs[prefix_len] == 0.0
        trained = s.loss_mask.astype(bool)
        assert (s.versions[trained] == 0).all() and (s.logprobs[trained] < 0).any()
    assert any(s.reward > 0 for s in samples), "no episode was rewarded"
    # the stream is what the engine generated plus the template's masked pieces: re-decoding the
    # trained tokens gives back the assistant turns
    s = called[0]
    trained_text = tok.decode(s.token_ids[s.loss_mask.astype(bool)].tolist())
    assert trained_text.startswith("<tool_call>") and trained_text.count("<|im_end|>") >= 1

    weights = load_file(str(tool_policy_dir / "model.safetensors"))
    engine.update_weights({k: v.to(torch.float32) for k, v in weights.items()}, version=1)
    later = [s for ss in run_tasks(_workflow(), _tasks("b", count=4), {"policy": engine}).values()
             for s in ss]
    assert later and all((s.versions[s.loss_mask.astype(bool)] == 1).all() for s in later)
