"""Constrained decoding on the OpenAI endpoint: ``response_format`` JSON, ``tool_choice``
``"required"`` and a named tool (and their Responses / Messages forms).

Checked: the request fields are parsed and refused naming the field; each request's constraint
(:func:`~astralight.raas.openai_completions.request_constraint`) is the one that reaches the
engine's ``SamplingSpec.constraint``; the structural tags accept the tool calls and JSON they
should and nothing else (compiled by xgrammar with the tiny chat tokenizer); an engine that cannot
constrain decoding (no ``constrained_decoding``, the transformers engine) or refuses a schema is a
400 naming the field and records nothing; ``tool_choice: "none"`` is unchanged (tools neither
announced nor parsed). That vLLM honours the constraints with exact log-probs is
tests/integration/test_guided_decoding_vllm.py's.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from astralight.engine import ConstraintError, SamplingSpec
from astralight.raas.openai_completions import request_constraint, tool_calls_format
from astralight.raas.openai_endpoint import OpenAIEndpoint
from astralight.raas.openai_requests import RequestError, parse_request
from astralight.trainer.tinymodel import build_chat_tokenizer
from tests.unit.engine_fakes import ConstrainedScriptEngine, PromptScriptEngine, in_episode

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": ADD}},
         {"type": "function", "function": {"name": "now", "description": "the time"}}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"], "additionalProperties": False}
MSGS = [{"role": "user", "content": "123+456="}]
CALL_ADD = '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call>'
CALL_NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
PROMPT = "<|im_start|>user\n123+456=<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def _req(**body):
    return parse_request({"model": "policy", "messages": MSGS, **body})


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ANSWER,
                                                                 "format": 1}}},
     "response_format.json_schema.format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": ANSWER,
                                                                 "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_object", "schema": ANSWER}}, "response_format.schema"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools declared
    ({"tool_choice": "always", "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "mul"}}, "tools": TOOLS},
     "tool_choice.function.name"),
    ({"tool_choice": {"type": "function", "name": "add"}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {}}, "tools": TOOLS},
     "tool_choice"),
    ({"parallel_tool_calls": "no", "tools": TOOLS}, "parallel_tool_calls"),
])
def test_refused_fields_are_named(body, param):
    with pytest.raises(RequestError) as err:
        _req(**body)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(param)


def test_parsed_fields():
    assert _req().tool_choice == "auto" and _req().response_format is None
    assert _req(response_format={"type": "text"}).response_format is None
    assert _req(response_format={"type": "json_object"}).response_format == {"type": "json_object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER,
                                                  "strict": True, "description": "d"}}
    assert _req(response_format=fmt).response_format == {"type": "json_schema", "schema": ANSWER}
    named = _req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}},
                 parallel_tool_calls=False)
    assert (named.tool_choice, named.tool_name) == ("named", "now")
    assert named.parallel_tool_calls is False
    assert named.forced_tools and named.constraint_param == "tool_choice"
    required = _req(tools=TOOLS, tool_choice="required", response_format=fmt)
    assert required.constraint_param == "tool_choice"  # the calls are the whole completion
    assert _req(response_format=fmt).constraint_param == "response_format"
    none = _req(tools=TOOLS, tool_choice="none")
    assert not none.use_tools and none.constraint_param is None


def test_sampling_spec_constraint_shapes():
    spec = SamplingSpec(seed=3, constraint={"json_schema": ANSWER})
    assert spec.for_request(1, "t").constraint == {"json_schema": ANSWER}
    assert SamplingSpec(constraint={"json_object": True}) != SamplingSpec()
    for bad in ({}, {"json_schema": ANSWER, "json_object": True}, {"regex": "a+"},
                {"json_schema": "{}"}, {"json_object": 1},
                {"structural_tag": {"format": {}}}, ["json_object"]):
        with pytest.raises(ValueError, match="constraint"):
            SamplingSpec(constraint=bad)


# ----------------------------------------------------------------------------- constraints


def test_request_constraints(tok):
    def constraint(prompt=PROMPT, **body):
        return request_constraint(_req(**body), tok, prompt)

    assert constraint() is None
    assert constraint(tools=TOOLS) is None
    schema_fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    assert constraint(response_format=schema_fmt) == {"json_schema": ANSWER}
    assert constraint(response_format={"type": "json_object"}) == {"json_object": True}
    # tool_choice none: the tools are not announced, so the answer is the JSON alone
    assert constraint(response_format=schema_fmt, tools=TOOLS,
                      tool_choice="none") == {"json_schema": ANSWER}
    # tools announced (auto): the JSON answer or tool calls
    either = constraint(response_format=schema_fmt, tools=TOOLS)["structural_tag"]["format"]
    assert either["type"] == "or" and either["elements"][0] == {"type": "json_schema",
                                                                "json_schema": ANSWER}
    assert either["elements"][1] == tool_calls_format(TOOLS)
    # forced: the tool calls after the reasoning the template allows (<think> is in the vocab)
    required = constraint(tools=TOOLS, tool_choice="required")["structural_tag"]
    assert required["type"] == "structural_tag"
    think, calls = required["format"]["elements"]
    assert think["type"] == "optional" and calls == tool_calls_format(TOOLS, parallel=True)
    named = constraint(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}},
                       parallel_tool_calls=False)["structural_tag"]["format"]
    assert named["elements"][1] == tool_calls_format(TOOLS[1:], parallel=False)
    assert "add" not in json.dumps(named)
    # a template that closed the reasoning already: the calls alone
    closed = constraint(PROMPT + "<think>\n\n</think>\n\n", tools=TOOLS, tool_choice="required")
    assert closed["structural_tag"]["format"]["elements"] == [tool_calls_format(TOOLS)]
    with pytest.raises(ValueError, match="tools"):
        tool_calls_format([])


def _accepts(tok, constraint, text: str) -> bool:
    """Whether ``constraint``'s grammar (xgrammar, the tiny chat tokenizer) accepts ``text``
    and then the end of the turn."""
    xgr = pytest.importorskip("xgrammar")
    compiler = _accepts.__dict__.setdefault("compiler", xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))))
    kind, value = next(iter(constraint.items()))
    if kind == "structural_tag":
        compiled = compiler.compile_structural_tag(json.dumps(value))
    else:
        compiled = compiler.compile_json_schema(json.dumps(value if kind == "json_schema"
                                                           else {"type": "object"}))
    matcher = xgr.GrammarMatcher(compiled)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return all(matcher.accept_token(i) for i in ids) and matcher.accept_token(tok.eos_token_id)


@pytest.mark.parametrize("body, prompt, accepted, refused", [
    ({"tool_choice": "required"}, PROMPT,
     [CALL_ADD, CALL_NOW, CALL_ADD + "\n" + CALL_NOW, "<think>add them</think>\n\n" + CALL_ADD],
     ["", "Let me add." + CALL_ADD, CALL_ADD.replace("add", "mul"),
      CALL_ADD.replace(', "b": 456', ""),  # a required argument missing
      CALL_ADD.replace('"a": 123', '"a": 1.5'),  # not an integer
      CALL_ADD.replace('"a": 123', '"a":  123'),  # two spaces: at most one between tokens
      CALL_ADD + " bye", "add them</think>" + CALL_ADD]),
    ({"tool_choice": "required", "parallel_tool_calls": False}, PROMPT, [CALL_ADD, CALL_NOW],
     [CALL_ADD + "\n" + CALL_NOW]),
    ({"tool_choice": {"type": "function", "function": {"name": "now"}}}, PROMPT,
     [CALL_NOW, CALL_NOW + "\n" + CALL_NOW, CALL_NOW.replace("\n", "")],
     [CALL_ADD, CALL_NOW.replace("{}", '{"tz": "UTC"}')]),
    # a template that opened <think>: the completion continues it, then calls
    ({"tool_choice": {"type": "function", "function": {"name": "now"}}}, PROMPT + "<think>\n",
     ["the time</think>\n\n" + CALL_NOW, "</think>" + CALL_NOW], [CALL_NOW]),
    ({"response_format": {"type": "json_object"}}, PROMPT,
     [CALL_ADD, '{"answer": 579}', "{}"], ["579", '[579]', "<think>x</think>{}"]),
])
def test_tool_call_grammars(tok, body, prompt, accepted, refused):
    constraint = request_constraint(_req(tools=TOOLS, **body), tok, prompt)
    assert [t for t in accepted if not _accepts(tok, constraint, t)] == []
    assert [t for t in refused if _accepts(tok, constraint, t)] == []


def test_json_schema_grammar(tok):
    constraint = request_constraint(_req(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": ANSWER}}), tok, PROMPT)
    assert _accepts(tok, constraint, '{"answer": 579}')
    assert not _accepts(tok, constraint, '{"answer": "579"}')
    assert not _accepts(tok, constraint, '{"answer": 579, "why": 1}')


# ----------------------------------------------------------------------------- the endpoint


@pytest.fixture(scope="module")
def endpoint():
    ep = OpenAIEndpoint().start()
    yield ep
    ep.close()


def _scripted(prompt: str, k: int) -> str:
    """Text that satisfies what the test asks (the fake checks no constraint)."""
    if "answer as JSON" in prompt:
        return '{"answer": 579}'
    return CALL_NOW if "what time" in prompt else CALL_ADD


def test_constraints_reach_the_engine(endpoint, tok):
    engine = ConstrainedScriptEngine(_scripted, tok, max_model_len=512)

    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        required = client.chat.completions.create(model="policy", messages=MSGS, tools=TOOLS,
                                                  tool_choice="required")
        named = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "what time is it?"}],
            tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}},
            parallel_tool_calls=False)
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER,
                                                      "strict": True}}
        as_json = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "123+456, answer as JSON"}],
            response_format=fmt)
        none = client.chat.completions.create(model="policy", messages=MSGS, tools=TOOLS,
                                              tool_choice="none")
        return required, named, as_json, none

    (required, named, as_json, none), records = in_episode(endpoint, engine, call)
    specs = [spec for _, spec in engine.requests]
    assert [r.tool_calls[0]["function"]["name"] for r in records[:2]] == ["add", "now"]
    assert required.choices[0].finish_reason == "tool_calls"
    assert json.loads(required.choices[0].message.tool_calls[0].function.arguments) == {
        "a": 123, "b": 456}
    assert named.choices[0].message.tool_calls[0].function.name == "now"
    assert json.loads(as_json.choices[0].message.content) == {"answer": 579}
    req = _req(tools=TOOLS, tool_choice="required")
    assert specs[0].constraint == request_constraint(req, tok, engine.requests[0][0])
    assert specs[1].constraint["structural_tag"]["format"]["elements"][1] == tool_calls_format(
        TOOLS[1:], parallel=False)
    assert specs[2].constraint == {"json_schema": ANSWER}
    # tool_choice none: unconstrained, tools not announced, the call text left as content
    assert specs[3].constraint is None and "tools:" not in engine.requests[3][0]
    assert none.choices[0].message.content == CALL_ADD and records[3].tool_calls == []
    # each record says how its decoding was constrained (the samples carry it on)
    assert [r.constrained for r in records] == ["tool_calls", "tool_calls", "json_schema", None]


def test_a_samples_metadata_lists_its_calls_constraints():
    from types import SimpleNamespace

    from astralight.workflows.openai_agent import _constrained

    records = [SimpleNamespace(index=0, constrained="tool_calls"),
               SimpleNamespace(index=1, constrained=None),
               SimpleNamespace(index=2, constrained="json_schema")]
    assert _constrained(records, [0, 1, 2]) == {"constrained": ["json_schema", "tool_calls"]}
    assert _constrained(records, [1]) == {}


def test_responses_and_messages_dialects(endpoint, tok):
    engine = ConstrainedScriptEngine(_scripted, tok, max_model_len=512)
    flat = [{"type": "function", "name": t["function"]["name"],
             "parameters": t["function"].get("parameters", {"type": "object"})} for t in TOOLS]

    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        structured = client.responses.create(
            model="policy", input="123+456, answer as JSON",
            text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER,
                             "strict": True}})
        named = client.responses.create(model="policy", input="what time is it?", tools=flat,
                                        tool_choice={"type": "function", "name": "now"},
                                        parallel_tool_calls=False)
        claude = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)
        tools = [{"name": t["function"]["name"],
                  "input_schema": t["function"].get("parameters", {"type": "object"})}
                 for t in TOOLS]
        any_tool = claude.messages.create(model="policy", max_tokens=64, tools=tools,
                                          tool_choice={"type": "any"}, messages=MSGS)
        one_tool = claude.messages.create(
            model="policy", max_tokens=64, tools=tools, messages=MSGS,
            tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True})
        return structured, named, any_tool, one_tool

    (structured, named, any_tool, one_tool), records = in_episode(endpoint, engine, call)
    specs = [spec for _, spec in engine.requests]
    assert json.loads(structured.output_text) == {"answer": 579}
    assert structured.text.format.type == "json_schema"
    assert specs[0].constraint == {"json_schema": ANSWER}
    assert [item.name for item in named.output] == ["now"] and named.parallel_tool_calls is False

    def calls(spec):
        return spec.constraint["structural_tag"]["format"]["elements"][1]

    assert calls(specs[1]) == tool_calls_format([records[1].tools[1]], parallel=False)
    assert any_tool.stop_reason == "tool_use" and one_tool.content[0].name == "add"
    assert calls(specs[2]) == tool_calls_format(records[2].tools)  # any: every tool
    assert calls(specs[3]) == tool_calls_format([records[3].tools[0]], parallel=False)


def test_engines_that_cannot_constrain_are_a_400(endpoint, tok):
    plain = PromptScriptEngine(_scripted, tok, max_model_len=512)  # no constrained_decoding
    refusing = ConstrainedScriptEngine(_scripted, tok, max_model_len=512,
                                       refuse="the schema uses $ref cycles")

    def call(engine):
        def run(base_url, key):
            client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
            out = []
            for kwargs in ({"tools": TOOLS, "tool_choice": "required"},
                           {"response_format": {"type": "json_object"}}):
                with pytest.raises(openai.BadRequestError) as err:
                    client.chat.completions.create(model="policy", messages=MSGS, **kwargs)
                out.append((err.value.body["param"], err.value.body["message"]))
            return out
        return in_episode(endpoint, engine, run)

    out, records = call(plain)
    assert [p for p, _ in out] == ["tool_choice", "response_format"] and records == []
    assert all("cannot constrain decoding" in m and "PromptScriptEngine" in m for _, m in out)
    assert plain.requests == []  # nothing reached the engine
    out, records = call(refusing)
    assert [p for p, _ in out] == ["tool_choice", "response_format"] and records == []
    assert all("$ref cycles" in m for _, m in out) and refusing.requests == []


def test_the_transformers_engine_refuses_constraints(tiny_model_dir):
    from astralight.raas.hf_engine import HFEngine

    eng = HFEngine(str(tiny_model_dir))
    try:
        assert eng.constrained_decoding is False
        with pytest.raises(ConstraintError, match="cannot constrain decoding"):
            eng.generate_batch([[1, 2, 3]], SamplingSpec(max_tokens=2,
                                                         constraint={"json_object": True}))
        assert len(eng.generate_batch([[1, 2, 3]], SamplingSpec(max_tokens=2))[0].token_ids) <= 2
    finally:
        eng.close()


def test_the_responses_api_names_a_refused_constraint_as_it_names_the_field(endpoint, tok):
    plain = PromptScriptEngine(_scripted, tok, max_model_len=512)  # no constrained_decoding

    def run(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="policy", input="123+456, answer as JSON",
                                    text={"format": {"type": "json_object"}})
        return err.value.body["param"]

    param, records = in_episode(endpoint, plain, run)
    assert param == "text.format" and records == []
