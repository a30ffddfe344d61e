"""ChatTranscript: token-exact chat episodes through the tiny chat tokenizer's Qwen3-style template."""

from __future__ import annotations

import pytest

from astralight.agents.chat import ChatTranscript, TemplateError, encode, render
from astralight.engine import Completion
from astralight.trainer.tinymodel import build_chat_tokenizer, build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.",
                                            "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def turn(tok, text: str, version: int, finish: str = "stop", logprob: float = -0.25) -> Completion:
    ids = encode(tok, text) + ([tok.eos_token_id] if finish == "stop" else [])
    return Completion(ids, [logprob] * len(ids), finish, version=version)


def test_tool_conversation_equals_the_templates_rendering_of_the_whole(tok):
    msgs = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "123+456="}]
    t = ChatTranscript(tok, msgs, TOOLS)
    assert t.token_ids == encode(tok, render(tok, msgs, TOOLS, add_generation_prompt=True))
    call = '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call>'
    t.add_completion(turn(tok, call, 3), 3, call)
    t.add_messages([{"role": "tool", "name": "add", "content": "579"},
                    {"role": "tool", "name": "add", "content": "ok"}])
    t.add_completion(turn(tok, "579", 4), 4, "579")
    full = encode(tok, render(tok, t.messages, TOOLS, add_generation_prompt=False))
    # the stream is the rendering up to the model's last <|im_end|>; the template adds "\n"
    assert t.token_ids == full[: len(t.token_ids)]
    assert full[len(t.token_ids):] == encode(tok, "\n")
    # masks: exactly the two assistant turns (their stop tokens included) are trained
    trained = [i for i, m in enumerate(t.loss_mask) if m]
    n1, n2 = len(encode(tok, call)) + 1, len(encode(tok, "579")) + 1
    assert len(trained) == n1 + n2
    assert tok.decode([t.token_ids[i] for i in trained]) == call + "<|im_end|>579<|im_end|>"
    assert [t.versions[i] for i in trained] == [3] * n1 + [4] * n2
    assert all(t.logprobs[i] == 0.0 and t.versions[i] == -1
               for i, m in enumerate(t.loss_mask) if not m)
    assert {t.logprobs[i] for i in trained} == {-0.25}


def test_a_truncated_turn_gets_the_templates_turn_end_masked(tok):
    t = ChatTranscript(tok, [{"role": "user", "content": "hi"}])
    t.add_completion(turn(tok, "abc", 0, finish="length"), 0, "abc")
    added = t.add_messages([{"role": "user", "content": "more"}])
    assert tok.decode(added) == "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    assert t.loss_mask[-len(added):] == [0] * len(added)


def test_a_template_that_drops_earlier_think_keeps_what_the_policy_saw(tok):
    """Qwen3's rule (and the tiny template's): a new user message drops the <think> part of
    earlier assistant turns from a re-rendering. The transcript keeps the turn as generated."""
    t = ChatTranscript(tok, [{"role": "user", "content": "q1"}])
    text = "<think>hm</think>a1"
    t.add_completion(turn(tok, text, 0), 0, text)
    t.add_messages([{"role": "user", "content": "q2"}])
    t.add_completion(turn(tok, "a2", 1), 1, "a2")
    rerender = encode(tok, render(tok, t.messages, add_generation_prompt=False))
    assert "<think>hm</think>" in tok.decode(t.token_ids)
    assert "<think>" not in tok.decode(rerender)
    assert rerender != t.token_ids[: len(rerender)]


def test_add_messages_needs_an_assistant_turn_first(tok):
    t = ChatTranscript(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(TemplateError, match="add_completion first"):
        t.add_messages([{"role": "user", "content": "x"}])


def test_a_tokenizer_without_a_template_is_named():
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTranscript(build_tokenizer(), [{"role": "user", "content": "hi"}])


def test_a_template_that_renders_the_last_assistant_turn_differently_still_appends(tok):
    """Qwen3's template gives the *last* assistant turn an empty think block, so the probe turn
    renders differently before and after new messages; the delta must not depend on that."""
    import copy

    qwen_like = copy.deepcopy(tok)
    qwen_like.chat_template = tok.chat_template.replace(
        "<|im_start|>assistant\n{{ content }}",
        "<|im_start|>assistant\n{% if loop.last %}<think>{{ '\\n\\n' }}</think>{{ '\\n\\n' }}{% endif %}"
        "{{ content }}")
    assert qwen_like.chat_template != tok.chat_template
    t = ChatTranscript(qwen_like, [{"role": "user", "content": "q"}], TOOLS)
    t.add_completion(turn(qwen_like, "<tool_call>{}</tool_call>", 0), 0, "<tool_call>{}</tool_call>")
    added = t.add_messages([{"role": "tool", "name": "add", "content": "5"}])
    assert qwen_like.decode(added) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
                                       "<|im_end|>\n<|im_start|>assistant\n")
