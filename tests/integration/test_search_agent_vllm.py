"""The search agent on a real vLLM engine (CPU): a tiny chat model warm-started (in a module
fixture, a few steps) to search and copy, ToolAgentWorkflow episodes with the BM25 tool, and an
in-place weight update between two rounds of episodes.

What is checked: the model calls the tool and the tool really runs (its result is in the
transcript), tool-result tokens are masked (loss mask 0, version -1) while generated tokens are
trained and stamped, rewards arrive (some episode answers right), and after
``engine.update_weights(..., version=1)`` new episodes carry version 1 on every generated token.

The world is small (8 people, one fact each) and the episodes ask about train people, so a short
warm start suffices: the point is the machinery, not generalisation (the recipe measures that).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from astralight.engine import SamplingSpec
from astralight.protocol import Task
from astralight.rewards.qa import QAExactMatchReward
from tests.unit.engine_fakes import run_tasks

pytestmark = pytest.mark.vllm

#: a narrower model than the recipe's: the warm start is the slow part of this module (trained
#: on one thread: on this 2-core machine shared with vLLM and other tests, two threads ran 7x
#: slower)
SPEC = {"hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from astralight.tasks.search_warmstart import build_search_policy

    root = tmp_path_factory.mktemp("search_agent")
    t0 = time.time()
    # the world's own 8 names (no fresh_names): 100 steps learn them, not copying, and the test
    # needs some episodes to score 1
    model = build_search_policy(root / "model", root / "data", seed=0, n_people=8,
                                eval_share=0.25, relations=["pet"], conversations=256,
                                fresh_names=False, spec=SPEC, sft_steps=100, lr=1e-2,
                                batch_size=16, progress=False, num_threads=1)
    print(f"\nwarm start {time.time() - t0:.1f}s")
    return model, root / "data"


@pytest.fixture(scope="module")
def engine(world):
    from astralight.raas.vllm_engine import VLLMEngine

    eng = VLLMEngine(str(world[0]), dtype="bfloat16", max_model_len=512, seed=0,
                     kv_cache_memory_bytes=64 << 20, enforce_eager=True, warmup=True)
    print(f"vLLM engine start {eng.start_s:.2f}s, warm-up {eng.warmup_s:.2f}s")
    yield eng
    eng.close()


def _workflow(data):
    from astralight.tasks.search_warmstart import SEARCH_SYSTEM_PROMPT, SEARCH_TOOL_ARGS
    from astralight.workflows.tool_agent import ToolAgentWorkflow

    return ToolAgentWorkflow(
        tools=[{"class_path": "astralight.agents.search.BM25Search",
                "init_args": {"corpus": str(data / "corpus.jsonl"), **SEARCH_TOOL_ARGS}}],
        reward=QAExactMatchReward(), sampling=SamplingSpec(temperature=1.0, max_tokens=120, seed=0),
        max_turns=3, max_total_tokens=512, system_prompt=SEARCH_SYSTEM_PROMPT)


def _tasks(data, tag: str) -> list[Task]:
    from astralight.tasks.qa import QASource

    source = QASource(str(data / "train.jsonl"))
    prompts = [source.get(j) for j in range(len(source))]
    return [Task(task_id=f"{tag}{i}", prompt=p.prompt, n=4, model_ids=["policy"],
                 metadata=p.metadata) for i, p in enumerate(prompts)]


def _check_episodes(samples, tokenizer, workflow, version: int) -> None:
    called = [s for s in samples if s.metadata["tool_calls"] > 0]
    assert len(called) >= len(samples) // 2, [s.metadata for s in samples]
    for s in samples:
        gen = s.loss_mask == 1
        assert gen[s.prompt_len:].any() and not gen[:s.prompt_len].any()
        assert (s.versions[gen] == version).all()  # every generated token: the engine's version
        masked = ~gen
        assert (s.versions[masked] == -1).all() and (s.logprobs[masked] == 0).all()
        assert np.isfinite(s.logprobs[gen]).all() and (s.logprobs[gen] <= 0).all()
    tool = workflow.toolbox.tools["search"].fn
    for s in called:
        ids = s.token_ids[s.prompt_len:]
        mask = s.loss_mask[s.prompt_len:]
        masked_text = tokenizer.decode([int(t) for t, m in zip(ids, mask) if m == 0])
        assert "<tool_response>" in masked_text  # the tool's result sits in masked tokens only
        trained_text = tokenizer.decode([int(t) for t, m in zip(ids, mask) if m == 1])
        assert "<tool_response>" not in trained_text and "<tool_call>" in trained_text
        if s.metadata["tool_errors"] == {k: 0 for k in s.metadata["tool_errors"]}:
            query = trained_text.split('"query": "', 1)[1].split('"', 1)[0]
            assert tool(query) in masked_text  # what the tool returned is what the model read
    rewards = [s.reward for s in samples]
    assert set(rewards) <= {0.0, 1.0} and max(rewards) == 1.0, rewards


def test_search_episodes_then_an_in_place_weight_update(world, engine):
    from safetensors.torch import load_file

    model_dir, data = world
    wf = _workflow(data)
    tasks = _tasks(data, "a")
    out = run_tasks(wf, tasks, {"policy": engine})
    samples = [s for t in tasks for s in out[t.task_id]]
    assert len(samples) == 4 * len(tasks)
    _check_episodes(samples, engine.tokenizer, wf, version=0)
    accuracy = float(np.mean([s.reward for s in samples]))
    print(f"\nwarm-started search agent: {accuracy:.2f} exact match, "
          f"{np.mean([s.metadata['tool_calls'] for s in samples]):.2f} calls per episode")

    # the same weights as version 1, loaded in place; new episodes are stamped with it
    engine.update_weights(load_file(str(model_dir / "model.safetensors")), version=1)
    assert engine.version == 1
    tasks = _tasks(data, "b")
    out = run_tasks(wf, tasks, {"policy": engine})
    samples = [s for t in tasks for s in out[t.task_id]]
    _check_episodes(samples, engine.tokenizer, wf, version=1)
