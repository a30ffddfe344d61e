"""The RaaS's OpenAI-compatible endpoint and the bring-your-own-agent workflow, driven by the real
``openai`` client against a scripted engine (tests/unit/engine_fakes.py).

Checked: the bearer token (missing / wrong refused), 400s that name the field, tool calls in the
OpenAI schema, records with the exact token ids, log-probs and versions; the workflow's merge rule
(an appending agent gives one sample per episode with tool tokens masked, a rewriting one a sample
per call with one group index), failing and timed-out agents (no sample, counted), eval tasks.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from astralight.agents.chat import encode, render
from astralight.protocol import Task
from astralight.raas.openai_endpoint import EpisodeSettings
from astralight.rewards.toy import ExactMatchReward
from astralight.trainer.tinymodel import build_chat_tokenizer
from astralight.workflows.base import TaskFailedError
from astralight.workflows.openai_agent import OpenAIAgentWorkflow, merge_calls
from tests.unit.engine_fakes import (CALCULATOR_CALL as CALL, PromptScriptEngine, calculator,
                                     in_episode, run_tasks)

ROOT = Path(__file__).resolve().parents[2]


def _example_agent():
    spec = importlib.util.spec_from_file_location("openai_agent_example",
                                                  ROOT / "examples/openai_agent/agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example_agent()


@pytest.fixture
def engine(tok):
    eng = PromptScriptEngine(calculator, tok, version=3, max_model_len=512, logprob=-0.5)
    yield eng
    eng.close()


MSGS = [{"role": "system", "content": "Answer with the number."},
        {"role": "user", "content": "123+456="}]


def test_token_is_required(endpoint, engine):
    def call(base_url, key):
        out = []
        for api_key in ("wrong-token", ""):
            client = openai.OpenAI(base_url=base_url, api_key=api_key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as err:
                client.chat.completions.create(model="policy", messages=MSGS)
            out.append(err.value.status_code)
        bare = httpx.post(f"{base_url}/chat/completions", json={"model": "policy",
                                                                "messages": MSGS})
        out.append((bare.status_code, bare.json()["error"]["param"]))
        browser = httpx.post(f"{base_url}/chat/completions", json={"model": "policy",
                                                                   "messages": MSGS},
                             headers={"Authorization": f"Bearer {key}",
                                      "Origin": "http://evil.example"})
        out.append(browser.status_code)
        return out

    out, records = in_episode(endpoint, engine, call)
    assert out == [401, 401, (401, "authorization"), 403]
    assert records == [] and engine.requests == []  # nothing reached the engine


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 2}, "n"),
    ({"extra_body": {"stream": "yes"}}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"chunk_size": 4}}, "stream_options.chunk_size"),
    ({"temperature": 5.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"stop": ["a" * 1001]}, "stop"),
    ({"stop": ["ok", "b" * 1001]}, "stop[1]"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"extra_body": {"best_of": 3}}, "best_of"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_requests_name_the_field(endpoint, engine, kwargs, param):
    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        args = {"model": "policy", "messages": MSGS, **kwargs}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**args)
        return err.value.status_code, err.value.body

    (status, body), records = in_episode(endpoint, engine, call)
    assert status == 400 and body["param"] == param and param in body["message"]
    assert records == [] and engine.requests == []


def test_unknown_model_and_episode_are_404(endpoint, engine):
    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.NotFoundError) as wrong_model:
            client.chat.completions.create(model="gpt-4o", messages=MSGS)
        other = openai.OpenAI(base_url=base_url.rsplit("/", 1)[0] + "/0123abcd", api_key=key,
                              max_retries=0)
        with pytest.raises(openai.NotFoundError) as wrong_episode:
            other.chat.completions.create(model="policy", messages=MSGS)
        listed = [m.id for m in client.models.list()]
        return wrong_model.value.body["param"], wrong_episode.value.body["param"], listed

    (model_param, episode_param, listed), _ = in_episode(endpoint, engine, call)
    assert (model_param, episode_param, listed) == ("model", "episode_id", ["policy"])


def test_tool_calls_in_openai_schema_and_exact_records(endpoint, engine, tok):
    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        first = client.chat.completions.create(model="policy", messages=MSGS, tools=EXAMPLE.TOOLS,
                                               logprobs=True, seed=5)
        msg = first.choices[0].message
        follow = MSGS + [{"role": "assistant", "content": msg.content,
                          "tool_calls": [c.model_dump() for c in msg.tool_calls]},
                         {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "579"}]
        second = client.chat.completions.create(model="policy", messages=follow,
                                                tools=EXAMPLE.TOOLS, max_tokens=8)
        return first, second, follow

    (first, second, follow), records = in_episode(endpoint, engine, call)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    [tc] = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "add"
    assert json.loads(tc.function.arguments) == {"a": 123, "b": 456}
    assert [t.logprob for t in choice.logprobs.content] == [-0.5] * first.usage.completion_tokens
    assert second.choices[0].message.content == "579"
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    # the records: exactly the template's rendering, the engine's tokens, versions, sampling
    assert [r.index for r in records] == [0, 1]
    r0, r1 = records
    assert r0.prompt_ids == encode(tok, render(tok, MSGS, EXAMPLE.TOOLS, True))
    assert r1.prompt_ids == encode(tok, render(tok, follow, EXAMPLE.TOOLS, True))
    assert r0.completion_ids == encode(tok, "Let me add." + CALL) + [tok.eos_token_id]
    assert r1.completion_ids == encode(tok, "579") + [tok.eos_token_id]
    assert first.usage.prompt_tokens == len(r0.prompt_ids)
    assert first.usage.completion_tokens == len(r0.completion_ids)
    assert r0.logprobs == [-0.5] * len(r0.completion_ids) and r0.versions == [3] * len(
        r0.completion_ids)
    assert r0.tool_calls[0]["function"]["name"] == "add" and r1.tool_calls == []
    specs = [spec for _, spec in engine.requests]
    assert specs[0].seed == 5 and specs[1].max_tokens == 8 and specs[1].temperature == 1.0
    # the re-rendered assistant turn is what the model generated: the calls merge
    [seg] = merge_calls(records)
    assert seg.token_ids[:len(r1.prompt_ids)] == r1.prompt_ids


def test_a_streamed_call_is_the_same_completion_in_chunks(endpoint, engine, tok):
    """``stream: true`` (LangChain ``streaming=True``, the Agents SDK's ``run_streamed``): the
    client's accumulated chunks are the non-streamed answer, and the records are the same."""
    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        plain = client.chat.completions.create(model="policy", messages=MSGS,
                                               tools=EXAMPLE.TOOLS, logprobs=True, seed=5)
        stream = client.chat.completions.create(model="policy", messages=MSGS,
                                                tools=EXAMPLE.TOOLS, logprobs=True, seed=5,
                                                stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        with client.chat.completions.stream(model="policy", messages=MSGS,
                                            tools=EXAMPLE.TOOLS) as helper:  # the SDK's helper
            final = helper.get_final_completion()
        answer = client.chat.completions.create(model="policy", stream=True, messages=MSGS + [
            {"role": "tool", "tool_call_id": "c", "content": "579"}])
        return plain, chunks, final, list(answer)

    (plain, chunks, final, answer), records = in_episode(endpoint, engine, call)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    *body, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == len(records[1].completion_ids)
    assert all(c.usage is None for c in body)
    deltas = [c.choices[0].delta for c in body]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == plain.choices[0].message.content
    [tc] = [t for d in deltas for t in (d.tool_calls or [])]
    want = plain.choices[0].message.tool_calls[0]
    assert (tc.index, tc.id, tc.type) == (0, records[1].tool_calls[0]["id"], "function")
    assert (tc.function.name, tc.function.arguments) == (want.function.name,
                                                         want.function.arguments)
    assert [c.choices[0].finish_reason for c in body][-1] == "tool_calls"
    streamed_lp = [t.logprob for c in body if c.choices[0].logprobs
                   for t in c.choices[0].logprobs.content]
    assert streamed_lp == [t.logprob for t in plain.choices[0].logprobs.content]
    # the SDK's stream helper rebuilds the same message
    assert final.choices[0].message.tool_calls[0].function.name == "add"
    assert final.choices[0].message.content == plain.choices[0].message.content
    # an answer without tool calls: content, then "stop"
    assert "".join(c.choices[0].delta.content or "" for c in answer) == "579"
    assert answer[-1].choices[0].finish_reason == "stop"
    # every call was generated and recorded as a plain one is
    assert len(records) == 4
    assert records[0].completion_ids == records[1].completion_ids == records[2].completion_ids
    assert records[1].logprobs == records[0].logprobs and records[3].tool_calls == []


def test_metadata_fields_change_nothing_and_template_kwargs_reach_the_template(endpoint):
    """Metadata-only fields are accepted and change nothing; ``chat_template_kwargs`` (vLLM's
    extra: Qwen3's ``enable_thinking``) and an assistant turn's ``reasoning_content`` are
    rendered, so the record holds the prompt the model saw; ``GET /models/{id}`` answers."""
    from astralight.trainer.tinymodel import CHAT_TEMPLATE

    tok = build_chat_tokenizer()
    tok.chat_template = (  # Qwen3's two template features, on the tiny chat template
        CHAT_TEMPLATE.replace("{{ content }}{% for call", "{% if m.reasoning_content %}<think>"
                              "{{ m.reasoning_content }}</think>{% endif %}{{ content }}"
                              "{% for call")
        + "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
          "<think></think>{% endif %}")
    engine = PromptScriptEngine(calculator, tok, version=3, max_model_len=512)
    history = MSGS + [{"role": "assistant", "content": "0", "reasoning_content": "hmm"},
                      {"role": "user", "content": "123+456="}]

    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        client.chat.completions.create(model="policy", messages=MSGS)
        client.chat.completions.create(
            model="policy", messages=MSGS, reasoning_effort="low", verbosity="low",
            prompt_cache_key="k", safety_identifier="s", store=False)
        client.chat.completions.create(model="policy", messages=history,
                                       extra_body={"chat_template_kwargs":
                                                   {"enable_thinking": False}})
        refused = []
        for kwargs, param in ((["x"], "chat_template_kwargs"),
                              ({"tools": []}, "chat_template_kwargs.tools")):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="policy", messages=MSGS,
                                               extra_body={"chat_template_kwargs": kwargs})
            refused.append(err.value.body["param"] == param)
        got = client.models.retrieve("policy")
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve("other")
        return refused, got.id, err.value.body["param"]

    try:
        (refused, model, missing), records = in_episode(endpoint, engine, call)
    finally:
        engine.close()
    assert refused == [True, True] and model == "policy" and missing == "model"
    plain, metadata, thinking = records
    assert metadata.prompt_ids == plain.prompt_ids  # the metadata changed nothing
    text = tok.decode(thinking.prompt_ids)
    assert "<think>hmm</think>0" in text and text.endswith("<|im_start|>assistant\n<think></think>")


#: the example's tool in the Responses API's flat form
RESPONSES_TOOLS = [{"type": "function", **EXAMPLE.TOOLS[0]["function"]}]


def test_the_responses_api_is_served_by_the_same_recorder(endpoint, engine, tok):
    """``client.responses.create`` (the Agents SDK's default): instructions and input become
    the chat conversation, a tool call a function_call item, its output continues the
    conversation by previous_response_id, and the two calls merge into one masked sample as
    chat completions do."""
    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        first = client.responses.create(model="policy", instructions=MSGS[0]["content"],
                                        input="123+456=", tools=RESPONSES_TOOLS, store=False,
                                        include=["message.output_text.logprobs"])
        [fc] = [o for o in first.output if o.type == "function_call"]
        second = client.responses.create(
            model="policy", instructions=MSGS[0]["content"], previous_response_id=first.id,
            tools=RESPONSES_TOOLS, max_output_tokens=8,
            input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "579"}])
        with client.responses.stream(model="policy", input="123+456=",
                                     instructions=MSGS[0]["content"],
                                     tools=RESPONSES_TOOLS) as stream:
            kinds = [e.type for e in stream]
            streamed = stream.get_final_response()
        refused = {}
        for name, kwargs in (("stream", {"stream": "yes"}),
                             ("previous_response_id", {"previous_response_id": "resp_nope"}),
                             ("input[0].type", {"input": [{"type": "web_search_call"}]}),
                             ("tools[0]", {"tools": [{"type": "web_search"}]}),
                             ("max_output_tokens", {"max_output_tokens": 0})):
            args = {"model": "policy", "input": "hi", **kwargs}
            try:
                client.responses.create(**args)
            except openai.APIStatusError as exc:
                refused[name] = (exc.status_code, exc.body["param"])
        return first, second, fc, refused, kinds, streamed

    (first, second, fc, refused, kinds, streamed), records = in_episode(endpoint, engine, call)
    # streamed: the same response, in the events the SDK's stream helper reads
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert streamed.output_text == first.output_text
    assert [o.type for o in streamed.output] == [o.type for o in first.output]
    assert records[2].completion_ids == records[0].completion_ids
    records = records[:2]
    assert first.status == "completed" and first.output_text == "Let me add."
    assert fc.name == "add" and json.loads(fc.arguments) == {"a": 123, "b": 456}
    assert fc.call_id == records[0].tool_calls[0]["id"]
    [msg] = [o for o in first.output if o.type == "message"]
    assert [lp.logprob for lp in msg.content[0].logprobs] == [-0.5] * len(
        records[0].completion_ids)
    assert second.output_text == "579" and second.usage.output_tokens == len(
        records[1].completion_ids)
    assert refused == {"stream": (400, "stream"),
                       "previous_response_id": (404, "previous_response_id"),
                       "input[0].type": (400, "input[0].type"), "tools[0]": (400, "tools[0]"),
                       "max_output_tokens": (400, "max_output_tokens")}
    # the same prompts the chat route renders for the same conversation
    r0, r1 = records
    assert r0.prompt_ids == encode(tok, render(tok, MSGS, EXAMPLE.TOOLS, True))
    follow = MSGS + [{"role": "assistant", "content": "Let me add.",
                      "tool_calls": r0.tool_calls},
                     {"role": "tool", "tool_call_id": fc.call_id, "content": "579"}]
    assert r1.prompt_ids == encode(tok, render(tok, follow, EXAMPLE.TOOLS, True))
    [seg] = merge_calls(records)  # one sample, the tool result masked
    assert seg.token_ids[:len(r1.prompt_ids)] == r1.prompt_ids


#: the example's tool as the Anthropic Messages API declares it
ANTHROPIC_TOOLS = [{"name": "add", "description": EXAMPLE.TOOLS[0]["function"]["description"],
                    "input_schema": EXAMPLE.TOOLS[0]["function"]["parameters"]}]


def test_the_anthropic_messages_api_is_served_by_the_same_recorder(endpoint, engine, tok):
    """The ``anthropic`` SDK (its ``x-api-key`` header, its ``/v1/messages`` path): tool_use
    blocks out, tool_result blocks back, recorded as chat completions are, merged into one
    sample."""
    import anthropic

    def call(base_url, key):
        client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)
        first = client.messages.create(model="policy", max_tokens=64,
                                       system=MSGS[0]["content"], tools=ANTHROPIC_TOOLS,
                                       messages=[{"role": "user", "content": "123+456="}])
        [use] = [b for b in first.content if b.type == "tool_use"]
        history = [{"role": "user", "content": "123+456="},
                   {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": "579"}]}]
        second = client.messages.create(model="policy", max_tokens=8, tools=ANTHROPIC_TOOLS,
                                        system=MSGS[0]["content"], messages=history)
        with client.messages.stream(model="policy", max_tokens=64, system=MSGS[0]["content"],
                                    tools=ANTHROPIC_TOOLS,
                                    messages=[{"role": "user", "content": "123+456="}]) as stream:
            streamed = stream.get_final_message()
        refused = {}
        for name, kwargs in (("max_tokens", {"max_tokens": 0}), ("top_k", {"extra_body": {"top_k": 5}}),
                             ("tool_choice", {"tool_choice": {"type": "any"}}),
                             ("stream", {"extra_body": {"stream": "yes"}})):
            args = {"model": "policy", "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}], **kwargs}
            try:
                client.messages.create(**args)
            except anthropic.APIStatusError as exc:
                refused[name] = (exc.status_code, exc.body["error"]["param"])
        bad_key = anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            bad_key.messages.create(model="policy", max_tokens=8,
                                    messages=[{"role": "user", "content": "hi"}])
        return first, use, second, refused, streamed

    (first, use, second, refused, streamed), records = in_episode(endpoint, engine, call)
    # streamed: the SDK's helper rebuilds the same message from the events
    def blocks(message):  # a tool_use id names its call (call_<episode>_<index>_<j>)
        return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in message.content]

    assert blocks(streamed) == blocks(first)
    assert streamed.content[1].id == records[2].tool_calls[0]["id"]
    assert streamed.stop_reason == "tool_use" and records[2].completion_ids == records[0].completion_ids
    records = records[:2]
    assert first.stop_reason == "tool_use" and first.content[0].text == "Let me add."
    assert use.name == "add" and use.input == {"a": 123, "b": 456}
    assert second.stop_reason == "end_turn" and second.content[0].text == "579"
    assert second.usage.output_tokens == len(records[1].completion_ids)
    assert refused == {k: (400, k) for k in ("max_tokens", "top_k", "tool_choice", "stream")}
    r0, r1 = records
    assert r0.prompt_ids == encode(tok, render(tok, MSGS, EXAMPLE.TOOLS, True))
    [seg] = merge_calls(records)  # the tool result masked between the two turns
    assert seg.token_ids[:len(r1.prompt_ids)] == r1.prompt_ids


def test_context_too_long_and_max_calls(endpoint, tok):
    eng = PromptScriptEngine(calculator, tok, max_model_len=40)

    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as long:
            client.chat.completions.create(model="policy", messages=MSGS)
        short = [{"role": "user", "content": "1+1="}]
        client.chat.completions.create(model="policy", messages=short, max_tokens=4)
        with pytest.raises(openai.BadRequestError) as many:
            client.chat.completions.create(model="policy", messages=short)
        return long.value.body, many.value.body

    try:
        (long, many), records = in_episode(endpoint, eng, call, EpisodeSettings(max_calls=2))
    finally:
        eng.close()
    assert long["code"] == "context_length_exceeded" and long["param"] == "messages"
    assert many["code"] == "max_calls_exceeded"
    assert len(records) == 1 and eng.requests[0][1].max_tokens == 4


def test_sampling_defaults_and_forced_sampling(endpoint, engine):
    from astralight.engine import SamplingSpec

    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        client.chat.completions.create(model="policy", messages=MSGS)
        client.chat.completions.create(model="policy", messages=MSGS, temperature=0.0, top_p=0.5)

    defaults = EpisodeSettings(sampling=SamplingSpec(temperature=0.7, max_tokens=9, seed=11),
                               seed_key="t", seed_slot=1, seed_stride=4)
    in_episode(endpoint, engine, call, defaults)
    forced = EpisodeSettings(sampling=SamplingSpec(temperature=0.7), force_sampling=True)
    in_episode(endpoint, engine, call, forced)
    specs = [spec for _, spec in engine.requests]
    assert [(s.temperature, s.top_p, s.max_tokens) for s in specs] == [
        (0.7, 1.0, 9), (0.0, 0.5, 9), (0.7, 1.0, 64), (0.7, 1.0, 64)]
    # seeded defaults: call i of episode slot g gets the seed of request g + i * stride
    base = SamplingSpec(temperature=0.7, max_tokens=9, seed=11)
    assert [specs[0].seed, specs[1].seed] == [base.for_request(1, "t").seed,
                                              base.for_request(5, "t").seed]


# ----------------------------------------------------------------------------- the workflow


def _task(task_id="t0", n=2, kind="train"):
    return Task(task_id=task_id, prompt="123+456=", n=n, model_ids=["policy"], kind=kind,
                metadata={"answer": "579"})


def test_appending_agent_merges_into_one_masked_sample(endpoint, engine, tok):
    wf = OpenAIAgentWorkflow(EXAMPLE.calculator_agent, ExactMatchReward(), endpoint=endpoint)
    samples = run_tasks(wf, [_task(n=2)], {"policy": engine})["t0"]
    assert [s.sample_index for s in samples] == [0, 1]
    assert sorted(s.group_index for s in samples) == [0, 1]
    for s in samples:
        assert s.reward == 1.0 and s.metadata["segments"] == 1 and s.metadata["turns"] == 2
        assert s.metadata["tool_calls"] == 1 and s.metadata["answer"] == "579"
        ids = s.token_ids.tolist()
        first = encode(tok, render(tok, MSGS, EXAMPLE.TOOLS, True))
        gen1 = encode(tok, "Let me add." + CALL) + [tok.eos_token_id]
        gen2 = encode(tok, "579") + [tok.eos_token_id]
        assert s.prompt_len == len(first) and ids[:len(first)] == first
        mask = s.loss_mask.tolist()
        # trained: exactly the two completions; masked: the prompt, the tool turn between them
        assert [t for t, m in zip(ids, mask) if m] == gen1 + gen2
        tool_part = [t for t, m in zip(ids[len(first) + len(gen1):], mask[len(first) + len(gen1):])
                     if not m]
        assert "<tool_response>\n579\n</tool_response>" in tok.decode(tool_part)
        assert ids[-len(gen2):] == gen2 and mask[-len(gen2):] == [1] * len(gen2)
        versions = s.versions.tolist()
        assert {v for v, m in zip(versions, mask) if m} == {3}
        assert {v for v, m in zip(versions, mask) if not m} == {-1}
        assert np.all(s.logprobs[s.loss_mask == 0] == 0.0)
        assert np.allclose(s.logprobs[s.loss_mask == 1], -0.5)
    assert wf.stats["merged_calls"] == 2 and wf.stats["agent_errors"] == 0


def rewriting_agent(task, base_url, api_key, model):
    """Calls twice with unrelated histories (the second prompt does not extend the first)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "9+9="}])
    reply = client.chat.completions.create(model=model, messages=[
        {"role": "user", "content": task["prompt"] + " (tool said 579)"}])
    return reply.choices[0].message.content


def test_rewriting_agent_gives_a_sample_per_call_in_one_group(endpoint, engine):
    wf = OpenAIAgentWorkflow(rewriting_agent, ExactMatchReward(), endpoint=endpoint)
    samples = run_tasks(wf, [_task(n=2)], {"policy": engine})["t0"]
    assert [s.sample_index for s in samples] == [0, 1, 2, 3]
    by_episode = {}
    for s in samples:
        by_episode.setdefault(s.group_index, []).append(s)
    assert sorted(by_episode) == [0, 1]
    for group in by_episode.values():
        assert [s.metadata["segment"] for s in group] == [0, 1]
        assert {s.metadata["segments"] for s in group} == {2}
        assert len({s.reward for s in group}) == 1  # the episode's reward on each


def test_merge_off_and_eval_keep_one_sample_rule(endpoint, engine):
    split = OpenAIAgentWorkflow(EXAMPLE.calculator_agent, ExactMatchReward(), merge=False,
                                endpoint=endpoint)
    samples = run_tasks(split, [_task(n=1)], {"policy": engine})["t0"]
    assert len(samples) == 2 and {s.group_index for s in samples} == {0}
    ev = OpenAIAgentWorkflow(rewriting_agent, ExactMatchReward(), endpoint=endpoint)
    samples = run_tasks(ev, [_task("e0", n=3, kind="eval")], {"policy": engine})["e0"]
    assert len(samples) == 3 and sorted(s.group_index for s in samples) == [0, 1, 2]


def failing_agent(task, base_url, api_key, model):
    if task["episode"] == 0:
        raise RuntimeError("the agent broke")
    return EXAMPLE.calculator_agent(task, base_url, api_key, model)


def slow_agent(task, base_url, api_key, model):
    """Times out, then tries to call: its episode is closed by then."""
    time.sleep(0.6)
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        client.chat.completions.create(model=model, messages=MSGS)
    except openai.NotFoundError:
        SLOW_SEEN.append("404")
    return "579"


SLOW_SEEN: list = []


def test_failing_and_timed_out_agents_give_no_samples(endpoint, engine):
    wf = OpenAIAgentWorkflow(failing_agent, ExactMatchReward(), endpoint=endpoint)
    samples = run_tasks(wf, [_task(n=2)], {"policy": engine})["t0"]
    assert [s.group_index for s in samples] == [1] and samples[0].sample_index == 0
    assert wf.stats["agent_errors"] == 1
    slow = OpenAIAgentWorkflow(slow_agent, ExactMatchReward(), timeout_s=0.2, endpoint=endpoint)
    # every episode failed: the task goes back to the dataflow at once (not left to expire)
    with pytest.raises(TaskFailedError, match=r"every episode of task t0 failed .*1 of 1; the "
                                              r"first: timeout"):
        run_tasks(slow, [_task(n=1)], {"policy": engine})
    assert slow.stats["agent_timeouts"] == 1
    deadline = time.monotonic() + 10
    while not SLOW_SEEN and time.monotonic() < deadline:
        time.sleep(0.05)
    assert SLOW_SEEN == ["404"]


def called_then_broke(task, base_url, api_key, model):
    """One call, then a failure of the agent's own (a misspelt tool, MaxTurnsExceeded...)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model=model, messages=task["messages"])
    raise RuntimeError("max turns exceeded")


def test_a_failed_agent_is_scored_on_the_calls_it_made(endpoint, engine):
    """failed_reward (default 0): an agent that raised after calling the model leaves samples
    of those calls with that reward, marked as failed and counted; None drops them."""
    from astralight.agents.stats import batch_scalars, episode_counts, window_section

    wf = OpenAIAgentWorkflow(called_then_broke, ExactMatchReward(), endpoint=endpoint)
    samples = run_tasks(wf, [_task(n=2), _task("t1", n=1, kind="eval")], {"policy": engine})
    train, (ev,) = samples["t0"], samples["t1"]
    assert len(train) == 2 and all(s.reward == 0.0 for s in train)
    assert all(s.metadata["end"] == "error" for s in train + [ev])
    assert train[0].metadata["agent_error"] == "RuntimeError: max turns exceeded"
    assert ev.reward == 0.0  # eval accuracy counts the failure as wrong
    assert train[0].loss_mask.any() and wf.stats["agent_errors"] == 3
    counts = episode_counts(train[0].metadata)
    assert counts["agent_failed_error"] == 1 and counts["agent_failed_timeout"] == 0
    assert window_section(counts)["agents_failed"] == {"error": 1, "timeout": 0}
    assert batch_scalars([s.metadata for s in train])["agent_failed/error"] == 1.0
    dropped = OpenAIAgentWorkflow(called_then_broke, ExactMatchReward(), endpoint=endpoint,
                                  failed_reward=None)
    with pytest.raises(TaskFailedError, match="2 of 2; the first: RuntimeError: max turns"):
        run_tasks(dropped, [_task(n=2)], {"policy": engine})
    ok = run_tasks(OpenAIAgentWorkflow(EXAMPLE.calculator_agent, ExactMatchReward(),
                                       endpoint=endpoint), [_task(n=1)], {"policy": engine})
    assert episode_counts(ok["t0"][0].metadata)["agent_failed_error"] == 0


def test_an_agent_failing_alike_from_the_start_is_broken_not_the_policy(endpoint, engine):
    from astralight.workflows.base import BrokenWorkflowError

    wf = OpenAIAgentWorkflow(called_then_broke, ExactMatchReward(), endpoint=endpoint,
                             fail_fast=3)
    run_tasks(wf, [_task(n=2)], {"policy": engine})  # 2 of the first 3: not yet
    with pytest.raises(BrokenWorkflowError, match=r"first 3 episodes.*RuntimeError: max turns "
                                                  r"exceeded.*fail_fast: 0"):
        run_tasks(wf, [_task(n=2)], {"policy": engine})
    mixed = OpenAIAgentWorkflow(failing_agent, ExactMatchReward(), endpoint=endpoint,
                                fail_fast=2)  # episode 0 raises, episode 1 answers
    run_tasks(mixed, [_task(n=2), _task(n=2)], {"policy": engine})
    never = OpenAIAgentWorkflow(called_then_broke, ExactMatchReward(), endpoint=endpoint,
                                fail_fast=0)
    run_tasks(never, [_task(n=4)], {"policy": engine})
    assert never.stats["agent_errors"] == 4
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="fail_fast"):
            OpenAIAgentWorkflow(called_then_broke, ExactMatchReward(), fail_fast=bad)


def test_agent_signature_is_checked():
    with pytest.raises(ValueError, match="agent:"):
        OpenAIAgentWorkflow(lambda task: "x", ExactMatchReward())
    with pytest.raises(ValueError, match="agent:"):
        OpenAIAgentWorkflow("no_such_module.agent", ExactMatchReward())


async def async_agent(task, base_url, api_key, model):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(model=model, messages=MSGS)
    return reply.choices[0].message.content


def test_async_agent(endpoint, engine):
    wf = OpenAIAgentWorkflow(async_agent, ExactMatchReward(), endpoint=endpoint)
    [s] = run_tasks(wf, [_task(n=1)], {"policy": engine})["t0"]
    # no tools declared: the tool-call text is the content, and it is not the answer
    assert s.reward == 0.0 and s.metadata["tool_calls"] == 0
    assert "<tool_call>" in s.metadata["answer"]


_SHARED_HTTP: dict = {}


async def shared_pool_agent(task, base_url, api_key, model):
    """An agent whose framework keeps per-process async state: one HTTP connection pool (as the
    OpenAI Agents SDK's default provider does) and a rate limiter, made by the first episode
    and used by every other."""
    pool = _SHARED_HTTP.setdefault("client", httpx.AsyncClient())
    limiter = _SHARED_HTTP.setdefault("limiter", asyncio.Semaphore(1))
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                http_client=pool)
    async with limiter:
        reply = await client.chat.completions.create(model=model, messages=[
            {"role": "user", "content": task["prompt"]}])
        await asyncio.sleep(0.01)  # held while the other episodes wait on it
    return reply.choices[0].message.content


def test_async_agents_share_one_loop_so_per_process_clients_work_across_episodes(
        endpoint, engine, caplog):
    """A loop per episode failed every episode after the first with 'bound to a different event
    loop' and left 'Event loop is closed' tracebacks; on the one agent loop they all work."""
    _SHARED_HTTP.clear()
    wf = OpenAIAgentWorkflow(shared_pool_agent, ExactMatchReward(), endpoint=endpoint)
    tasks = [Task(task_id=f"t{i}", prompt=p, n=3, model_ids=["policy"],
                  metadata={"answer": "0"}) for i, p in enumerate(["1+1=", "2+2=", "3+3="])]
    with caplog.at_level("WARNING"):
        out = run_tasks(wf, tasks, {"policy": engine})
    assert wf.stats["agent_errors"] == 0 and wf.stats["episodes"] == 9
    assert all(len(out[t.task_id]) == 3 and all(s.reward == 1.0 for s in out[t.task_id])
               for t in tasks)
    assert "different event loop" not in caplog.text and "Event loop is closed" not in caplog.text


async def slow_async_agent(task, base_url, api_key, model):
    await asyncio.sleep(30)


def test_a_timed_out_async_agent_is_cancelled_on_the_agent_loop(endpoint, engine):
    wf = OpenAIAgentWorkflow(slow_async_agent, ExactMatchReward(), timeout_s=0.3,
                             endpoint=endpoint)
    t0 = time.monotonic()
    with pytest.raises(TaskFailedError):
        run_tasks(wf, [_task(n=2)], {"policy": engine})
    assert wf.stats["agent_timeouts"] == 2 and time.monotonic() - t0 < 10
    from astralight.workflows.openai_agent import agent_loop

    left = asyncio.run_coroutine_threadsafe(_agent_tasks(), agent_loop()).result(timeout=5)
    assert not any("slow_async_agent" in repr(t.get_coro()) for t in left)  # cancelled, not left


async def _agent_tasks():
    await asyncio.sleep(0.05)  # the cancellations land
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def async_exiting_agent(task, base_url, api_key, model):
    import sys

    sys.exit(3)


def test_an_async_agent_that_exits_fails_its_episode_not_the_agent_loop(endpoint, engine):
    wf = OpenAIAgentWorkflow(async_exiting_agent, ExactMatchReward(), timeout_s=30,
                             endpoint=endpoint)
    with pytest.raises(TaskFailedError):
        run_tasks(wf, [_task(n=2)], {"policy": engine})
    assert wf.stats["agent_errors"] == 2 and wf.stats["agent_timeouts"] == 0
    wf2 = OpenAIAgentWorkflow(async_agent, ExactMatchReward(), endpoint=endpoint)
    assert len(run_tasks(wf2, [_task(n=1)], {"policy": engine})["t0"]) == 1  # the loop lives


def exiting_agent(task, base_url, api_key, model):
    """Agent code that calls sys.exit (argparse, click...) or leaks a StopIteration."""
    import sys

    if task["episode"] == 0:
        sys.exit(2)
    raise StopIteration("ran out")


def test_an_agent_that_exits_fails_its_episode_not_the_loop(endpoint, engine):
    wf = OpenAIAgentWorkflow(exiting_agent, ExactMatchReward(), timeout_s=30, endpoint=endpoint)
    with pytest.raises(TaskFailedError):
        run_tasks(wf, [_task(n=2)], {"policy": engine})
    # both are errors; neither waited out timeout_s (a StopIteration used to hang its future)
    assert wf.stats["agent_errors"] == 2 and wf.stats["agent_timeouts"] == 0


def test_calls_at_different_temperatures_never_share_a_sample():
    from types import SimpleNamespace

    def rec(i, prompt, completion, temperature):
        return SimpleNamespace(index=i, prompt_ids=prompt, completion_ids=completion,
                               logprobs=[-0.5] * len(completion), versions=[0] * len(completion),
                               temperature=temperature)

    first = rec(0, [1, 2], [3, 4], 1.0)
    same = rec(1, [1, 2, 3, 4, 5], [6], 1.0)  # extends the first, same temperature: merged
    other = rec(2, [1, 2, 3, 4, 5, 6, 7], [8], 0.5)  # extends them, another temperature
    segments = merge_calls([first, same, other])
    assert [s.calls for s in segments] == [[0, 1], [2]]
    assert [s.temperature for s in segments] == [1.0, 0.5]


def test_forced_sampling_is_the_default_and_overrides_a_hard_coded_seed(endpoint, engine):
    from astralight.engine import SamplingSpec

    assert OpenAIAgentWorkflow(EXAMPLE.calculator_agent, ExactMatchReward()).force_sampling is True

    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        client.chat.completions.create(model="policy", messages=MSGS, temperature=0.0, seed=42)

    before = len(engine.requests)
    forced = EpisodeSettings(sampling=SamplingSpec(temperature=0.9, seed=5), force_sampling=True,
                             seed_key="t", seed_slot=2)
    in_episode(endpoint, engine, call, forced)
    (spec,) = [spec for _, spec in engine.requests[before:]]
    assert spec.temperature == 0.9
    assert spec.seed == SamplingSpec(temperature=0.9, seed=5).for_request(2, "t").seed != 42


def test_json_the_parser_cannot_read_is_a_400_naming_the_body(endpoint, engine):
    """Issue 41, item 8: an integer of 5,000 digits (Python's ``json`` refuses past 4,300 with a
    plain ``ValueError``) was a 500; nesting past the recursion limit was already a 400."""
    def call(base_url, key):
        out = []
        for raw in ('{"model": "policy", "seed": ' + "9" * 5000 + ', "messages": []}',
                    '{"model": "policy", "messages": ' + "[" * 5000 + "]" * 5000 + "}"):
            r = httpx.post(f"{base_url}/chat/completions", content=raw,
                           headers={"Authorization": f"Bearer {key}",
                                    "Content-Type": "application/json"}, timeout=30)
            out.append((r.status_code, r.json().get("error", r.json()).get("param")))
        return out

    out, records = in_episode(endpoint, engine, call)
    assert out == [(400, "body"), (400, "body")]
    assert records == [] and engine.requests == []


def test_two_host_headers_are_refused_not_the_last_one_read():
    """Issue 41, item 9: the guard read the last of two ``Host`` headers; a request could name
    a loopback host to one reader and another host to the next. Refused whatever they say."""
    from astralight.raas.openai_guard import LoopbackGuard, bearer_digest

    counts, reached, sent = [], [], []

    async def app(scope, receive, send):
        reached.append(scope)

    async def send(message):
        sent.append(message)

    guard = LoopbackGuard(app, bearer_digest("k"), counts.append)
    for hosts in ([b"evil.example", b"127.0.0.1"], [b"127.0.0.1", b"127.0.0.1:8000"]):
        sent.clear()
        scope = {"type": "http", "headers": [(b"authorization", b"Bearer k")]
                 + [(b"host", h) for h in hosts]}
        asyncio.run(guard(scope, None, send))
        assert sent[0]["status"] == 400
        assert json.loads(sent[1]["body"])["error"]["param"] == "host"
    ok = {"type": "http", "headers": [(b"authorization", b"Bearer k"), (b"host", b"127.0.0.1")]}
    asyncio.run(guard(ok, None, send))
    assert len(reached) == 1 and counts.count("refused") == 2


# ------------------------------------------------- issue 41: malformed text, the frozen loop


class WatchedTokenizer:
    """The chat tokenizer, recording on which thread it renders (``render``), encodes
    (``encode``) and decodes an assistant turn (``decode_turn``: ``skip_special_tokens``), and
    the length of every text it encodes; ``gate(text)`` runs before each encode."""

    def __init__(self, inner, gate=None):
        self._inner, self._gate = inner, gate
        self.threads: list[tuple[str, int]] = []
        self.encoded: list[int] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, text, **kwargs):
        self.threads.append(("encode", threading.get_ident()))
        self.encoded.append(len(text))
        if self._gate is not None:
            self._gate(text)
        return self._inner(text, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.threads.append(("render", threading.get_ident()))
        return self._inner.apply_chat_template(*args, **kwargs)

    def decode(self, ids, **kwargs):
        if kwargs.get("skip_special_tokens"):
            self.threads.append(("decode_turn", threading.get_ident()))
        return self._inner.decode(ids, **kwargs)


def test_rendering_tokenizing_and_decoding_run_off_the_episode_loop(endpoint, tok):
    """Issue 41, item 2: a call was rendered and tokenized on the episode's loop (the RaaS's),
    so one 8 MiB conversation froze every episode, lease, push and weight refresh for ~10 s.

    No clock: while the prompt is being encoded, the encode waits for a coroutine of the
    episode's loop to run. Off the loop it does at once; on the loop it cannot (the wait times
    out and records False)."""
    encoding, loop_ran, seen = threading.Event(), threading.Event(), []

    def gate(text):
        if "GATE" in text:
            encoding.set()
            seen.append(loop_ran.wait(timeout=5))

    wtok = WatchedTokenizer(tok, gate)
    eng = PromptScriptEngine(calculator, wtok, max_model_len=512)

    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        return client.chat.completions.create(
            model="policy", tools=EXAMPLE.TOOLS,
            messages=[{"role": "user", "content": "GATE 123+456="}])

    async def main():
        ep = endpoint.open_episode(eng, "policy")

        async def the_rest_of_the_raas():
            while not encoding.is_set():
                await asyncio.sleep(0.005)
            loop_ran.set()

        other = asyncio.create_task(the_rest_of_the_raas())
        try:
            reply = await asyncio.get_running_loop().run_in_executor(
                None, call, endpoint.base_url(ep.id), endpoint.token)
        finally:
            endpoint.close_episode(ep.id)
            other.cancel()
        return threading.get_ident(), reply

    try:
        loop_thread, reply = asyncio.run(main())
    finally:
        eng.close()
    assert seen == [True]
    assert reply.choices[0].message.tool_calls[0].function.name == "add"
    assert {"render", "encode", "decode_turn"} <= {what for what, _ in wtok.threads}
    assert [what for what, thread in wtok.threads if thread == loop_thread] == []


def test_a_conversation_too_long_to_fit_is_refused_before_it_is_tokenized(endpoint, tok):
    """Issue 41, item 2: the context check came after tokenizing. Every token of the chat
    tokenizer stands for at most 16 characters (its longest added token), so 100 messages of
    2,000 characters cannot fit 512 tokens: refused without encoding them. A conversation that
    fits is still served (the bound never refuses one that fits)."""
    wtok = WatchedTokenizer(tok)
    eng = PromptScriptEngine(calculator, wtok, max_model_len=512)
    long = [{"role": "user", "content": "x" * 2000}] * 100

    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="policy", messages=long)
        encoded_before_the_fitting_call = list(wtok.encoded)
        client.chat.completions.create(model="policy", messages=MSGS, max_tokens=8)
        return err.value.body, encoded_before_the_fitting_call

    try:
        (body, encoded), records = in_episode(endpoint, eng, call)
    finally:
        eng.close()
    assert body["param"] == "messages" and body["code"] == "context_length_exceeded"
    assert "at least" in body["message"] and "512" in body["message"]
    assert encoded == []  # the long conversation was never tokenized
    assert len(records) == 1 and records[0].prompt_ids == encode(tok, render(tok, MSGS, None, True))


def test_a_stop_string_of_several_tokens_cuts_the_completion_after_it(endpoint, tok):
    """A stop string the engine cannot stop on (several tokens) ends the call where it first
    occurs: the agent gets the text before it, the record the tokens up to the one completing
    it, with their exact log-probs; a 100,000-character one is refused untokenized."""
    wtok = WatchedTokenizer(tok)
    eng = PromptScriptEngine(lambda prompt, k: "Let me add.\nObservation: 579 done", wtok,
                             max_model_len=512, logprob=-0.25)

    def call(base_url, key):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        cut = client.chat.completions.create(model="policy", messages=MSGS,
                                             stop=["\nObservation:", "never"])
        whole = client.chat.completions.create(model="policy", messages=MSGS, stop="never")
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="policy", messages=MSGS, stop="y" * 100_000)
        return cut, whole, err.value.body

    try:
        (cut, whole, body), records = in_episode(endpoint, eng, call)
    finally:
        eng.close()
    assert cut.choices[0].message.content == "Let me add."
    assert cut.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content == "Let me add.\nObservation: 579 done"
    r_cut, r_whole = records
    n = len(r_cut.completion_ids)
    assert r_cut.completion_ids == r_whole.completion_ids[:n] and n < len(r_whole.completion_ids)
    assert tok.decode(r_cut.completion_ids).endswith("\nObservation:")  # up to the stop's end
    assert not tok.decode(r_cut.completion_ids[:-1]).endswith("\nObservation:")
    assert r_cut.logprobs == [-0.25] * n and r_cut.versions == r_whole.versions[:n]
    assert r_cut.finish_reason == "stop" and cut.usage.completion_tokens == n
    assert body["param"] == "stop" and "at most 1000" in body["message"]
    assert 100_000 not in wtok.encoded and len(records) == 2


#: a lone UTF-16 surrogate as the JSON escape a client can send (json.dumps never writes one)
LONE = "\\ud800"
OK_MESSAGES = '[{"role": "user", "content": "123+456="}]'


def _body(**fields: str) -> str:
    """A raw JSON body: ``model`` and ``messages`` unless given, then ``fields`` (raw JSON)."""
    fields = {"model": '"policy"', "messages": OK_MESSAGES, **fields}
    return "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"


def test_lone_surrogates_and_unreadable_integers_are_400s_naming_the_field(endpoint, engine):
    """Issue 41, item 8: a lone surrogate in a message, in ``stop``, in a tool name or in a
    field name answered 500 (the tokenizer cannot encode it; a refusal quoting a field name
    could not be written as UTF-8), and so did one in a UTF-16 body (the parser guessed the
    encoding); a surrogate pair is valid text and still served."""
    cases = [
        (_body(messages='[{"role": "user", "content": "a' + LONE + 'b"}]'),
         "messages[0].content"),
        (_body(stop=f'"{LONE}"'), "stop"),
        (_body(stop=f'["x", "{LONE}"]'), "stop[1]"),
        (_body(tools='[{"type": "function", "function": {"name": "' + LONE + '"}}]'),
         "tools[0].function.name"),
        ("{" + f'"{LONE}": 1, ' + _body()[1:], "body"),
        (_body(messages='[{"role": "user", "content": "hi", "x' + LONE + '": 1}]'),
         "messages[0]"),
        (_body(tools='[{"type": "function", "function": {"name": "add", "parameters": '
                     '{"type": "object", "properties": {"' + LONE + '": {}}}}}]'),
         "tools[0].function.parameters.properties"),
        (_body(seed="9" * 5000), "body"),  # past Python's 4,300-digit limit
        (_body(temperature="9" * 4000), "temperature"),  # readable, too large for a float
        (_body(stop=f'"{LONE}"').encode("utf-16"), "body"),  # JSON must be UTF-8
    ]
    pair = _body(messages='[{"role": "user", "content": "hi \\ud83d\\ude00"}]')

    def call(base_url, key):
        out = []
        for raw, _ in cases + [(pair, None)]:
            raw = raw.encode() if isinstance(raw, str) else raw
            r = httpx.post(f"{base_url}/chat/completions", content=raw,
                           headers={"Authorization": f"Bearer {key}",
                                    "Content-Type": "application/json"}, timeout=30)
            try:
                error = r.json().get("error") if r.status_code != 200 else None
            except ValueError:  # not JSON at all (a server error page)
                error = {"param": None, "message": r.text[:80]}
            out.append((r.status_code, error and error["param"],
                        error is None or error["message"].startswith(str(error["param"]))))
        return out

    out, records = in_episode(endpoint, engine, call)
    assert out == [(400, param, True) for _, param in cases] + [(200, None, True)]
    assert len(records) == 1 and len(engine.requests) == 1  # only the pair reached the engine


def test_unclosed_tool_call_tags_are_read_in_one_pass():
    """A completion ending in thousands of unclosed ``<tool_call>`` tags made the block regexes
    (of ``parse_tool_calls`` and ``split_tool_calls``) scan to its end from each tag: quadratic,
    inside one regex call that holds the interpreter lock, so no thread -- the RaaS's loop
    included -- ran meanwhile. Now the regexes run only up to the last ``</tool_call>``.

    The bound is generous on purpose: the one pass takes milliseconds, the old scan of this
    text about 30 s (7 s for half as many tags: it grows with their square), so 5 s separates
    them even on a loaded machine."""
    from astralight.raas.openai_completions import split_tool_calls

    text = "Let me add." + CALL + "<tool_call>" * 8_000
    start = time.perf_counter()
    content, calls, errors = split_tool_calls(text, EXAMPLE.TOOLS, "e" * 12, 0)
    took = time.perf_counter() - start
    assert [c["function"]["name"] for c in calls] == ["add"]
    assert errors == {"malformed": 1, "unknown_tool": 0}
    assert content == "Let me add." + "<tool_call>" * 8_000
    assert took < 5.0, f"split_tool_calls took {took:.1f} s"


# ---------------------------------------------------------------- per-episode keys


def test_each_episode_has_its_own_key_which_also_chooses_it_on_the_shared_base_url(endpoint,
                                                                                    engine):
    """One base URL for a whole process (``OPENAI_BASE_URL``, a client made once per key): the
    key picks the episode, and each call lands in its own episode's records."""
    async def main():
        a = endpoint.open_episode(engine, "policy")
        b = endpoint.open_episode(engine, "policy")
        assert a.key != b.key and a.key.startswith("ep-")

        def calls():
            out = {}
            for ep, prompt in ((a, "123+456="), (b, "1+1=")):
                client = openai.OpenAI(base_url=endpoint.shared_base_url, api_key=ep.key,
                                       max_retries=0)
                reply = client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": prompt}])
                out[ep.id] = reply.choices[0].message
                assert client.models.list().data[0].id == "policy"
            return out

        try:
            out = await asyncio.get_running_loop().run_in_executor(None, calls)
        finally:
            records = {ep.id: endpoint.close_episode(ep.id) for ep in (a, b)}
        return a, b, out, records

    a, b, out, records = asyncio.run(main())
    assert "<tool_call>" in out[a.id].content and out[b.id].content == "0"  # (no tools declared)
    assert [r.messages[-1]["content"] for r in records[a.id]] == ["123+456="]
    assert [r.messages[-1]["content"] for r in records[b.id]] == ["1+1="]


def test_a_key_used_on_another_episodes_path_is_refused_and_counted(endpoint, engine):
    """A client shared across episodes would put one task's conversation into another task's
    samples, scored with the wrong reward: the endpoint refuses it, naming why."""
    async def main():
        a = endpoint.open_episode(engine, "policy")
        b = endpoint.open_episode(engine, "policy")
        before = endpoint.counters["wrong_episode"]

        def calls():
            crossed = openai.OpenAI(base_url=endpoint.base_url(b.id), api_key=a.key,
                                    max_retries=0)
            with pytest.raises(openai.PermissionDeniedError) as err:
                crossed.chat.completions.create(model="policy", messages=MSGS)
            own = openai.OpenAI(base_url=endpoint.base_url(a.id), api_key=a.key, max_retries=0)
            own.chat.completions.create(model="policy", messages=MSGS)
            # the process token names no episode on the key-routed paths
            bare = httpx.post(f"{endpoint.shared_base_url}/chat/completions",
                              json={"model": "policy", "messages": MSGS},
                              headers={"Authorization": f"Bearer {endpoint.token}"})
            return err.value, bare

        try:
            err, bare = await asyncio.get_running_loop().run_in_executor(None, calls)
        finally:
            records = {ep.id: endpoint.close_episode(ep.id) for ep in (a, b)}
        return a, b, err, bare, records, endpoint.counters["wrong_episode"] - before

    a, b, err, bare, records, counted = asyncio.run(main())
    assert err.status_code == 403 and err.body["code"] == "wrong_episode"
    assert "belongs to another episode" in err.body["message"]
    assert counted == 1 and records[b.id] == [] and len(records[a.id]) == 1
    assert bare.status_code == 400 and bare.json()["error"]["code"] == "episode_key_required"


def test_a_closed_episodes_key_hears_that_its_episode_ended(endpoint, engine):
    async def main():
        ep = endpoint.open_episode(engine, "policy")
        endpoint.close_episode(ep.id)
        return ep

    ep = asyncio.run(main())
    late = httpx.post(f"{endpoint.shared_base_url}/chat/completions",
                      json={"model": "policy", "messages": MSGS},
                      headers={"Authorization": f"Bearer {ep.key}"})
    assert late.status_code == 404 and late.json()["error"]["code"] == "episode_not_found"
    unknown = httpx.post(f"{endpoint.shared_base_url}/chat/completions",
                         json={"model": "policy", "messages": MSGS},
                         headers={"Authorization": "Bearer ep-made-up"})
    assert unknown.status_code == 401
