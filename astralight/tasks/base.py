"""Prompt sources: where the dataflow service draws its prompts from.

A source is indexable: ``get(i)`` returns prompt number ``i`` deterministically, so the service
only has to persist a cursor (an integer in SQLite) to resume exactly where it stopped, and an
eval set is simply ``get(0) .. get(len - 1)`` of an eval source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Prompt:
    """One prompt: what the workflow sees (``prompt``) and what the reward needs (``metadata``)."""

    prompt_id: str
    prompt: Any
    metadata: dict = field(default_factory=dict)


class PromptSource:
    """Base class of prompt sources; subclasses implement ``get`` and, if finite, ``__len__``."""

    def get(self, index: int) -> Prompt:
        raise NotImplementedError(f"{type(self).__name__} must implement get(index)")

    def __len__(self) -> int:
        """Number of distinct prompts; infinite (procedural) sources return a very large number."""
        return 2**62


def check_index(index: int, size: int, what: str = "prompt", where: Any = None) -> int:
    """``index`` when it is in ``[0, size)``; else an IndexError naming ``what`` (prompt, game),
    the range and ``where`` (the source's files) when given. Sources count from 0 only: a
    negative index is an error, not a position from the end."""
    if not 0 <= index < size:
        of = f" of {where}" if where is not None else ""
        raise IndexError(f"{what} {index} out of range [0, {size}){of}")
    return index


class DrawnSource(PromptSource):
    """A procedural source built on ``_draw(index, split) -> Prompt`` (seeded by the index):
    ``split="train"`` is the endless stream ``_draw(i, "train")``; ``split="eval"`` the first
    ``eval_size`` *distinct* prompts (by ``prompt_id``) of ``_draw(i, "eval")``, in a fixed order
    (fewer when the space holds fewer: at most ``50 * eval_size`` draws are tried).
    Subclasses set ``split`` and ``eval_size`` and implement ``_draw``."""

    split: str = "train"
    eval_size: int = 0
    _eval_cache: list[Prompt] | None = None

    def _draw(self, index: int, split: str) -> Prompt:
        raise NotImplementedError(f"{type(self).__name__} must implement _draw(index, split)")

    def get(self, index: int) -> Prompt:
        if self.split == "train":
            return self._draw(index, "train")
        cache = self._eval_prompts()
        return cache[check_index(index, len(cache), "eval prompt")]

    def _eval_prompts(self) -> list[Prompt]:
        if self._eval_cache is None:
            seen, cache, i = set(), [], 0
            while len(cache) < self.eval_size and i < 50 * self.eval_size:
                p = self._draw(i, "eval")
                i += 1
                if p.prompt_id not in seen:
                    seen.add(p.prompt_id)
                    cache.append(p)
            self._eval_cache = cache
        return self._eval_cache

    def __len__(self) -> int:
        return len(self._eval_prompts()) if self.split == "eval" else 2**62
