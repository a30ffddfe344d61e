"""Tools (schemas, parsing, every failure kind), the tool-agent workflow on a scripted engine, and
the counts the trainer and the dataflow report."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from astralight.agents.stats import ERROR_KINDS, batch_scalars, episode_counts, window_section
from astralight.agents.tools import Tool, ToolBox, ToolCall, load_tool, parse_tool_calls
from astralight.dataflow import evals
from astralight.protocol import Sample, Task
from astralight.rewards.toy import ExactMatchReward
from astralight.trainer.tinymodel import build_chat_tokenizer
from astralight.workflows.tool_agent import ToolAgentWorkflow
from tests.unit.engine_fakes import ScriptedEngine, run_tasks

CALL = '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def slow(x: int) -> int:
    """Sleep, then answer.

    Args:
        x: anything
    """
    time.sleep(1.0)
    return x


def boom(x: int) -> int:
    """Raise.

    Args:
        x: anything
    """
    raise RuntimeError("tool broke")


class Lookup:
    """A class tool: callable instances, configured by init_args."""

    def __init__(self, table: dict):
        self.table = table

    def __call__(self, key: str) -> str:
        """Look a key up.

        Args:
            key: the key
        """
        return self.table[key]


def undocumented(a):
    return a


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def test_schema_comes_from_signature_and_docstring():
    schema = Tool(add).schema["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two integers."
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first addend"}
    assert schema["parameters"]["required"] == ["a", "b"]
    cls = load_tool({"class_path": "tests.unit.test_tool_agent.Lookup",
                     "init_args": {"table": {"k": "v"}}, "timeout_s": 2})
    assert cls.name == "Lookup" and cls.timeout_s == 2.0
    assert list(cls.schema["function"]["parameters"]["properties"]) == ["key"]


def test_bad_tool_configs_name_the_field():
    with pytest.raises(ValueError, match="tools.undocumented: cannot derive its JSON schema"):
        Tool(undocumented)
    with pytest.raises(ValueError, match="unknown keys \\['timeout'\\]"):
        load_tool({"class_path": "tests.unit.test_tool_agent.add", "timeout": 3})
    with pytest.raises(ValueError, match="cannot import"):
        load_tool("tests.unit.test_tool_agent.nope")
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolBox([add, add])


def test_parse_reads_every_block_and_marks_malformed_ones():
    calls = parse_tool_calls(f"x{CALL} y <tool_call>{{\"name\": \"add\", \"arguments\": \"{{\\\"a\\\": 1}}\"}}</tool_call>")
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 123, "b": 456}, None), ("add", {"a": 1}, None)]
    assert parse_tool_calls("no call here") == []
    bad = parse_tool_calls("<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{")
    assert [c.error[0] for c in bad] == ["malformed"] * 3
    assert "not JSON" in bad[0].error[1] and "without </tool_call>" in bad[2].error[1]


def test_every_failure_becomes_an_error_result_of_its_kind():
    box = ToolBox([add, Tool(slow, timeout_s=0.05), boom])

    async def run(call):
        return await box.call(call)

    ok = asyncio.run(run(ToolCall("add", {"a": 2, "b": 3})))
    assert (ok.content, ok.error) == ("5", None)
    cases = {
        "malformed": ToolCall(error=("malformed", "not JSON")),
        "unknown_tool": ToolCall("sub", {"a": 1}),
        "bad_arguments": ToolCall("add", {"a": 1, "c": 2}),
        "exception": ToolCall("boom", {"x": 1}),
        "timeout": ToolCall("slow", {"x": 1}),
    }
    assert set(cases) == set(ERROR_KINDS)
    for kind, call in cases.items():
        result = asyncio.run(run(call))
        assert result.error == kind, (kind, result)
        assert result.content.startswith("error: ")
    assert "tool broke" in asyncio.run(run(cases["exception"])).content
    assert "timed out after 0.05 s" in asyncio.run(run(cases["timeout"])).content
    long = ToolBox([Lookup({"k": "x" * 50})], max_result_chars=10)
    assert asyncio.run(long.call(ToolCall("Lookup", {"key": "k"}))).content == "x" * 10 + " ...(truncated)"


def _task(n: int = 1, kind: str = "train") -> Task:
    return Task(task_id="t1", prompt="123+456=", metadata={"answer": "579"}, model_ids=["policy"],
                n=n, workflow="tool_agent", kind=kind)


def _workflow(**kw) -> ToolAgentWorkflow:
    return ToolAgentWorkflow(tools=[add], reward=ExactMatchReward(),
                             system_prompt="Answer with the number.", **kw)


def test_an_episode_calls_the_tool_and_trains_only_its_own_turns(tok):
    engine = ScriptedEngine(tok, [CALL, "579"], version=5, max_model_len=256)
    (sample,) = run_tasks(_workflow(), [_task()], {"policy": engine})["t1"]
    text = tok.decode(sample.token_ids.tolist())
    assert "<tool_response>\n579\n</tool_response>" in text and text.endswith("579<|im_end|>")
    trained = tok.decode(sample.token_ids[sample.loss_mask.astype(bool)].tolist())
    assert trained == CALL + "<|im_end|>579<|im_end|>"
    masked = ~sample.loss_mask.astype(bool)
    assert (sample.versions[masked] == -1).all() and (sample.logprobs[masked] == 0).all()
    assert (sample.versions[~masked] == 5).all()
    assert sample.reward == 1.0
    assert sample.metadata["tool_calls"] == 1 and sample.metadata["end"] == "answer"
    assert sample.metadata["tool_errors"] == dict.fromkeys(ERROR_KINDS, 0)
    assert sample.metadata["turns"] == 2 and sample.metadata["answer"] == "579"


def test_a_bad_call_is_an_error_message_and_the_episode_goes_on(tok):
    bad = '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
    engine = ScriptedEngine(tok, [bad, "<tool_call>{oops</tool_call>", "580"], max_model_len=256)
    (sample,) = run_tasks(_workflow(max_turns=4), [_task()], {"policy": engine})["t1"]
    text = tok.decode(sample.token_ids.tolist())
    assert "error: unknown tool 'mul'; tools: add" in text
    assert sample.metadata["tool_errors"]["unknown_tool"] == 1
    assert sample.metadata["tool_errors"]["malformed"] == 1
    assert sample.metadata["tool_calls"] == 2 and sample.reward == 0.0


def test_turn_and_token_budgets_end_the_episode(tok):
    engine = ScriptedEngine(tok, [CALL], max_model_len=256)
    (sample,) = run_tasks(_workflow(max_turns=2), [_task()], {"policy": engine})["t1"]
    assert sample.metadata["end"] == "max_turns" and sample.metadata["turns"] == 2
    assert sample.reward == 0.0  # no answer was given
    engine = ScriptedEngine(tok, [CALL], max_model_len=256)
    (sample,) = run_tasks(_workflow(max_turns=8, max_total_tokens=200), [_task()],
                          {"policy": engine})["t1"]
    assert sample.metadata["end"] == "token_budget"
    # every request was cut to what the budget left
    assert all(spec.max_tokens <= 200 for _, spec in engine.calls)


def _sample(calls: int, errors: dict | None = None, reward: float = 1.0) -> Sample:
    meta = {"tool_calls": calls, "tool_errors": dict(dict.fromkeys(ERROR_KINDS, 0), **(errors or {})),
            "turns": calls + 1}
    return Sample(task_id="t", sample_index=0, model_id="p", token_ids=np.zeros(3, np.int32),
                  logprobs=np.zeros(3, np.float32), loss_mask=np.array([0, 1, 1], np.uint8),
                  versions=np.array([-1, 2, 2], np.int32), reward=reward, metadata=meta)


def test_counts_for_the_dataflow_and_the_trainer():
    assert episode_counts({"temperature": 1.0}) == {}
    counts = episode_counts(_sample(2, {"timeout": 1}).metadata)
    assert counts["agent_episodes"] == 1 and counts["tool_episodes"] == 1
    assert counts["tool_calls"] == 2 and counts["tool_errors_timeout"] == 1
    sums = {"agent_episodes": 4, "tool_episodes": 1, "tool_calls": 3, "tool_errors_malformed": 2}
    section = window_section(sums)
    assert section["tool_call_rate"] == 0.25 and section["tool_calls_per_episode"] == 0.75
    assert section["tool_errors"]["malformed"] == 2 and window_section({}) is None
    scalars = batch_scalars([_sample(0).metadata, _sample(2, {"exception": 1}).metadata, None])
    assert scalars["tool_call_rate"] == 0.5 and scalars["tool_calls"] == 1.0
    assert scalars["tool_errors/exception"] == 0.5 and scalars["turns"] == 2.0
    assert batch_scalars([{"temperature": 1.0}]) == {}


def test_eval_reports_count_the_episodes_that_called_a_tool():
    report = evals.summarize([_sample(0), _sample(1), _sample(3)])
    assert report["n_tool_calling"] == 2
    plain = _sample(0)
    plain.metadata = {}
    assert evals.summarize([plain])["n_tool_calling"] is None


def test_counts_ignore_what_is_not_a_count_and_later_segments():
    assert episode_counts({"tool_calls": [{"name": "add"}]}) == {}  # another workflow's key
    assert episode_counts({"tool_calls": True}) == {}
    assert episode_counts({"tool_calls": 2, "segment": 1}) == {}  # counted on segment 0
    assert episode_counts({"tool_calls": 2, "tool_errors": "oops"})["tool_errors_timeout"] == 0
    assert batch_scalars([{"tool_calls": "3"}]) == {}
    odd = _sample(0)
    odd.metadata = {"tool_calls": [1, 2]}
    assert evals.summarize([odd])["n_tool_calling"] is None


def test_calls_on_the_last_turn_are_counted(tok):
    engine = ScriptedEngine(tok, [CALL], max_model_len=256)
    (sample,) = run_tasks(_workflow(max_turns=1), [_task()], {"policy": engine})["t1"]
    assert sample.metadata["tool_calls"] == 1 and sample.metadata["end"] == "max_turns"


def test_json_a_parser_cannot_read_is_a_malformed_call_not_a_crash():
    """Issue 41, item 4: ``json.loads`` raises ``RecursionError`` past ~1,000 levels and a plain
    ``ValueError`` for an integer past 4,300 digits; both were uncaught, and one completion in
    ten with one failed 484 of 1,211 tool-agent tasks. Each is now a counted ``malformed`` call."""
    deep = '{"name": "add", "arguments": {"a": ' + "[" * 1200 + "]" * 1200 + "}}"
    huge = '{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}"
    as_string = json.dumps({"name": "add", "arguments": '{"a": ' + "[" * 1200 + "]" * 1200 + "}"})
    calls = parse_tool_calls("".join(f"<tool_call>{b}</tool_call>" for b in (deep, huge, as_string))
                             + CALL)
    assert [c.error[0] if c.error else None for c in calls] == ["malformed"] * 3 + [None]
    assert "nested too deeply" in calls[0].error[1] and "digits" in calls[1].error[1]
    assert calls[2].name == "add" and calls[3].arguments == {"a": 123, "b": 456}
