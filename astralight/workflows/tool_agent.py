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

import dataclasses
import logging
from typing import Any

from astralight.agents.chat import ChatTranscript
from astralight.agents.stats import ToolStats
from astralight.agents.tools import ToolBox, parse_tool_calls
from astralight.protocol import Sample, Task
from astralight.raas.engine import SamplingSpec, gather_all
from astralight.rewards.base import Reward
from astralight.workflows.base import Workflow, blocking, episode_jobs

log = logging.getLogger(__name__)


def task_messages(task: Task, system_prompt: str = "") -> list[dict]:
    """The first messages of a chat episode: ``task.prompt`` as chat messages, or as one user
    message (after ``system_prompt``, when set) if it is text."""
    if isinstance(task.prompt, str):
        head = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return head + [{"role": "user", "content": task.prompt}]
    if isinstance(task.prompt, list) and task.prompt and all(isinstance(m, dict) for m in task.prompt):
        msgs = [dict(m) for m in task.prompt]
        if system_prompt and msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return msgs
    raise TypeError(f"task.prompt: a chat workflow needs text or chat messages [{{role, content}}], "
                    f"got {type(task.prompt).__name__} (task {task.task_id})")


def decode_turn(tokenizer: Any, completion: Any) -> str:
    """An assistant turn's text: its tokens without the final stop token, with the tool and
    think tags a chat tokenizer keeps as text."""
    ids = list(completion.token_ids)
    if completion.finish_reason == "stop" and ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)


async def chat_episode_samples(task: Task, engines: dict[str, Any], play: Any,
                               role: str = "") -> list[Sample]:
    """Every episode of ``task`` (``await play(task, engine, slot) -> (transcript, reward,
    metadata)``) at once, as one sample each; an episode that generated nothing gives none."""
    jobs = episode_jobs(task, engines)
    played = await gather_all(*(play(task, engine, g) for _, engine, g in jobs))
    samples = []
    for (model_id, _, g), (transcript, reward, meta) in zip(jobs, played):
        if transcript.completions == 0:
            log.warning("task %s: episode %d generated nothing (%s); no sample",
                        task.task_id, g, meta["end"])
            continue
        samples.append(transcript.sample(task, model_id, len(samples), g, reward, role, meta))
    return samples


class ToolAgentWorkflow(Workflow):
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
        max_result_chars: a longer tool result is cut.
        role: the samples' role tag.
    """

    name = "tool_agent"

    def __init__(self, tools: list[Any], reward: Reward, sampling: SamplingSpec | None = None,
                 eval_sampling: SamplingSpec | None = None, max_turns: int = 4,
                 max_total_tokens: int = 4096, system_prompt: str = "",
                 chat_template_kwargs: dict | None = None, max_result_chars: int = 2000,
                 role: str = ""):
        if not callable(reward):
            raise TypeError(f"reward: expected a Reward, got {type(reward).__name__}")
        if max_turns < 1:
            raise ValueError(f"max_turns: must be >= 1, got {max_turns}")
        if max_total_tokens < 1:
            raise ValueError(f"max_total_tokens: must be >= 1, got {max_total_tokens}")
        self.toolbox = ToolBox(list(tools or []), max_result_chars=max_result_chars)
        self.reward = reward
        self.sampling = sampling or SamplingSpec()
        self.eval_sampling = eval_sampling or SamplingSpec(temperature=1.0,
                                                           max_tokens=self.sampling.max_tokens)
        self.max_turns = int(max_turns)
        self.max_total_tokens = int(max_total_tokens)
        self.system_prompt = system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.role = role

    async def run(self, task: Task, engines: dict[str, Any]) -> list[Sample]:
        return await chat_episode_samples(task, engines, self.play, self.role)

    async def play(self, task: Task, engine: Any, slot: int) -> tuple[ChatTranscript, float, dict]:
        """One episode; returns its transcript, reward and metadata."""
        sampling = self.eval_sampling if task.kind == "eval" else self.sampling
        transcript = ChatTranscript(engine.tokenizer, task_messages(task, self.system_prompt),
                                    self.toolbox.schemas(), **self.chat_template_kwargs)
        limit = self.max_total_tokens
        engine_limit = getattr(engine, "max_model_len", None)
        if engine_limit is not None:
            limit = min(limit, int(engine_limit))
        stats, end, text, turns = ToolStats(), "", "", 0
        for turn in range(self.max_turns):
            room = limit - len(transcript)
            if room < 1:
                end = "token_budget"
                break
            spec = sampling.for_request(slot + turn * task.n, task.task_id)
            spec = dataclasses.replace(spec, max_tokens=min(int(spec.max_tokens), room))
            version = int(engine.version)
            completion = await engine.generate(list(transcript.token_ids), spec)
            text = decode_turn(engine.tokenizer, completion)
            transcript.add_completion(completion, version, text)
            turns += 1
            calls = parse_tool_calls(text)
            if not calls:
                end = "answer"
                break
            if turn + 1 == self.max_turns:
                end = "max_turns"  # no turn is left to read the results: counted, not run
                stats.calls += len(calls)
                break
            results = [await self.toolbox.call(c) for c in calls]
            for r in results:
                stats.add(r.error)
            transcript.add_messages([r.message() for r in results])
        end = end or "max_turns"
        reward = float(await self.score(text if end == "answer" else "", task.metadata))
        meta = {"turns": turns, "end": end, "answer": text if end == "answer" else "",
                "temperature": float(sampling.temperature), **stats.as_metadata()}
        return transcript, reward, meta

    async def score(self, text: str, metadata: dict) -> float:
        if getattr(self.reward, "cheap", False):
            return float(self.reward(text, metadata))
        return float(await blocking(self.reward, text, metadata))
