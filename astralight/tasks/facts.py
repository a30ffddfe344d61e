"""A discovery task: arbitrary facts ``"f042="`` -> ``"7"``, most of which the warm start never saw.

Why: the toy (:mod:`astralight.tasks.arithmetic`) is a *sharpening* task -- its warm start knows
every answer and RL only raises how often it samples it. Here the answer of a key is a seeded
random string, so nothing generalises from one key to another: the warm start is trained on a
minority of the keys (``seen_share``), and the rest can only be found by sampling at temperature
1.0 and being rewarded (exact match). How fast a system finds them is its time-to-accuracy in
the discovery regime (``tests/benchmarks/bench_vs_trl.py``).

The eval split is the unseen keys, in a fixed order: what RL has to discover. Training draws
from every key (seen and unseen), as a user's prompt set would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from astralight.tasks.base import Prompt
from astralight.tasks.held_out import (DIGITS, TableSource, build_table_policy,
                                       tiny_vocab_size, write_seen_pairs)



class FactTable:
    """The facts: ``num_keys`` keys, each with a seeded random answer of ``answer_len``
    characters of ``alphabet``; the first ``seen_share`` of a seeded permutation are *seen* (the
    warm start's examples), the others *unseen* (the eval set)."""

    def __init__(self, num_keys: int = 200, seen_share: float = 0.25, answer_len: int = 1,
                 alphabet: str = DIGITS, seed: int = 0):
        if num_keys < 2:
            raise ValueError(f"num_keys: must be >= 2, got {num_keys}")
        if not 0.0 <= seen_share < 1.0:
            raise ValueError(f"seen_share: must be in [0, 1), got {seen_share}")
        if answer_len < 1:
            raise ValueError(f"answer_len: must be >= 1, got {answer_len}")
        if len(set(alphabet)) < 2:
            raise ValueError(f"alphabet: needs at least two distinct characters, got {alphabet!r}")
        self.num_keys, self.seed = num_keys, seed
        rng = np.random.default_rng([seed, 7])
        picks = rng.integers(0, len(alphabet), size=(num_keys, answer_len))
        self.answers = ["".join(alphabet[i] for i in row) for row in picks]
        order = rng.permutation(num_keys)
        n_seen = int(round(seen_share * num_keys))
        self.seen = sorted(int(k) for k in order[:n_seen])
        self.unseen = [int(k) for k in order[n_seen:]]
        self.width = len(str(num_keys - 1))

    def prompt(self, key: int) -> Prompt:
        text = f"f{key:0{self.width}d}="
        return Prompt(prompt_id=text, prompt=text, metadata={"answer": self.answers[key]})

    def write_pairs(self, path: str | Path) -> Path:
        """The seen facts as the JSONL :func:`astralight.tasks.sft_warmstart.read_pairs` reads."""
        return write_seen_pairs(self, path)


class FactSource(TableSource):
    """Prompts of a :class:`FactTable`.

    Args:
        split: ``"train"`` (an endless seeded stream over every key) or ``"eval"`` (the unseen
            keys, at most ``eval_size`` of them, in the table's fixed order).
        num_keys, seen_share, answer_len, alphabet, seed: the table (the warm start must be
            built with the same ones: :func:`build_facts_policy`).
        eval_size: most eval prompts.
    """

    def __init__(self, split: str = "train", num_keys: int = 200, seen_share: float = 0.25,
                 answer_len: int = 1, alphabet: str = DIGITS, seed: int = 0,
                 eval_size: int = 1000):
        super().__init__(split, FactTable(num_keys, seen_share, answer_len, alphabet, seed),
                         eval_size)


def build_facts_policy(out_dir: str | Path, num_keys: int = 200, seen_share: float = 0.25,
                       answer_len: int = 1, alphabet: str = DIGITS, seed: int = 0,
                       **sft_kwargs: Any) -> Path:
    """A recipe ``prepare`` function: the tiny model warm-started on the table's seen facts
    (:func:`astralight.tasks.sft_warmstart.build_sft_policy`, whose keyword arguments
    ``sft_kwargs`` are: ``sft_steps``, ``lr``, ``spec``, ``num_threads``...)."""
    table = FactTable(num_keys, seen_share, answer_len, alphabet, seed)
    if not table.seen:
        raise ValueError("seen_share: the warm start needs at least one seen fact (raise it)")
    return build_table_policy(table, out_dir, seed, **sft_kwargs)


build_facts_policy.vocab_size = tiny_vocab_size

__all__ = ["FactTable", "FactSource", "build_facts_policy"]
