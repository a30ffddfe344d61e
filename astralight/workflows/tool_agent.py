"""Tool-calling agent workflow: chat turns through the model's template, tools run between them.

Each episode is one :class:`~astralight.agents.chat.ChatTranscript`: the task's messages (a text
prompt becomes one user message, after ``system_prompt``), then assistant turns exactly as
generated (trained) and tool results as the template renders them (masked). A turn that calls
tools (``<tool_call>{json}</tool_call>``, Qwen3/Hermes) gets their results as tool messages and
another turn; the first turn without a call is the answer, scored by ``reward`` against
``task.metadata``. An episode also ends at ``max_turns`` assistant turns or when
``max_total_tokens`` (or the engine's ``max_model_len``) leaves no room; it is then scored on its
last turn's text (a reward usually finds no answer there).

Every sample's metadata says ``turns``, ``tool_calls``, ``tool_errors`` (per kind of
:data:`astralight.agents.tools.ERROR_KINDS`) and ``end`` (``answer`` | ``max_turns`` |
``token_budget``); the trainer logs them as ``agent/*`` scalars and the dataflow counts them per
version for the balance report.
"""

from __future__ import annotations

from typing import Any

from astralight.agents.chat import ChatTranscript
from astralight.agents.stats import ToolStats
from astralight.agents.tools import parse_tool_calls
from astralight.engine import SamplingSpec
from astralight.protocol import Task
from astralight.rewards.base import Reward
from astralight.workflows.base import blocking
from astralight.workflows.chat_episodes import ChatEpisodeWorkflow, task_messages


class ToolAgentWorkflow(ChatEpisodeWorkflow):
    """Episodes of a tool-calling agent (``Task.workflow == "tool_agent"``).

    Args:
        tools: import paths of functions or callable classes, or ``{class_path, init_args,
            name, timeout_s}`` entries (see :mod:`astralight.agents.tools`).
        reward: scores the answer text against ``task.metadata``.
        sampling / eval_sampling: per-turn sampling for train / eval tasks; a turn's
            ``max_tokens`` is cut to what the token budget leaves.
        max_turns: most assistant turns per episode.
        max_total_tokens: most tokens per episode (prompt, turns and tool results).
        system_prompt: the system message for text prompts ("" for none).
        chat_template_kwargs: extra variables for the chat template (``enable_thinking``...).
        chat_template: render with this template instead of the tokenizer's: a shipped name
            (``chatml_tools``: ChatML with a Hermes-style tools section, for models whose own
            template has none), a ``.jinja`` path or the template text
            (:mod:`astralight.agents.chat_templates`). A template that leaves the tools out of
            the prompt is refused at the first episode.
        max_result_chars: a longer tool result is cut.
        role: the samples' role tag.
    """

    name = "tool_agent"

    def __init__(self, tools: list[Any], reward: Reward, sampling: SamplingSpec | None = None,
                 eval_sampling: SamplingSpec | None = None, max_turns: int = 4,
                 max_total_tokens: int = 4096, system_prompt: str = "",
                 chat_template_kwargs: dict | None = None, max_result_chars: int = 2000,
                 role: str = "", chat_template: str | None = None):
        if not callable(reward):
            raise TypeError(f"reward: expected a Reward, got {type(reward).__name__}")
        super().__init__(tools, sampling, eval_sampling, max_turns, max_total_tokens,
                         system_prompt, chat_template_kwargs, max_result_chars, role,
                         chat_template)
        self.reward = reward

    async def play(self, task: Task, engine: Any, slot: int) -> tuple[ChatTranscript, float, dict]:
        """One episode; returns its transcript, reward and metadata."""
        transcript = self.transcript(engine, task_messages(task, self.system_prompt))
        limit = self.token_limit(engine)
        stats, end, text, turns = ToolStats(), "", "", 0
        for turn in range(self.max_turns):
            turn_text = await self.next_turn(transcript, engine, task, slot, turn, limit)
            if turn_text is None:
                end = "token_budget"
                break
            text, turns = turn_text, turns + 1
            calls = parse_tool_calls(text)
            if not calls:
                end = "answer"
                break
            if turn + 1 == self.max_turns:
                end = "max_turns"  # no turn is left to read the results: counted, not run
                stats.calls += len(calls)
                break
            await self.run_tools(calls, transcript, stats)
        end = end or "max_turns"
        reward = float(await self.score(text if end == "answer" else "", task.metadata))
        meta = {"turns": turns, "end": end, "answer": text if end == "answer" else "",
                "temperature": float(self.sampling_for(task).temperature), **stats.as_metadata()}
        return transcript, reward, meta

    async def score(self, text: str, metadata: dict) -> float:
        if getattr(self.reward, "cheap", False):
            return float(self.reward(text, metadata))
        return float(await blocking(self.reward, text, metadata))
