"""Synthetic arithmetic prompts for the toy recipe: ``"37+45="`` -> ``"82"``.

Operand pairs are split deterministically into train and held-out eval sets (a pair is held out
iff a hash of it falls in the eval share), so the eval accuracy measures a skill, not memory.
"""

from __future__ import annotations

import hashlib

import numpy as np

from astralight.tasks.base import DrawnSource, Prompt

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _is_eval_pair(a: int, b: int, op: str, eval_share: float) -> bool:
    digest = hashlib.sha256(f"{a}{op}{b}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < eval_share


class ArithmeticSource(DrawnSource):
    """Prompts ``a<op>b=`` with operands in ``[min_operand, max_operand]``.

    The default range 0..49 is the toy recipe's: 2,250 train pairs are enough for the tiny model
    to learn addition that transfers to the ~250 held-out pairs (with 0..29 the held-out greedy
    accuracy of the warm-started model stalled at 90-97%, which capped RL below the target);
    0..99 needs several times more warm-start steps.

    Args:
        split: ``"train"`` (an endless seeded stream) or ``"eval"`` (a fixed list of
            ``eval_size`` held-out prompts).
        ops: the operators to draw from, e.g. ``"+"`` or ``"+-"``.
        eval_share: fraction of all operand pairs that belong to the held-out set.
        seed: seeds the stream; prompt ``i`` depends only on ``(seed, split, i)``.

    The eval set may hold fewer distinct prompts than ``eval_size`` when the range is small.
    """

    def __init__(self, split: str = "train", min_operand: int = 0, max_operand: int = 49,
                 ops: str = "+", eval_share: float = 0.1, eval_size: int = 200, seed: int = 0):
        if split not in ("train", "eval"):
            raise ValueError(f"split: must be 'train' or 'eval', got {split!r}")
        if not ops or any(op not in _OPS for op in ops):
            raise ValueError(f"ops: must be made of {''.join(_OPS)}, got {ops!r}")
        if not 0 <= min_operand <= max_operand:
            raise ValueError("min_operand/max_operand: need 0 <= min_operand <= max_operand")
        if not 0.0 < eval_share < 1.0:
            raise ValueError(f"eval_share: must be in (0, 1), got {eval_share}")
        self.split, self.ops, self.eval_share, self.seed = split, ops, eval_share, seed
        self.min_operand, self.max_operand = min_operand, max_operand
        self.eval_size = eval_size
        self._eval_cache: list[Prompt] | None = None

    def _draw(self, index: int, split: str) -> Prompt:
        salt = 1 if split == "eval" else 0
        rng = np.random.default_rng([self.seed, salt, index])
        while True:
            a, b = (int(x) for x in rng.integers(self.min_operand, self.max_operand + 1, size=2))
            op = self.ops[int(rng.integers(len(self.ops)))]
            if _is_eval_pair(a, b, op, self.eval_share) == (split == "eval"):
                return Prompt(prompt_id=f"{a}{op}{b}", prompt=f"{a}{op}{b}=",
                              metadata={"answer": str(_OPS[op](a, b))})
