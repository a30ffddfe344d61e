"""A lower bound on how many tokens a text takes, read from the tokenizer's pipeline without
tokenizing: the OpenAI endpoint refuses a conversation that cannot fit the context before it
pays for tokenizing it (an 8 MiB conversation takes seconds)."""

from __future__ import annotations

import json
import threading
import unicodedata
import weakref
from dataclasses import dataclass
from typing import Any


def fewest_tokens(tokenizer: Any, text: str) -> int:
    """A lower bound on ``len(encode(tokenizer, text))`` that costs no tokenizing: ``len(text)``
    over the most characters one token can stand for (:func:`max_chars_per_token`; the
    normalizer's shrink left out when ``text`` is already in its Unicode normal form), or 0 when
    the tokenizer vouches for no such bound.

    What it is for: refusing a prompt that cannot fit the context before paying for its
    tokenization (an 8 MiB conversation takes seconds to tokenize)."""
    span = _token_span(tokenizer)
    if span is None:
        return 0
    shrink = span.shrink
    if span.normal_form is not None and unicodedata.is_normalized(span.normal_form, text):
        shrink = 1  # the normalizer leaves this text as it is
    return -(-len(text) // (span.covered * shrink))


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token of ``tokenizer`` can stand for, or None when no
    such number is certain (read once per tokenizer object).

    Why it is not simply "the longest vocabulary entry": a tokenizer may drop characters (a
    normalizer that strips accents or control characters, a pre-tokenizer that drops
    whitespace, an added token that swallows the spaces around it), shorten text (Unicode
    composition) or turn a whole unknown word into one ``<unk>`` (WordLevel, WordPiece, a BPE
    that fuses unknowns), so a long text can be few tokens. Only the shapes where every
    character is provably covered are vouched for; anything else gives None, and the caller
    must tokenize to know."""
    span = _token_span(tokenizer)
    return None if span is None else span.covered * span.shrink


@dataclass(frozen=True)
class _TokenSpan:
    """What bounds a tokenizer's tokens from below: one token covers at most ``covered``
    characters of normalized text, and the normalizer shortens text at most ``shrink`` times
    (not at all for text already in ``normal_form``, when it is a Unicode normal form)."""

    covered: int
    shrink: int
    normal_form: str | None


#: per tokenizer object: its :class:`_TokenSpan` (read once: it reads the whole vocabulary)
_SPANS: "weakref.WeakKeyDictionary[Any, _TokenSpan | None]" = weakref.WeakKeyDictionary()
_SPANS_LOCK = threading.Lock()


def _token_span(tokenizer: Any) -> _TokenSpan | None:
    """``tokenizer``'s :class:`_TokenSpan` (None: it vouches for none), cached."""
    with _SPANS_LOCK:
        try:
            return _SPANS[tokenizer]
        except KeyError:
            pass
        except TypeError:  # not weak-referenceable or not hashable: read every time
            return _read_token_span(tokenizer)
    span = _read_token_span(tokenizer)
    with _SPANS_LOCK:
        _SPANS[tokenizer] = span
    return span


def _read_token_span(tokenizer: Any) -> _TokenSpan | None:
    """The :class:`_TokenSpan` of a Hugging Face fast tokenizer, read from its serialized
    pipeline (tokenizer.json); None for anything else or a layout this does not know."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    try:
        return _pipeline_span(json.loads(backend.to_str()))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _pipeline_span(spec: dict) -> _TokenSpan | None:
    """The :class:`_TokenSpan` of a serialized ``tokenizers`` pipeline."""
    normalizer = spec.get("normalizer")
    shrink = _normalizer_shrink(normalizer)
    keeps, per_char = _pre_tokenizer_keeps(spec.get("pre_tokenizer"))
    model = _model_chars_per_token(spec.get("model") or {}, per_char)
    added = spec.get("added_tokens") or []
    if shrink is None or not keeps or model is None or any(
            t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    longest_added = max((len(t.get("content", "")) for t in added), default=1)
    form = (normalizer or {}).get("type")
    return _TokenSpan(max(model, longest_added, 1), shrink,
                      form if form in ("NFC", "NFKC") else None)


#: regexes that match exactly one character, whatever it is: a Split on one of them, isolated,
#: makes every character its own piece (the tiny chat tokenizer's pre-tokenizer)
_ONE_CHAR_REGEXES = frozenset({"[\\s\\S]", "[\\S\\s]", "[\\w\\W]", "[\\W\\w]", "[\\d\\D]",
                               "[\\D\\d]", "(?s).", "(?s:.)"})


def _normalizer_shrink(spec: dict | None) -> int | None:
    """By how much a normalizer can shorten text at most (None: without bound)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        total = 1
        for part in spec.get("normalizers") or []:
            factor = _normalizer_shrink(part)
            if factor is None:
                return None
            total *= factor
        return total
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):
        return 1  # decomposing, lowercasing, prepending never shorten text
    if kind in ("NFC", "NFKC"):
        return 4  # composing: one character from at most 4 (Unicode's longest canonical form)
    if kind == "Replace":
        pattern, content = (spec.get("pattern") or {}).get("String"), spec.get("content") or ""
        if isinstance(pattern, str) and pattern and content:
            return -(-len(pattern) // len(content))
    return None  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled, regex Replace: can drop


def _pre_tokenizer_keeps(spec: dict | None) -> tuple[bool, bool]:
    """``(keeps every character, makes every character its own piece)`` for a pre-tokenizer."""
    if spec is None:
        return True, False
    kind = spec.get("type")
    if kind == "Sequence":
        parts = [_pre_tokenizer_keeps(p) for p in spec.get("pretokenizers") or []]
        return all(k for k, _ in parts), any(c for _, c in parts)
    if kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts"):
        return True, False
    if kind in ("Split", "Punctuation"):
        behavior = str(spec.get("behavior", "Isolated")).lower().replace("_", "")
        if behavior == "removed":
            return False, False
        regex = (spec.get("pattern") or {}).get("Regex")
        per_char = (kind == "Split" and behavior == "isolated" and not spec.get("invert")
                    and regex in _ONE_CHAR_REGEXES)
        return True, per_char
    return False, False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit...


def _model_chars_per_token(spec: dict, per_char: bool) -> int | None:
    """The most characters (of a pre-tokenizer's piece) one token of the model covers."""
    kind = spec.get("type")
    if per_char and kind in ("BPE", "WordLevel", "WordPiece", "Unigram"):
        return 1  # a piece is one character, and every piece is at least one token
    if kind != "BPE":
        return None  # a whole unknown word can be one <unk>
    vocab = spec.get("vocab") or {}
    byte_fallback = spec.get("byte_fallback") and all(
        f"<0x{b:02X}>" in vocab for b in range(256))
    if spec.get("unk_token") is not None and spec.get("fuse_unk") and not byte_fallback:
        return None  # a run of unknown characters becomes one <unk>
    return max((len(piece) for piece in vocab), default=1)
