"""Multi-turn environment episodes on a chat template: observation (user) -> action (assistant).

The chat-template counterpart of :class:`~astralight.workflows.multi_turn.MultiTurnWorkflow`,
laid out like :class:`~astralight.workflows.tool_agent.ToolAgentWorkflow`: each episode is one
:class:`~astralight.agents.chat.ChatTranscript`. The environment's first observation (its
``reset(task)``) is the first user message (after ``system_prompt``); every assistant turn is
generated and kept token-exact (trained: loss mask 1, behaviour log-probs, per-token versions);
its text (stop token and a leading ``<think>...</think>`` left out) is the action for
``env.step``, and the observation that comes back is the next user message, as the template
renders it (masked: loss mask 0, version -1).

With ``tools``, a turn that calls tools (``<tool_call>{json}</tool_call>``, parsed by
:func:`~astralight.agents.tools.parse_tool_calls`) does not act on the environment: the tools run
(:class:`~astralight.agents.tools.ToolBox`, failures become error results) and their results are
the next (masked) messages; the next turn without a call is the next action. Without tools every
turn is an action, whatever it contains.

An episode ends when the environment says done (``end: done``), after ``max_turns`` assistant
turns (``max_turns``; tool turns count), or when ``max_total_tokens`` (or the engine's
``max_model_len``) leaves no room (``token_budget``). Its reward is the sum of its step rewards.

Sample metadata: ``turns`` (assistant turns), ``actions`` (the commands sent, in order),
``step_rewards``, ``end``, ``temperature``, ``tool_calls`` and ``tool_errors`` (as the tool
agent's, so the trainer and the dataflow count them), and ``env``: what the environment's
optional ``metrics()`` returns at the end (e.g. TextWorld's ``won``, ``score``,
``invalid_actions``). Environments are plugins by import path (``environment`` +
``environment_kwargs``), one instance per episode; ``reset``, ``step`` and the optional
``close()`` run through :func:`~astralight.workflows.base.blocking`, so a slow game never holds
another episode.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from astralight.agents.chat import ChatTranscript
from astralight.agents.stats import ToolStats
from astralight.agents.tools import parse_tool_calls
from astralight.engine import SamplingSpec
from astralight.protocol import Task
from astralight.workflows.base import blocking
from astralight.workflows.chat_episodes import ChatEpisodeWorkflow
from astralight.workflows.multi_turn import Environment, _resolve

log = logging.getLogger(__name__)

_THINK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)


def first_messages(system_prompt: str, observation: str) -> list[dict]:
    """An episode's prompt: the system message (if any) and the first observation as the user
    message (what a warm start's scripted conversations must begin with too)."""
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return head + [{"role": "user", "content": observation}]


def action_text(text: str) -> str:
    """The action in an assistant turn: its text without a leading ``<think>...</think>``."""
    return _THINK.sub("", text, count=1).strip()


class ChatEnvWorkflow(ChatEpisodeWorkflow):
    """Chat episodes with an environment (``Task.workflow == "chat_env"``).

    Args:
        environment: import path (or class / factory) of an
            :class:`~astralight.workflows.multi_turn.Environment`, built once per episode with
            ``environment_kwargs``.
        tools: optional tools, as for the tool agent (import paths or ``{class_path, ...}``).
        sampling / eval_sampling: per-turn sampling for train / eval tasks; a turn's
            ``max_tokens`` is cut to what the token budget leaves.
        max_turns: most assistant turns per episode (actions and tool turns).
        max_total_tokens: most tokens per episode (prompt, turns, observations, tool results).
        system_prompt: the system message before the first observation ("" for none).
        chat_template_kwargs: extra variables for the chat template (``enable_thinking``...).
        chat_template: render with this template instead of the tokenizer's: a shipped name
            (``chatml_tools``: ChatML with a Hermes-style tools section, for models whose own
            template has none), a ``.jinja`` path or the template text
            (:mod:`astralight.agents.chat_templates`). A template that leaves the tools out of
            the prompt is refused at the first episode.
        max_result_chars: a longer tool result is cut.
        role: the samples' role tag.
    """

    name = "chat_env"

    def __init__(self, environment: str | type | Callable[..., Environment],
                 environment_kwargs: dict | None = None, tools: list[Any] | None = None,
                 sampling: SamplingSpec | None = None, eval_sampling: SamplingSpec | None = None,
                 max_turns: int = 8, max_total_tokens: int = 4096, system_prompt: str = "",
                 chat_template_kwargs: dict | None = None, max_result_chars: int = 2000,
                 role: str = "", chat_template: str | None = None):
        super().__init__(tools, sampling, eval_sampling, max_turns, max_total_tokens,
                         system_prompt, chat_template_kwargs, max_result_chars, role,
                         chat_template)
        self.factory = _resolve(environment)
        self.environment_kwargs = dict(environment_kwargs or {})

    async def play(self, task: Task, engine: Any, slot: int) -> tuple[ChatTranscript, float, dict]:
        """One episode; returns its transcript, reward and metadata."""
        env = await blocking(self.factory, **self.environment_kwargs)
        try:
            return await self._play(task, engine, slot, env)
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                await blocking(close)

    async def _play(self, task: Task, engine: Any, slot: int,
                    env: Environment) -> tuple[ChatTranscript, float, dict]:
        first = await blocking(env.reset, task)
        if not isinstance(first, str):
            raise TypeError(f"environment: {type(env).__name__}.reset must return the first "
                            f"observation as text, got {type(first).__name__}")
        transcript = self.transcript(engine, first_messages(self.system_prompt, first))
        limit = self.token_limit(engine)
        stats, end, turns = ToolStats(), "", 0
        actions: list[str] = []
        rewards: list[float] = []
        for turn in range(self.max_turns):
            text = await self.next_turn(transcript, engine, task, slot, turn, limit)
            if text is None:
                end = "token_budget"
                break
            turns += 1
            calls = parse_tool_calls(text) if self.toolbox.tools else []
            last = turn + 1 == self.max_turns
            if calls:
                if last:
                    end = "max_turns"  # no turn is left to read the results
                    break
                await self.run_tools(calls, transcript, stats)
                continue
            action = action_text(text)
            actions.append(action)
            observation, reward, done = await blocking(env.step, action)
            rewards.append(float(reward))
            if done:
                end = "done"
                break
            if last:
                end = "max_turns"  # the last observation would never be acted on
                break
            transcript.add_messages([{"role": "user", "content": str(observation)}])
        end = end or "max_turns"
        metrics = getattr(env, "metrics", None)
        meta = {"turns": turns, "actions": actions, "step_rewards": rewards, "end": end,
                "temperature": float(self.sampling_for(task).temperature), **stats.as_metadata(),
                "env": dict(metrics()) if callable(metrics) else {}}
        return transcript, float(sum(rewards)), meta
