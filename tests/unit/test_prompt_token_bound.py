"""The cheap lower bound on a text's token count (``astralight.agents.token_bound.fewest_tokens``)
that lets the OpenAI endpoint refuse a conversation that cannot fit the context before it pays
for tokenizing it (issue 41, item 2).

It must never refuse what fits, so it is checked against the real tokenization of adversarial
texts (combining marks that NFC composes, Hangul jamo, emoji, long runs, special-token text) for
the tokenizer shapes it vouches for, and it must give up (None) for the shapes where a long text
can be a handful of tokens.
"""

from __future__ import annotations

import random

import pytest

from astralight.agents.chat import encode
from astralight.agents.token_bound import fewest_tokens, max_chars_per_token
from astralight.trainer.tinymodel import build_chat_tokenizer, build_tokenizer


def _fast(backend, **kwargs):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   **kwargs)


def byte_level_bpe(normalizer=None):
    """A small byte-level BPE (Qwen's and GPT's shape), trained here on text with long runs so
    that some of its tokens are long, with an NFC normalizer (Qwen2's) by default."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizer if normalizer is not None else normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = ["hello world, the tokenizer " * 20, "a" * 200, " " * 120, "0123456789" * 30] * 4
    bpe.train_from_iterator(corpus, trainer)
    return _fast(bpe, eos_token="<|im_end|>")


def adversarial_texts(seed: int = 0, n: int = 60) -> list[str]:
    """Texts built to be few tokens per character: long runs a token may cover, combining
    sequences NFC composes (up to 4 code points into one), Hangul jamo (3 into one syllable),
    emoji, newlines, special-token text."""
    rng = random.Random(seed)
    pieces = ["a" * 200, " " * 120, "\n" * 50, "hello world, ", "0123456789" * 3,
              "e\u0301", "\u03b1\u0313\u0300\u0345", "\u1100\u1161\u11a8", "\U0001f600",
              "<|im_end|>", "</tool_response>", "<tool_call>", "x", "\u00e9"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.mark.parametrize("build", [build_chat_tokenizer, byte_level_bpe], ids=["chat", "bpe"])
def test_the_bound_never_exceeds_the_real_token_count(build):
    tok = build()
    assert max_chars_per_token(tok) is not None
    vocab = tok.get_vocab()
    longest = max(vocab, key=len)  # the text that makes the fewest tokens per character
    runs = [tok.decode([vocab[longest]]) * k for k in (1, 7, 10)]
    for text in adversarial_texts(n=200) + runs:
        assert fewest_tokens(tok, text) <= len(encode(tok, text)), repr(text[:80])


def test_what_each_vouched_shape_gives():
    # the chat tokenizer: one token per character, or an added token (16 at most)
    assert max_chars_per_token(build_chat_tokenizer()) == len("</tool_response>") == 16
    # a byte-level BPE: its longest vocabulary entry, times 4 for what NFC can compose...
    bpe = byte_level_bpe()
    longest = max(len(piece) for piece in bpe.backend_tokenizer.get_vocab(with_added_tokens=False))
    assert longest > 16 and max_chars_per_token(bpe) == 4 * longest
    assert fewest_tokens(bpe, "e\u0301" * (longest * 10)) == 5  # composes: 20 x longest chars
    # ... but text already in NFC is not shortened by it
    assert fewest_tokens(bpe, "a" * (longest * 10)) == 10


def test_shapes_where_a_long_text_can_be_few_tokens_give_no_bound():
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    # the tiny text tokenizer splits on '.', which misses newlines: a run of them is one <unk>
    tiny = build_tokenizer()
    assert len(encode(tiny, "\n" * 1000)) == 1
    assert max_chars_per_token(tiny) is None and fewest_tokens(tiny, "\n" * 1000) == 0
    # a whole unknown word is one <unk> (WordLevel behind a whitespace split drops the spaces)
    words = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    assert max_chars_per_token(_fast(words, unk_token="<unk>")) is None
    # a normalizer that drops characters (combining marks)
    stripped = byte_level_bpe(normalizers.Sequence([normalizers.NFD(),
                                                    normalizers.StripAccents()]))
    assert len(encode(stripped, "a" + "\u0301" * 1000)) == 1
    assert max_chars_per_token(stripped) is None
    # an added token that swallows the whitespace around it
    swallowing = byte_level_bpe()
    swallowing.add_tokens([AddedToken("<mask>", lstrip=True)])
    assert max_chars_per_token(swallowing) is None
    # a tokenizer without a readable pipeline (a slow tokenizer, a stand-in)
    assert max_chars_per_token(object()) is None and fewest_tokens(object(), "x" * 99) == 0
