"""Short arithmetic word problems as chat prompts, generated locally, for real chat models.

``"Mia has 38 stickers and gets 47 more. How many stickers does Mia have now?"`` -> ``"85"``.
A prompt is a list of chat messages (an optional system turn, then the user turn: the problem
and the answer instruction), so the workflow renders it with the *model's own* chat template
(:func:`astralight.workflows.base.tokenize_prompt`). The ground truth is ``metadata["answer"]``,
an integer as text, for :class:`~astralight.rewards.math.MathVerifyReward` (the instruction asks
for ``\\boxed{}``).

Problems are drawn from a few templates (addition, subtraction, multiplication by a small
number) over seeded names, objects and operands; a problem is held out for eval iff a hash of
its template and operands falls in ``eval_share``, so the eval accuracy measures a skill, not
memory of the train problems. Difficulty is set by the operand range and the operations: two-digit
sums are what SmolLM2-135M-Instruct gets right sometimes, not always
(``examples/smollm2_math/README.md`` gives the measurement).
"""

from __future__ import annotations

import hashlib

import numpy as np

from astralight.tasks.base import DrawnSource, Prompt

#: the answer instruction appended to every problem (what MathVerifyReward extracts)
INSTRUCTION = "Put the final answer in \\boxed{}."
NAMES = ("Mia", "Tom", "Ana", "Leo", "Sara", "Ben", "Ivy", "Sam", "Nora", "Max", "Zoe", "Eli")
OBJECTS = ("apples", "stickers", "marbles", "books", "coins", "pencils", "cards", "shells")
#: (operator, template); {n}: a name, {o}: an object, {a} {b}: the operands
TEMPLATES = (
    ("+", "{n} has {a} {o} and gets {b} more. How many {o} does {n} have now?"),
    ("+", "A box holds {a} {o}. Another box holds {b} {o}. How many {o} are there in total?"),
    ("-", "{n} had {a} {o} and gave away {b}. How many {o} does {n} have left?"),
    ("-", "There were {a} {o} on a shelf. {n} took {b} of them. How many {o} are on the shelf now?"),
    ("*", "{n} buys {b} bags with {a} {o} in each bag. How many {o} does {n} buy?"),
)
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _held_out(template: int, a: int, b: int, eval_share: float) -> bool:
    digest = hashlib.sha256(f"wp{template}:{a}:{b}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < eval_share


class WordProblemSource(DrawnSource):
    """Word problems as chat prompts (module docstring).

    Args:
        split: ``"train"`` (an endless seeded stream) or ``"eval"`` (``eval_size`` distinct
            held-out problems in a fixed order).
        ops: which operations to draw, from ``+-*`` (``*`` multiplies by 2..``max_factor``).
        min_operand, max_operand: the range of ``a`` and ``b`` (for ``-``, ``b <= a``).
        max_factor: the largest multiplier of ``*`` problems.
        system_prompt: a system turn first (None: none, the chat template's default applies).
        instruction: appended to the problem in the user turn.
        eval_share: the share of all problems held out for eval.
        seed: prompt ``i`` depends only on ``(seed, split, i)``.
    """

    def __init__(self, split: str = "train", ops: str = "+-", min_operand: int = 10,
                 max_operand: int = 99, max_factor: int = 9, system_prompt: str | None = None,
                 instruction: str = INSTRUCTION, eval_share: float = 0.1, eval_size: int = 100,
                 seed: int = 0):
        if split not in ("train", "eval"):
            raise ValueError(f"split: must be 'train' or 'eval', got {split!r}")
        if not ops or any(op not in _APPLY for op in ops):
            raise ValueError(f"ops: must be made of {''.join(_APPLY)}, got {ops!r}")
        if not 0 <= min_operand <= max_operand:
            raise ValueError(f"min_operand/max_operand: need 0 <= min_operand <= max_operand, "
                             f"got {min_operand}, {max_operand}")
        if max_factor < 2:
            raise ValueError(f"max_factor: must be >= 2, got {max_factor}")
        if not 0.0 < eval_share < 1.0:
            raise ValueError(f"eval_share: must be in (0, 1), got {eval_share}")
        if eval_size < 1:
            raise ValueError(f"eval_size: must be >= 1, got {eval_size}")
        self.split, self.ops, self.seed = split, ops, seed
        self.min_operand, self.max_operand, self.max_factor = min_operand, max_operand, max_factor
        self.system_prompt, self.instruction = system_prompt, instruction
        self.eval_share, self.eval_size = eval_share, eval_size
        self.templates = [i for i, (op, _) in enumerate(TEMPLATES) if op in ops]

    def _draw(self, index: int, split: str) -> Prompt:
        rng = np.random.default_rng([self.seed, 1 if split == "eval" else 0, index])
        while True:
            t = self.templates[int(rng.integers(len(self.templates)))]
            op, text = TEMPLATES[t]
            a = int(rng.integers(self.min_operand, self.max_operand + 1))
            if op == "*":
                b = int(rng.integers(2, self.max_factor + 1))
            elif op == "-":
                b = int(rng.integers(min(self.min_operand, a), a + 1))
            else:
                b = int(rng.integers(self.min_operand, self.max_operand + 1))
            name = NAMES[int(rng.integers(len(NAMES)))]
            obj = OBJECTS[int(rng.integers(len(OBJECTS)))]
            if _held_out(t, a, b, self.eval_share) != (split == "eval"):
                continue
            problem = text.format(n=name, o=obj, a=a, b=b)
            user = f"{problem} {self.instruction}".strip()
            messages = ([{"role": "system", "content": self.system_prompt}]
                        if self.system_prompt else []) + [{"role": "user", "content": user}]
            return Prompt(prompt_id=f"wp{t}:{a}{op}{b}", prompt=messages,
                          metadata={"answer": str(_APPLY[op](a, b)), "problem": problem})


__all__ = ["WordProblemSource", "INSTRUCTION"]
