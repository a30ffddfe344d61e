"""Chat templates a workflow renders with (``chat_template``), the refusal of a template that
hides the tools, and the calculator tool: a tool-calling episode for a model whose own template
has no tools section (SmolLM2's), with tool results masked."""

from __future__ import annotations

import pytest

from astralight.agents.calculator import calculator
from astralight.agents.chat import TemplateError
from astralight.agents.chat_templates import SHIPPED, load_chat_template, renders_tools
from astralight.agents.tools import Tool, parse_tool_calls
from astralight.protocol import Task
from astralight.rewards.math import MathVerifyReward
from astralight.tasks.word_problems import WordProblemSource
from astralight.trainer.tinymodel import build_chat_tokenizer
from astralight.workflows.tool_agent import ToolAgentWorkflow
from tests.unit.engine_fakes import ScriptedEngine, run_tasks

#: SmolLM2-135M-Instruct's own chat template, as its tokenizer ships it: ChatML, no tools
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 + 5"}}\n</tool_call>'


@pytest.fixture(scope="module")
def smol_tok():
    """A ChatML tokenizer whose own template is SmolLM2's (it ignores ``tools``)."""
    tok = build_chat_tokenizer()
    tok.chat_template = SMOLLM2_TEMPLATE
    return tok


def _task() -> Task:
    return Task(task_id="t1", prompt=[{"role": "user", "content": "Tom has 7 marbles and gets 5 "
                                       "more. How many marbles does Tom have now?"}],
                metadata={"answer": "12"}, model_ids=["policy"], n=1, workflow="tool_agent")


def _workflow(**kw) -> ToolAgentWorkflow:
    reward = MathVerifyReward(answer_format="boxed_or_last_number", isolation="inline")
    return ToolAgentWorkflow(tools=[calculator], reward=reward, max_turns=3, **kw)


def test_a_template_is_a_shipped_name_a_file_or_its_text(tmp_path):
    assert load_chat_template(None) is None
    shipped = load_chat_template("chatml_tools")
    assert shipped == SHIPPED["chatml_tools"].read_text() and "<tool_call>" in shipped
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{% endfor %}").startswith("{% for")
    for bad in ("chatml_tool", "", str(tmp_path / "missing.jinja"), 3):
        with pytest.raises(ValueError, match="chat_template"):
            load_chat_template(bad)


def test_chatml_tools_shows_the_tools_and_wraps_their_results(smol_tok):
    template = load_chat_template("chatml_tools")
    tools = [Tool(calculator).schema]
    assert not renders_tools(smol_tok, tools)  # SmolLM2's own template drops them
    assert renders_tools(smol_tok, tools, template)
    messages = [{"role": "system", "content": "Use the calculator."},
                {"role": "user", "content": "7 + 5?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {
                     "name": "calculator", "arguments": {"expression": "7 + 5"}}}]},
                {"role": "tool", "name": "calculator", "content": "12"},
                {"role": "tool", "name": "calculator", "content": "13"},
                {"role": "assistant", "content": "12"}]
    text = smol_tok.apply_chat_template(messages, tools=tools, chat_template=template,
                                        tokenize=False)
    assert text.startswith("<|im_start|>system\nUse the calculator.\n\n# Tools\n")
    assert '"name": "calculator"' in text.split("\n</tools>")[0]  # the schema, in the system turn
    # an OpenAI-shaped call is written as the block the parser reads
    (call,) = parse_tool_calls(text.split("<|im_start|>assistant\n")[1])
    assert call.name == "calculator" and call.arguments == {"expression": "7 + 5"}
    # consecutive results: one user turn, one <tool_response> each
    assert ("<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\n13\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n12<|im_end|>\n") in text
    # no tools, no system message: no system turn at all
    plain = smol_tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                         chat_template=template, tokenize=False,
                                         add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_hides_the_tools_is_refused_naming_the_fix(smol_tok):
    engine = ScriptedEngine(smol_tok, [CALL, "12"], max_model_len=512)
    with pytest.raises(TemplateError, match="renders no tools.*calculator.*chat_template: "
                                            "chatml_tools"):
        _workflow().transcript(engine, [{"role": "user", "content": "?"}])
    with pytest.raises(ValueError, match="chat_template_kwargs.chat_template"):
        _workflow(chat_template_kwargs={"chat_template": "chatml_tools"})


def test_a_calculator_episode_trains_only_the_model_turns(smol_tok):
    """SmolLM2's template with the workflow's chatml_tools: the call, the result and the answer;
    the tools section, the tool's result and the template's glue are masked."""
    engine = ScriptedEngine(smol_tok, [CALL, "Tom has 12 marbles."], version=3,
                            max_model_len=1024)
    (sample,) = run_tasks(_workflow(chat_template="chatml_tools"), [_task()],
                          {"policy": engine})["t1"]
    text = smol_tok.decode(sample.token_ids.tolist())
    assert "# Tools" in text and "<tool_response>\n12\n</tool_response>" in text
    mask = sample.loss_mask.astype(bool)
    trained = smol_tok.decode(sample.token_ids[mask].tolist())
    assert trained == CALL + "<|im_end|>" + "Tom has 12 marbles.<|im_end|>"
    masked = smol_tok.decode(sample.token_ids[~mask].tolist())
    assert "<tool_response>\n12\n</tool_response>" in masked and "# Tools" in masked
    assert (sample.logprobs[~mask] == 0).all() and (sample.versions[~mask] == -1).all()
    assert sample.reward == 1.0 and sample.metadata["tool_calls"] == 1
    assert sample.metadata["end"] == "answer"


@pytest.mark.parametrize("expression, value", [
    ("7 + 5", "12"), ("(12 - 3) * 4", "36"), ("7 / 2", "3.5"), ("1/3", "0.3333333333"),
    ("2 ** 10", "1024"), ("3 ^ 2", "9"), ("-4 + 1", "-3"), ("6 × 7", "42"), ("10 // 3", "3"),
])
def test_the_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os')", "only numbers"), ("x + 1", "only numbers"), ("1 / 0", "division by zero"),
    ("9 ** 9 ** 9", "exponents"), ("2 ** 0.5", "exponents"), ("", "empty"), ("1 +", "cannot read"),
    ("1" * 300, "longer than"), ("(10 ** 60) * (10 ** 60)", "digits"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
    with pytest.raises(ValueError, match=why):
        calculator(expression)


def test_the_cold_start_scripts_teach_the_format_and_leave_the_choice_to_rl(smol_tok):
    """Half the scripted episodes call the calculator and copy its result, half answer directly;
    laid out as the workflow lays out RL's episodes, only the assistant turns are trained."""
    from astralight.tasks.calculator_warmstart import calculator_conversations
    from astralight.tasks.chat_warmstart import encode_conversations

    source = {"ops": "+-", "min_operand": 1, "max_operand": 9}
    convs = calculator_conversations(64, tool_share=0.5, seed=0, source=source)
    calls = [c for c in convs if len(c) == 5]
    assert 20 <= len(calls) <= 44 and len(convs) - len(calls) == sum(len(c) == 3 for c in convs)
    src = WordProblemSource("train", **source)
    for i, c in enumerate(convs):
        p = src.get(i)  # the i-th train problem, in the recipe's chat form
        assert c[1:2] == p.prompt and c[0]["role"] == "system"
        assert c[-1]["content"] == f"The answer is {p.metadata['answer']}."  # always right
        if len(c) == 5:
            (call,) = parse_tool_calls(c[2]["content"])
            assert call.name == "calculator"
            assert c[3]["content"] == calculator(call.arguments["expression"]) == p.metadata["answer"]
    ids, attn, mask = encode_conversations(smol_tok, calls[:2], [Tool(calculator).schema],
                                           chat_template=load_chat_template("chatml_tools"))
    row = ids[0][: int(attn[0].sum())]
    trained = smol_tok.decode(row[mask[0][: len(row)].bool()].tolist())
    assert trained == (calls[0][2]["content"] + "<|im_end|>" + calls[0][4]["content"]
                       + "<|im_end|>")
    assert "<tool_response>" in smol_tok.decode(row.tolist())
