"""Reward functions: plain callables ``reward(completion_text, metadata) -> float``."""

from __future__ import annotations


class Reward:
    """Base class: score one completion against the prompt's metadata (e.g. its answer).

    ``cheap``: True for a reward that is a quick pure-Python check; workflows then call it on
    the event loop. False (the default) runs it on an executor thread, so a reward that runs
    code, a verifier or a subprocess never blocks the other episodes.
    """

    cheap: bool = False

    def __call__(self, completion: str, metadata: dict) -> float:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")
