"""Constrained decoding on a real vLLM engine (CPU, xgrammar) through the OpenAI endpoint, with a
randomly initialised tiny chat model (so whatever structure comes out is the constraint's).

Checked: (a) a ``response_format`` ``json_schema`` completion parses and matches its schema, and
``json_object`` gives an object; (b) ``tool_choice: "required"`` yields tool calls of declared
tools with arguments matching their schemas, a named choice that tool, ``parallel_tool_calls:
false`` one call; (c) the recorded behaviour log-probs are those of the constrained distribution
each token was sampled from: every token the grammar forces has log-prob 0 (the model alone
gives it about -4.8, one in ~128), and the one free choice of a two-value enum has exactly the
log-prob of the model's distribution restricted to the two values, renormalised, at the sampling
temperature (recomputed with transformers in float32); a schema xgrammar cannot compile is a 400
naming ``response_format``.

The engine runs xgrammar with compact JSON (``disable_any_whitespace``): vLLM's default lets the
JSON hold any whitespace, and an untrained model writes newlines until ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import math

import openai
import pytest

from astralight.raas.openai_endpoint import OpenAIEndpoint

pytestmark = pytest.mark.vllm

VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}},
           "required": ["verdict"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"type": "boolean"}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now"}}]
MSGS = [{"role": "user", "content": "Is 2+2=4?"}]


#: the tiny chat template's generation prompt, and the same with the reasoning closed (as Qwen3's
#: template writes it with ``enable_thinking: false``): a forced call then starts at once (an
#: untrained model let into a ``<think>`` block rambles until ``max_tokens``)
OPEN = "<|im_start|>assistant\n{% endif %}"
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from astralight.trainer.tinymodel import build_chat_model, build_chat_tokenizer, save_model_folder

    tok = build_chat_tokenizer()
    assert tok.chat_template.endswith(OPEN)
    tok.chat_template = tok.chat_template[:-len(OPEN)] + CLOSED
    return save_model_folder(build_chat_model(), tok, tmp_path_factory.mktemp("guided") / "model")


@pytest.fixture(scope="module")
def engine(model_dir):
    from astralight.raas.vllm_engine import VLLMEngine

    eng = VLLMEngine(str(model_dir), dtype="float32", max_model_len=256, seed=0,
                     kv_cache_memory_bytes=64 << 20, enforce_eager=True, warmup=True,
                     engine_kwargs={"structured_outputs_config": {
                         "backend": "xgrammar", "disable_any_whitespace": True}})
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def endpoint():
    ep = OpenAIEndpoint().start()
    yield ep
    ep.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    """The model's own next-token log-probs (transformers, float32) after ``ids``."""
    import torch

    from astralight.trainer.hf_models import causal_lm_from_pretrained

    model = causal_lm_from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def logprobs(ids: list[int], temperature: float = 1.0):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        return torch.log_softmax(logits / temperature, -1)

    return logprobs


def _episode(endpoint, engine, fn):
    """``fn(client)`` on a thread while an episode is open; ``(result, records)``."""
    async def main():
        ep = endpoint.open_episode(engine, "policy")
        try:
            client = openai.OpenAI(base_url=endpoint.base_url(ep.id), api_key=endpoint.token,
                                   max_retries=0)
            out = await asyncio.get_running_loop().run_in_executor(None, fn, client)
        finally:
            records = endpoint.close_episode(ep.id)
        return out, records

    return asyncio.run(main())


def _verdict_format():
    return {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT,
                                                   "strict": True}}


def test_json_response_formats(endpoint, engine):
    def call(client):
        out = [client.chat.completions.create(model="policy", messages=MSGS, max_tokens=40,
                                              temperature=t, seed=s,
                                              response_format=_verdict_format())
               for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (1.3, 3))]
        out.append(client.chat.completions.create(model="policy", messages=MSGS, max_tokens=40,
                                                  temperature=0.0,
                                                  response_format={"type": "json_object"}))
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="policy", messages=MSGS, max_tokens=8, response_format={
                    "type": "json_schema", "json_schema": {"name": "x",
                                                           "schema": {"type": "nonsense"}}})
        return out, err.value.body

    (answers, refused), records = _episode(endpoint, engine, call)
    for answer in answers[:4]:
        assert answer.choices[0].finish_reason == "stop"
        assert json.loads(answer.choices[0].message.content)["verdict"] in ("yes", "no")
        assert set(json.loads(answer.choices[0].message.content)) == {"verdict"}
    assert isinstance(json.loads(answers[4].choices[0].message.content), dict)
    assert refused["param"] == "response_format" and "nonsense" in refused["message"]
    assert len(records) == 5  # the refused call left no record


def _check_calls(calls, names):
    assert calls, "no tool call"
    for call in calls:
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        if call.function.name == "add":
            assert set(args) == {"a", "b"} and args["a"] in (1, 2, 3)
            assert isinstance(args["b"], bool)
        else:
            assert args == {}


def test_forced_tool_calls(endpoint, engine):
    def call(client):
        def ask(**kwargs):
            return client.chat.completions.create(model="policy", messages=MSGS, tools=TOOLS,
                                                  max_tokens=120, temperature=0.0, **kwargs)
        named = {"type": "function", "function": {"name": "add"}}
        return (ask(tool_choice="required"), ask(tool_choice=named),
                ask(tool_choice=named, parallel_tool_calls=False),
                ask(tool_choice="required", parallel_tool_calls=False))

    (required, named, single, single_any), records = _episode(endpoint, engine, call)
    for answer, names in ((required, {"add", "now"}), (named, {"add"}), (single, {"add"}),
                          (single_any, {"add", "now"})):
        assert answer.choices[0].finish_reason == "tool_calls"
        _check_calls(answer.choices[0].message.tool_calls, names)
    assert len(single.choices[0].message.tool_calls) == 1
    assert len(single_any.choices[0].message.tool_calls) == 1
    assert all(r.tool_call_errors == {"malformed": 0, "unknown_tool": 0} for r in records)
    # the named call's fixed text ('{"name": "add", "arguments": ') was forced token by token
    text = records[1].text
    tok = engine.tokenizer
    pieces = [tok.decode([t]) for t in records[1].completion_ids]
    start = text.index('{"name"')
    at = [i for i in range(len(pieces)) if len("".join(pieces[:i])) == start][0]
    fixed = len('{"name": "add", "arguments": ')
    assert "".join(pieces[at:at + fixed]) == '{"name": "add", "arguments": '
    assert max(abs(lp) for lp in records[1].logprobs[at:at + fixed]) < 1e-5


def test_recorded_logprobs_are_the_constrained_distributions(endpoint, engine, reference):
    """Under ``{"verdict": "yes"|"no"}`` every token but the first letter of the value is
    forced; that letter's log-prob is the model's restricted to {y, n} at the temperature."""
    tok = engine.tokenizer
    y, n = tok.convert_tokens_to_ids("y"), tok.convert_tokens_to_ids("n")
    runs = [(0.0, None), (1.0, 1), (1.0, 4), (0.7, 2), (1.5, 3), (1.5, 5)]

    def call(client):
        return [client.chat.completions.create(model="policy", messages=MSGS, max_tokens=40,
                                               temperature=t, seed=s, logprobs=True,
                                               response_format=_verdict_format())
                for t, s in runs]

    answers, records = _episode(endpoint, engine, call)
    head = '{"verdict":"'
    for (temperature, _), answer, record in zip(runs, answers, records):
        text = record.text
        assert text in ('{"verdict":"yes"}', '{"verdict":"no"}')
        ids, lps = record.completion_ids, record.logprobs
        assert ids[-1] == tok.eos_token_id and len(ids) == len(text) + 1  # one token a character
        choice = len(head)
        forced = [lp for i, lp in enumerate(lps) if i != choice]
        assert max(abs(lp) for lp in forced) < 1e-5, lps
        # the model alone gives the forced '{' nothing like probability 1
        assert reference(record.prompt_ids)[ids[0]].item() < -1.0
        # the free choice: log-softmax over {y, n} of the logits at the sampling temperature
        # (greedy: vLLM reports the masked distribution at temperature 1)
        lp = reference(record.prompt_ids + ids[:choice], temperature or 1.0)
        expected = (lp[ids[choice]] - lp[[y, n]].logsumexp(0)).item()
        assert ids[choice] in (y, n)
        assert math.isclose(lps[choice], expected, abs_tol=2e-4), (lps[choice], expected,
                                                                   lp[ids[choice]].item())
        assert answer.choices[0].logprobs.content[choice].logprob == pytest.approx(lps[choice])
    assert sum(records[0].logprobs) == pytest.approx(records[0].logprobs[len(head)], abs=1e-4)
