"""A task with shared structure: words enciphered letter by letter, ``"bdj="`` -> ``"418"``.

Why: on :mod:`astralight.tasks.facts` every answer is an independent random string, so a sample
teaches nothing about any other key; on the toy (:mod:`astralight.tasks.arithmetic`) the warm
start already knows every answer. Here every answer follows one rule -- a seeded substitution
of each letter by a digit, the same at every position and for every word -- and the warm start
saw only a minority of the words, and the cipher of only some of the letters
(:class:`CipherTable`). What RL learns on one word (that ``d`` is ``1``) is right for every
other word that holds that letter, so a system that learns more from each sample shows it here
(``tests/benchmarks/bench_vs_trl.py --task structured``).

Keys are the ``len(letters) ** word_len`` words over ``letters`` (default 16 letters, 3 per
word: 4,096 words, the warm start knowing 8 letters). The eval split is the unseen words (at
most ``eval_size``, in a fixed order); training draws from every word, as a user's prompt set
would.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np

from astralight.tasks.base import Prompt
from astralight.tasks.held_out import (DIGITS, TableSource, build_table_policy,
                                       tiny_vocab_size, write_seen_pairs)

#: the default letters of the words (all in the tiny model's character tokenizer)
LETTERS = "abcdefghijklmnop"


class CipherTable:
    """Every word of ``word_len`` letters over ``letters`` and its cipher: each letter replaced by
    the digit a seeded substitution gives it (distinct digits for the known letters; each
    unknown letter shares the digit of a known one).

    The warm start knows the cipher of only ``known_letters`` of the letters (a seeded choice): its
    examples, the *seen* words, are ``seen_share`` of the words made of known letters alone. Every
    other word is *unseen* (the eval set): a minority of them are made of known letters (the rule
    carries over), most hold a letter the warm start never saw, whose digit RL has to discover --
    once for all the words that hold it.
    """

    def __init__(self, word_len: int = 3, letters: str = LETTERS, known_letters: int = 8,
                 seen_share: float = 0.5, seed: int = 0):
        if word_len < 1:
            raise ValueError(f"word_len: must be >= 1, got {word_len}")
        if len(set(letters)) != len(letters) or len(letters) < 2:
            raise ValueError(f"letters: at least 2 distinct characters, got {letters!r}")
        if not 1 <= known_letters <= min(len(letters), len(DIGITS)):
            raise ValueError(f"known_letters: must be in [1, {min(len(letters), len(DIGITS))}] "
                             f"(each known letter has a digit of its own), got {known_letters}")
        if not 0.0 < seen_share < 1.0:
            raise ValueError(f"seen_share: must be in (0, 1), got {seen_share}")
        self.seed = seed
        rng = np.random.default_rng([seed, 11])
        order = [letters[int(i)] for i in rng.permutation(len(letters))]
        self.known = sorted(order[:known_letters])
        digits = [DIGITS[int(d)] for d in rng.permutation(len(DIGITS))[:known_letters]]
        # the known letters get distinct digits; each unknown one a digit of a known letter: one
        # the warm start was trained to write (it would hardly ever sample a digit it never saw)
        extra = [digits[int(i)]
                 for i in rng.integers(0, known_letters, len(letters) - known_letters)]
        self.cipher = dict(zip(order, digits + extra))
        self.words = ["".join(w) for w in itertools.product(letters, repeat=word_len)]
        known_words = [k for k, w in enumerate(self.words) if set(w) <= set(self.known)]
        n_seen = max(1, int(round(seen_share * len(known_words))))
        seen = {known_words[int(i)] for i in rng.permutation(len(known_words))[:n_seen]}
        self.seen = sorted(seen)
        self.unseen = [int(k) for k in rng.permutation(len(self.words)) if int(k) not in seen]

    @property
    def num_keys(self) -> int:
        return len(self.words)

    def answer(self, key: int) -> str:
        return "".join(self.cipher[c] for c in self.words[key])

    def prompt(self, key: int) -> Prompt:
        text = f"{self.words[key]}="
        return Prompt(prompt_id=text, prompt=text, metadata={"answer": self.answer(key)})

    def write_pairs(self, path: str | Path) -> Path:
        """The seen words as the JSONL :func:`astralight.tasks.sft_warmstart.read_pairs` reads."""
        return write_seen_pairs(self, path)


class CipherSource(TableSource):
    """Prompts of a :class:`CipherTable`.

    Args:
        split: ``"train"`` (an endless seeded stream over every word) or ``"eval"`` (the unseen
            words, at most ``eval_size`` of them, in the table's fixed order).
        word_len, letters, known_letters, seen_share, seed: the table (the warm start must be
            built with the same ones: :func:`build_cipher_policy`).
        eval_size: most eval prompts.
    """

    def __init__(self, split: str = "train", word_len: int = 3, letters: str = LETTERS,
                 known_letters: int = 8, seen_share: float = 0.5, seed: int = 0,
                 eval_size: int = 300):
        super().__init__(split, CipherTable(word_len, letters, known_letters, seen_share, seed),
                         eval_size)


def build_cipher_policy(out_dir: str | Path, word_len: int = 3, letters: str = LETTERS,
                        known_letters: int = 8, seen_share: float = 0.5, seed: int = 0,
                        **sft_kwargs: Any) -> Path:
    """A recipe ``prepare`` function: the tiny model warm-started on the table's seen words
    (:func:`astralight.tasks.sft_warmstart.build_sft_policy`, whose keyword arguments
    ``sft_kwargs`` are: ``sft_steps``, ``lr``, ``label_smoothing``, ``num_threads``...)."""
    table = CipherTable(word_len, letters, known_letters, seen_share, seed)
    return build_table_policy(table, out_dir, seed, **sft_kwargs)


build_cipher_policy.vocab_size = tiny_vocab_size

__all__ = ["CipherTable", "CipherSource", "build_cipher_policy"]
