"""What every chat-episode workflow shares: the first messages, one assistant turn within the
episode's token budget, running a turn's tool calls, and one sample per episode.

:class:`ChatEpisodeWorkflow` holds the options (tools, sampling, turn and token budgets, system
prompt, template variables) and the turn mechanics; a subclass writes ``play(task, engine,
slot) -> (transcript, reward, metadata)``: what an episode's turns mean (an answer, an action on
an environment) and how it is scored.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from astralight.agents.chat import ChatTranscript, TemplateError
from astralight.agents.chat_templates import load_chat_template, renders_tools
from astralight.agents.stats import ToolStats
from astralight.agents.tools import ToolBox, ToolCall
from astralight.engine import SamplingSpec, gather_all
from astralight.protocol import Sample, Task
from astralight.workflows.base import Workflow, episode_jobs

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


class ChatEpisodeWorkflow(Workflow):
    """Base of the chat-episode workflows; the arguments are documented on the subclasses.

    ``run`` plays ``task.n`` episodes per policy at once (:func:`chat_episode_samples`) with
    the subclass's ``async play(task, engine, slot) -> (transcript, reward, metadata)``."""

    def __init__(self, tools: list[Any] | None, sampling: SamplingSpec | None,
                 eval_sampling: SamplingSpec | None, max_turns: int, max_total_tokens: int,
                 system_prompt: str, chat_template_kwargs: dict | None, max_result_chars: int,
                 role: str, chat_template: str | None = None):
        if max_turns < 1:
            raise ValueError(f"max_turns: must be >= 1, got {max_turns}")
        if max_total_tokens < 1:
            raise ValueError(f"max_total_tokens: must be >= 1, got {max_total_tokens}")
        self.toolbox = ToolBox(list(tools or []), max_result_chars=max_result_chars)
        self.sampling = sampling or SamplingSpec()
        self.eval_sampling = eval_sampling or SamplingSpec(temperature=1.0,
                                                           max_tokens=self.sampling.max_tokens)
        self.max_turns = int(max_turns)
        self.max_total_tokens = int(max_total_tokens)
        self.system_prompt = system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if "chat_template" in self.chat_template_kwargs:
            raise ValueError("chat_template_kwargs.chat_template: set the workflow's "
                             "chat_template instead (a shipped name, a .jinja path or the text)")
        self.chat_template = load_chat_template(chat_template)
        self.role = role
        self._tools_checked: set[int] = set()  # tokenizers whose template was seen to show tools

    async def run(self, task: Task, engines: dict[str, Any]) -> list[Sample]:
        return await chat_episode_samples(task, engines, self.play, self.role)

    def sampling_for(self, task: Task) -> SamplingSpec:
        return self.eval_sampling if task.kind == "eval" else self.sampling

    def transcript(self, engine: Any, messages: list[dict]) -> ChatTranscript:
        """A new episode's transcript over ``messages``, with the tools, the template and its
        variables. Refuses a template that leaves the tools out of the prompt: the model would
        be trained to call tools it was never shown."""
        tools = self.toolbox.schemas()
        kwargs = dict(self.chat_template_kwargs)
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        tokenizer = engine.tokenizer
        if tools and id(tokenizer) not in self._tools_checked:
            if not renders_tools(tokenizer, tools, self.chat_template):
                raise TemplateError(
                    "chat template: renders no tools (the prompt is the same with and without "
                    f"them), so the model never sees {', '.join(self.toolbox.tools)}; set the "
                    "workflow's chat_template: chatml_tools (ChatML with a Hermes-style tools "
                    "section) or a template file that renders tools")
            self._tools_checked.add(id(tokenizer))
        return ChatTranscript(tokenizer, messages, tools, **kwargs)

    def token_limit(self, engine: Any) -> int:
        """Most tokens an episode may hold: ``max_total_tokens``, or the engine's context."""
        engine_limit = getattr(engine, "max_model_len", None)
        return self.max_total_tokens if engine_limit is None else min(self.max_total_tokens,
                                                                      int(engine_limit))

    async def next_turn(self, transcript: ChatTranscript, engine: Any, task: Task, slot: int,
                        turn: int, limit: int) -> str | None:
        """Generate assistant turn ``turn`` (its ``max_tokens`` cut to what ``limit`` leaves),
        append it as generated and return its text; None when no room is left."""
        room = limit - len(transcript)
        if room < 1:
            return None
        spec = self.sampling_for(task).for_request(slot + turn * task.n, task.task_id)
        spec = dataclasses.replace(spec, max_tokens=min(int(spec.max_tokens), room))
        version = int(engine.version)
        completion = await engine.generate(list(transcript.token_ids), spec)
        text = decode_turn(engine.tokenizer, completion)
        transcript.add_completion(completion, version, text)
        return text

    async def run_tools(self, calls: list[ToolCall], transcript: ChatTranscript,
                        stats: ToolStats) -> None:
        """Run a turn's calls in order, count them, append their results as tool messages."""
        results = [await self.toolbox.call(c) for c in calls]
        for r in results:
            stats.add(r.error)
        transcript.add_messages([r.message() for r in results])
