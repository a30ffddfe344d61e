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

from pathlib import Path

import numpy as np
import pytest

from astralight.rewards.toy import ExactMatchReward
from astralight.workflows.openai_agent import OpenAIAgentWorkflow
from tests.unit.engine_fakes import run_tasks

pytestmark = pytest.mark.vllm

from tests.integration.calculator_agent import (  # noqa: F401  (fixtures)
    EXAMPLE, Recording, check_exact, endpoint, engine, model_dir, tasks)


def test_example_agent_trains_through_the_endpoint(engine, endpoint, model_dir):
    from safetensors.torch import load_file

    tok = engine.tokenizer
    rec = Recording(engine)
    wf = OpenAIAgentWorkflow(EXAMPLE.calculator_agent, ExactMatchReward(), timeout_s=120,
                             endpoint=endpoint)
    out = run_tasks(wf, tasks("a"), {"policy": rec})
    samples = [s for ss in out.values() for s in ss]
    print(f"\nstats {wf.stats}; rewards {[s.reward for s in samples]}")
    assert wf.stats["agent_errors"] == 0 and wf.stats["agent_timeouts"] == 0
    assert samples and len(rec.calls) == wf.stats["calls"]
    check_exact(samples, rec)
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
    after = [s for ss in run_tasks(wf, tasks("b")[:1], {"policy": rec}).values() for s in ss]
    assert after
    check_exact(after, rec)
    assert all(np.all(s.versions[s.loss_mask == 1] == 1) for s in after)
