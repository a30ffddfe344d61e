"""An agent's episode on the OpenAI endpoint: how its calls are sampled (:class:`EpisodeSettings`),
its live state (:class:`Episode`) and what each served call leaves behind (:class:`CallRecord`,
the exact token ids, behaviour log-probs and policy versions the trainer learns from)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from astralight.engine import SamplingSpec

__all__ = ["CallRecord", "EpisodeSettings", "Episode"]


@dataclass
class CallRecord:
    """One served call, exactly as the policy saw and produced it.

    ``prompt_ids`` is the chat template's rendering of the request (generation prompt included);
    ``completion_ids`` / ``logprobs`` / ``versions`` are the engine's tokens (the stop token
    included), their behaviour log-probs and the policy version that sampled each;
    ``version`` is the engine's version when the call was submitted. ``tool_calls`` are those
    returned to the agent (OpenAI schema); ``tool_call_errors`` counts blocks that could not be
    read (``malformed``) or name a tool the request did not declare (``unknown_tool``).
    """

    index: int
    model_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    version: int
    messages: list[dict]
    tools: list[dict]
    text: str
    content: str | None
    tool_calls: list[dict]
    tool_call_errors: dict[str, int]
    temperature: float
    #: how the decoding was constrained: ``json_schema``, ``json_object`` (``response_format``)
    #: or ``tool_calls`` (``tool_choice`` required or named); None when it was not
    constrained: str | None = None


@dataclass
class EpisodeSettings:
    """How an episode's calls are sampled.

    Args:
        sampling: defaults for what a request leaves unset (temperature, top_p, max_tokens,
            seed); with a seed, call ``i`` of the episode is seeded
            ``sampling.for_request(seed_slot + i * seed_stride, seed_key)``.
        force_sampling: the sampling's temperature, top_p and seed replace the request's (an
            agent written for greedy evaluation still explores during training, and a seed it
            hard-codes does not make every episode of a group the same).
        max_calls: most calls per episode; the next one is a 400 naming ``messages``.
        chat_template_kwargs: extra chat template variables (``enable_thinking``...).
        max_context_tokens: most prompt + completion tokens per call (the engine's
            ``max_model_len`` bounds it too).
    """

    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    force_sampling: bool = False
    max_calls: int = 16
    chat_template_kwargs: dict = field(default_factory=dict)
    max_context_tokens: int | None = None
    seed_key: str = ""
    seed_slot: int = 0
    seed_stride: int = 1


class Episode:
    """One agent run's view of the endpoint: its engines, loop, settings and records.

    ``model_id`` / ``engine`` are the episode's own policy (the ``model`` its agent is handed);
    ``engines`` maps every model the episode may call, by ``model`` name, to its engine: the own
    policy, and for an agent team the teammates' policies and frozen models
    (:class:`~astralight.workflows.openai_agent.OpenAIAgentWorkflow`'s ``team``). Each call is
    served by the engine its request names, and recorded under that ``model_id``.
    """

    def __init__(self, episode_id: str, model_id: str, engine: Any,
                 loop: asyncio.AbstractEventLoop, settings: EpisodeSettings, key: str = "",
                 others: dict[str, Any] | None = None):
        self.id, self.model_id, self.engine, self.loop = episode_id, model_id, engine, loop
        self.engines: dict[str, Any] = {model_id: engine, **(others or {})}
        #: the episode's own api key: it chooses the episode on the key-routed paths, and a
        #: call with it on another episode's path is refused
        self.key = key
        self.settings = settings
        self.calls: list[CallRecord] = []  # appended on ``loop`` only
        self.started = 0  # calls admitted (the next call's index)
        self.refused = 0  # calls answered with an error
        self.closed = False
        self.pending: set[concurrent.futures.Future] = set()
        #: Responses API ids -> their conversation (input and output), for previous_response_id
        self.responses: dict[str, list[dict]] = {}
