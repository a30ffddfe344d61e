"""Reward functions: plain callables ``reward(completion_text, metadata) -> float``."""

from __future__ import annotations


class Reward:
    """Base class: score one completion against the prompt's metadata (e.g. its answer)."""

    def __call__(self, completion: str, metadata: dict) -> float:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")
