"""``add_special_tokens=True`` puts the tokenizer's BOS first when its post-processor adds none
(the tiny tokenizer defines ``<bos>`` but adds nothing; a user had to write ``<s>`` into the
prompt text)."""

from __future__ import annotations

from astralight.trainer.tinymodel import build_tokenizer
from astralight.workflows.base import tokenize_prompt


def test_bos_is_added_once_when_asked():
    tok = build_tokenizer()
    plain = tokenize_prompt(tok, "12+3=")
    assert tok.bos_token_id is not None and plain[0] != tok.bos_token_id
    with_bos = tokenize_prompt(tok, "12+3=", add_special_tokens=True)
    assert with_bos == [tok.bos_token_id] + plain
    # a prompt that already starts with it gets no second one
    assert tokenize_prompt(tok, "<bos>12+3=", add_special_tokens=True).count(tok.bos_token_id) == 1
    # token-id prompts are taken as they are
    assert tokenize_prompt(tok, plain, add_special_tokens=True) == plain


def test_a_tokenizer_without_bos_is_left_alone():
    tok = build_tokenizer()
    tok.bos_token = None
    assert tokenize_prompt(tok, "12+3=", add_special_tokens=True) == tokenize_prompt(tok, "12+3=")
