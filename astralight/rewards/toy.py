"""Verifiable rewards for the synthetic toy tasks."""

from __future__ import annotations

from astralight.rewards.base import Reward


class ExactMatchReward(Reward):
    """1.0 if the completion (whitespace stripped) equals ``metadata[answer_key]``, else 0.0."""

    cheap = True  # a string compare: run it on the event loop, not an executor thread

    def __init__(self, answer_key: str = "answer"):
        self.answer_key = answer_key

    def __call__(self, completion: str, metadata: dict) -> float:
        if self.answer_key not in metadata:
            raise KeyError(f"metadata: the reward needs {self.answer_key!r}, got {sorted(metadata)}")
        return 1.0 if completion.strip() == str(metadata[self.answer_key]).strip() else 0.0
