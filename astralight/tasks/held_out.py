"""What the bench tasks with a held-out eval set share: a *table* of keys split into the ones the
warm start saw and the unseen ones, a prompt source over it, and the warm start on the seen keys.

A table (:class:`~astralight.tasks.facts.FactTable`, :class:`~astralight.tasks.cipher.CipherTable`)
has ``seed``, ``num_keys``, ``seen`` and ``unseen`` (key lists) and ``prompt(key)``, a
:class:`~astralight.tasks.base.Prompt` whose ``metadata["answer"]`` is the key's answer.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from astralight.tasks.base import Prompt, PromptSource

#: characters an answer is drawn from (all in the tiny model's character tokenizer)
DIGITS = "0123456789"


class TableSource(PromptSource):
    """Prompts of a table: ``split="train"`` is an endless seeded stream over every key (seen and
    unseen, as a user's prompt set would be); ``split="eval"`` the unseen keys, at most
    ``eval_size`` of them, in the table's fixed order (what RL has to learn)."""

    def __init__(self, split: str, table: Any, eval_size: int):
        if split not in ("train", "eval"):
            raise ValueError(f"split: must be 'train' or 'eval', got {split!r}")
        self.split = split
        self.table = table
        self.eval_keys = table.unseen[:eval_size]

    def get(self, index: int) -> Prompt:
        if self.split == "eval":
            if not 0 <= index < len(self.eval_keys):
                raise IndexError(f"eval prompt {index} out of range [0, {len(self.eval_keys)})")
            return self.table.prompt(self.eval_keys[index])
        rng = np.random.default_rng([self.table.seed, 0, index])
        return self.table.prompt(int(rng.integers(self.table.num_keys)))

    def __len__(self) -> int:
        return len(self.eval_keys) if self.split == "eval" else 2**62


def write_seen_pairs(table: Any, path: str | Path) -> Path:
    """The table's seen keys as the JSONL :func:`astralight.tasks.sft_warmstart.read_pairs`
    reads (``{"prompt", "target"}`` a line)."""
    path = Path(path)
    lines = []
    for k in table.seen:
        p = table.prompt(k)
        lines.append(json.dumps({"prompt": p.prompt, "target": p.metadata["answer"]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def build_table_policy(table: Any, out_dir: str | Path, seed: int, **sft_kwargs: Any) -> Path:
    """The tiny model warm-started on the table's seen keys
    (:func:`astralight.tasks.sft_warmstart.build_sft_policy` with ``sft_kwargs``)."""
    from astralight.tasks.sft_warmstart import build_sft_policy

    with tempfile.TemporaryDirectory() as tmp:
        data = write_seen_pairs(table, Path(tmp) / "seen.jsonl")
        return build_sft_policy(out_dir, data, seed=seed, **sft_kwargs)


def tiny_vocab_size(spec: Any = None, **_: Any) -> int:
    """The vocabulary of the model :func:`build_table_policy` builds (a prepare function's
    ``vocab_size``, read by :func:`astralight.launch.prepared_vocab_size`)."""
    from astralight.tasks.sft_warmstart import build_sft_policy

    return build_sft_policy.vocab_size(spec=spec)


__all__ = ["DIGITS", "TableSource", "write_seen_pairs", "build_table_policy", "tiny_vocab_size"]
