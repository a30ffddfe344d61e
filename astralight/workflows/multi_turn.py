"""Multi-turn environment workflow: observation -> action -> observation ... -> reward.

One :class:`Sample` per episode, laid out as one token stream (astralight/ARCHITECTURE.md rule 1,
tokens in / tokens out): ``prompt (first observation) + action_1 + observation_1 + action_2 +
...``. Only action tokens are trained on: they carry ``loss_mask`` 1, the behaviour log-prob and
the version of the engine that generated them; prompt and observation tokens carry mask 0, log-prob
0 and version -1. The model's own tokens are never re-tokenized: each turn's context is exactly the
token ids so far (the action's EOS included, it ended the turn), so the trainer sees what the
policy saw.

Environments are plugins named by import path (``environment: pkg.module.Class`` plus
``environment_kwargs``); the workflow builds one per episode, so an environment may keep state.
Every episode is its own coroutine: its next turn is submitted to the engine as soon as its own
environment step returns, so a slow environment step or a long episode never holds another
episode; ``reset`` and ``step`` run on an executor thread (they may block: a game, a tool, a
web call) while the engine keeps generating for every other episode.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from astralight.engine import SamplingSpec, gather_all
from astralight.protocol import Sample, Task
from astralight.workflows.base import Workflow, blocking, episode_jobs, tokenize_prompt
from astralight.workflows.single_turn import SingleTurnWorkflow

log = logging.getLogger(__name__)


class Environment:
    """Base class of a multi-turn environment; one instance serves one episode.

    ``reset(task)`` returns the first observation (the prompt text). ``step(action)`` gets the
    action text (EOS stripped) and returns ``(observation, reward, done)``; the observation is
    appended to the context (masked out of the loss) unless the episode is done; the episode's
    reward is the sum of its step rewards.
    """

    def reset(self, task: Task) -> str:
        raise NotImplementedError(f"{type(self).__name__} must implement reset(task)")

    def step(self, action: str) -> tuple[str, float, bool]:
        raise NotImplementedError(f"{type(self).__name__} must implement step(action)")


class ArithmeticHintEnv(Environment):
    """Toy environment on the arithmetic task: answer, get a hint, answer again.

    ``reset`` returns the task prompt (``"37+45="``). A right answer (``task.metadata["answer"]``)
    ends the episode with ``reward``; a wrong one returns the observation ``feedback`` filled with
    ``{hint}`` (``"up"`` if the answer was too small or not a number, ``"down"`` if too large) and
    ``{problem}``, e.g. ``"81?up;37+45="`` ... (the action ``81`` is already in the context).
    Every character is in the tiny model's char tokenizer.
    """

    def __init__(self, reward: float = 1.0, feedback: str = "?{hint};{problem}",
                 answer_key: str = "answer"):
        self.reward, self.feedback, self.answer_key = float(reward), feedback, answer_key
        self.problem, self.answer = "", ""

    def reset(self, task: Task) -> str:
        if self.answer_key not in task.metadata:
            raise KeyError(f"task.metadata: ArithmeticHintEnv needs {self.answer_key!r}, got "
                           f"{sorted(task.metadata)} (task {task.task_id})")
        if not isinstance(task.prompt, str):
            raise TypeError(f"task.prompt: ArithmeticHintEnv needs text, got {type(task.prompt).__name__}")
        self.problem, self.answer = task.prompt, str(task.metadata[self.answer_key]).strip()
        return self.problem

    def step(self, action: str) -> tuple[str, float, bool]:
        guess = action.strip()
        if guess == self.answer:
            return "", self.reward, True
        try:
            hint = "down" if int(guess) > int(self.answer) else "up"
        except ValueError:
            hint = "up"
        return self.feedback.format(hint=hint, problem=self.problem), 0.0, False


def _resolve(environment: str | type | Callable[..., Environment]) -> Callable[..., Environment]:
    if isinstance(environment, str):
        module, _, name = environment.rpartition(".")
        if not module:
            raise ValueError(f"environment: expected an import path like pkg.module.Class, "
                             f"got {environment!r}")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"environment: cannot import {environment!r} ({exc})") from None
    if callable(environment):
        return environment
    raise TypeError(f"environment: expected an import path or a class, got {type(environment).__name__}")


@dataclass
class _Episode:
    task: Task
    slot: int
    env: Environment
    ids: list[int]
    prompt_len: int
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    end: str = ""  # done | max_turns | context_full

    def append(self, ids, logprobs, mask, version):
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.mask.extend([mask] * len(ids))
        self.versions.extend([version] * len(ids))

    def extend_action(self, completion: Any, version: int) -> None:
        """The policy's own tokens, each with its behaviour log-prob and sampling version."""
        self.ids.extend(completion.token_ids)
        self.logprobs.extend(completion.logprobs)
        self.mask.extend([1] * len(completion.token_ids))
        self.versions.extend(completion.token_versions(version))


class MultiTurnWorkflow(Workflow):
    """Episodes with an environment, one Sample per episode (``Task.workflow == "multi_turn"``).

    Args:
        environment: import path (or class / factory) of an :class:`Environment`; one instance
            per episode, built with ``environment_kwargs``.
        max_turns: most actions per episode; an episode not done by then ends (``end: max_turns``).
        sampling / eval_sampling: per-action sampling for train / eval tasks.
        role: the role tag of the samples (optional).
        add_special_tokens: passed to the tokenizer for the first observation.

    ``task.n`` episodes per task, for every model id in ``task.model_ids``. An episode whose
    context leaves no room for another action ends with ``end: context_full``.
    """

    name = "multi_turn"

    def __init__(self, environment: str | type | Callable[..., Environment],
                 environment_kwargs: dict | None = None, max_turns: int = 4,
                 sampling: SamplingSpec | None = None, eval_sampling: SamplingSpec | None = None,
                 role: str = "", add_special_tokens: bool = False):
        if max_turns < 1:
            raise ValueError(f"max_turns: must be >= 1, got {max_turns}")
        self.factory = _resolve(environment)
        self.environment_kwargs = dict(environment_kwargs or {})
        self.max_turns = max_turns
        self.sampling = sampling or SamplingSpec()
        self.eval_sampling = eval_sampling or SamplingSpec(temperature=1.0,
                                                           max_tokens=self.sampling.max_tokens)
        self.role = role
        self.add_special_tokens = add_special_tokens

    def _tokens(self, tokenizer: Any, text: str, first: bool) -> list[int]:
        return tokenize_prompt(tokenizer, text, self.add_special_tokens and first) if text else []

    async def run(self, task: Task, engines: dict[str, Any]) -> list[Sample]:
        episodes = episode_jobs(task, engines)
        played = await gather_all(*(self.play(task, engine, g)
                                        for _, engine, g in episodes))
        samples = []
        for (model_id, _, _), ep in zip(episodes, played):
            if not ep.mask or not any(ep.mask):
                log.warning("task %s: episode %d produced no action (%s); no sample",
                            ep.task.task_id, ep.slot, ep.end)
                continue
            samples.append(self._sample(ep, model_id, len(samples)))
        return samples

    async def play(self, task: Task, engine: Any, slot: int) -> _Episode:
        """One episode: reset, then act / step until done, ``max_turns`` or a full context."""
        env = await blocking(self.factory, **self.environment_kwargs)
        first = await blocking(env.reset, task)
        ids = self._tokens(engine.tokenizer, first, first=True)
        ep = _Episode(task, slot, env, list(ids), len(ids))
        sampling = self.eval_sampling if task.kind == "eval" else self.sampling
        limit = getattr(engine, "max_model_len", None)
        for turn in range(self.max_turns):
            if not ep.ids or (limit is not None and len(ep.ids) >= limit):
                ep.end = "context_full"
                break
            version = int(engine.version)
            spec = sampling.for_request(slot + turn * task.n, task.task_id)
            comp = await engine.generate(list(ep.ids), spec)
            ep.extend_action(comp, version)
            action = SingleTurnWorkflow.decode(engine.tokenizer, comp)
            ep.actions.append(action)
            obs, reward, done = await blocking(env.step, action)
            ep.rewards.append(float(reward))
            if done:
                ep.end = "done"
                break
            if turn + 1 == self.max_turns:
                ep.end = "max_turns"  # the last observation would never be acted on
                break
            obs_ids = self._tokens(engine.tokenizer, obs, first=False)
            ep.append(obs_ids, [0.0] * len(obs_ids), 0, -1)
        ep.end = ep.end or "max_turns"
        return ep

    def _sample(self, ep: _Episode, model_id: str, index: int) -> Sample:
        sampling = self.eval_sampling if ep.task.kind == "eval" else self.sampling
        # trailing observation tokens after the last action carry no signal; the context_full
        # case can leave one: trim so the sample ends on the policy's own last token
        last = max(i for i, m in enumerate(ep.mask) if m) + 1 + ep.prompt_len
        return Sample(
            task_id=ep.task.task_id,
            sample_index=index,
            model_id=model_id,
            token_ids=np.asarray(ep.ids[:last], dtype=np.int32),
            logprobs=np.asarray([0.0] * ep.prompt_len + ep.logprobs, dtype=np.float32)[:last],
            loss_mask=np.asarray([0] * ep.prompt_len + ep.mask, dtype=np.uint8)[:last],
            versions=np.asarray([-1] * ep.prompt_len + ep.versions, dtype=np.int32)[:last],
            reward=float(sum(ep.rewards)),
            prompt_len=ep.prompt_len,
            group_index=ep.slot,
            role=self.role,
            metadata={"turns": len(ep.actions), "end": ep.end, "step_rewards": ep.rewards,
                      "actions": ep.actions, "temperature": float(sampling.temperature)},
        )
