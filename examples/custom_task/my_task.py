"""A task of your own: a prompt source and a reward, plain classes named by import path.

The dataflow service imports :class:`HeldOutSums` (the recipe's ``dataflow.source`` and
``dataflow.eval.source``); every rollout service imports :class:`DigitCredit` (the ``reward`` of
its workflow). Neither needs a change to astralight: a process finds this module through its
``PYTHONPATH``, which the launcher sets for every component from the recipe's ``pythonpath``
(see ``recipe.yaml`` beside this file); a component started by hand needs
``PYTHONPATH=examples/custom_task`` (the folder holding this file) in its environment.

The prompts keep the toy's format (``"37+45="``), so the toy's warm-started tiny model and
character tokenizer serve them unchanged; what is new is which pairs are held out and how an
answer is scored.
"""

from __future__ import annotations

import numpy as np

from astralight.rewards.base import Reward
from astralight.tasks.base import Prompt, PromptSource


def held_out(a: int, b: int) -> bool:
    """The held-out pairs (a tenth of them): never trained on, the eval set."""
    return (a + 2 * b) % 10 == 0


class HeldOutSums(PromptSource):
    """Prompts ``"a+b="`` with operands in ``[0, max_operand]``; ``metadata["answer"]`` is the
    sum (what the reward reads).

    A source is indexable and deterministic: ``get(i)`` returns prompt ``i`` from ``(seed,
    i)`` alone, so the dataflow only persists a cursor to resume where it stopped, and an eval
    source is the finite list ``get(0) .. get(len(source) - 1)``.

    Args:
        split: ``"train"`` (an endless seeded stream of the pairs not held out) or ``"eval"``
            (the first ``eval_size`` held-out pairs, in a fixed shuffled order).
        max_operand: the largest operand (the toy's model was warm-started on 0..49).
        eval_size: prompts in the eval split.
        seed: seeds the stream and the eval order.
    """

    def __init__(self, split: str = "train", max_operand: int = 49, eval_size: int = 200,
                 seed: int = 0):
        if split not in ("train", "eval"):
            raise ValueError(f"split: must be 'train' or 'eval', got {split!r}")
        if max_operand < 1:
            raise ValueError(f"max_operand: must be >= 1, got {max_operand}")
        self.split, self.max_operand, self.seed = split, max_operand, seed
        pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)
                 if held_out(a, b)]
        order = np.random.default_rng([seed, 1]).permutation(len(pairs))
        self.eval_pairs = [pairs[i] for i in order[:eval_size]]

    def _prompt(self, a: int, b: int) -> Prompt:
        return Prompt(prompt_id=f"{a}+{b}", prompt=f"{a}+{b}=", metadata={"answer": str(a + b)})

    def get(self, index: int) -> Prompt:
        if self.split == "eval":
            if not 0 <= index < len(self.eval_pairs):
                raise IndexError(f"eval prompt {index} out of range [0, {len(self.eval_pairs)})")
            return self._prompt(*self.eval_pairs[index])
        rng = np.random.default_rng([self.seed, 0, index])
        while True:
            a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, size=2))
            if not held_out(a, b):
                return self._prompt(a, b)

    def __len__(self) -> int:
        return len(self.eval_pairs) if self.split == "eval" else 2**62


class DigitCredit(Reward):
    """A graded reward: 1.0 for the exact answer, else ``partial`` times the share of digits
    right in place (counted from the right), 0.0 for anything that is not a number.

    Partial credit gives a group whose samples are all wrong some advantage signal. It stays at
    or below 0.5 because a sample counts as *correct* for pass@k when its reward is above 0.5
    (``astralight.dataflow.evals.CORRECT_THRESHOLD``): only exact answers pass.

    ``cheap = True``: a string compare runs on the RaaS's event loop; a reward that runs code or
    calls a model leaves it False and runs on an executor thread.
    """

    cheap = True

    def __init__(self, partial: float = 0.4, answer_key: str = "answer"):
        if not 0.0 <= partial <= 0.5:
            raise ValueError(f"partial: must be in [0, 0.5] (a reward above 0.5 counts as a "
                             f"correct answer for pass@k), got {partial}")
        self.partial, self.answer_key = partial, answer_key

    def __call__(self, completion: str, metadata: dict) -> float:
        if self.answer_key not in metadata:
            raise KeyError(f"metadata: DigitCredit needs {self.answer_key!r}, got "
                           f"{sorted(metadata)}")
        want, got = str(metadata[self.answer_key]).strip(), completion.strip()
        if got == want:
            return 1.0
        if not got.isdigit():
            return 0.0
        right = sum(x == y for x, y in zip(reversed(got), reversed(want)))
        return self.partial * right / max(len(got), len(want))
