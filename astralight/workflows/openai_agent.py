"""Bring your own agent: a plain ``openai``-client function, run once per episode and trained
unchanged through the RaaS's OpenAI-compatible endpoint (:mod:`astralight.raas.openai_endpoint`).

The agent is an ordinary function (named by import path, or passed as a callable)::

    def agent(task: dict, base_url: str, api_key: str, model: str, **agent_kwargs) -> str:
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        ...client.chat.completions.create(model=model, messages=..., tools=...)...
        return final_answer_text

``task`` is a plain dict: ``task_id``, ``prompt`` (the task's prompt, text or chat messages),
``messages`` (the prompt as chat messages, after ``system_prompt`` when one is configured),
``metadata`` (the task's metadata; it holds what the reward checks against, so do not show it to
the model), ``kind`` (``train`` / ``eval``) and ``episode`` (0..n-1). ``api_key`` is the
episode's own key: it works with ``base_url`` (the episode's path) and also alone, on the
endpoint's one base URL for the process (``.../v1``: the key chooses the episode), and a call
with it on another episode's path is refused (403 ``wrong_episode``), so a client shared across
episodes cannot mix their conversations silently.

An ``async def`` agent (with ``openai.AsyncOpenAI``) runs as a task on the process's one agent
event loop (:func:`agent_loop`, a daemon thread), every async agent on the same loop: clients and
connection pools that a framework keeps per process (the OpenAI Agents SDK's shared HTTP client,
a module-level ``AsyncOpenAI``) then serve every episode, where a loop per episode failed with
"bound to a different event loop" and left "Event loop is closed" tracebacks behind. Such an
agent must not block (as in any asyncio program); a timeout cancels it. A plain ``def`` agent
runs on a daemon thread of its own. At most ``max_parallel_agents`` agents run at once, with
``timeout_s`` per episode counted from its start. Not on the loop's shared executor
(``blocking``): an agent holds its thread for its whole episode, so agents would starve the
rewards and environment steps that executor serves; and not on a ``ThreadPoolExecutor`` either,
whose threads the interpreter joins at exit, so one agent stuck in its own code would keep the
RaaS from ever exiting.

An agent whose dependencies cannot live beside vLLM, or a program (a CLI harness), runs out of
process instead: :class:`~astralight.workflows.agent_process.ProcessAgentWorkflow` (a worker in
the agent's own virtualenv, or a command per episode), with everything below unchanged.

Its return value is the episode's answer: text as is, ``None`` as ``""``, anything else as JSON.
``reward(answer, task.metadata)`` scores the episode. An agent that raises or times out is logged
and counted (:attr:`OpenAIAgentWorkflow.stats`); the calls it made are scored ``failed_reward``
(None: no sample), and its calls after a timeout are refused (404), so it stops soon. When the
first ``fail_fast`` episodes all raise the same error, the workflow is broken
(:class:`~astralight.workflows.base.BrokenWorkflowError`: the RaaS stops the run).

An agent team (``team: [lead, teammate, ...]``) is one episode that calls several models by
``model`` name, e.g. a supervisor and a worker: each call is served by the engine it names and
recorded under that ``model_id``; the calls of each policy the task trains become that policy's
samples (its own trainer learns from them, with the episode's reward, or the member's own reward
when the agent returns one: ``agent_rewards``), and a member the RaaS does not register (a frozen
model, e.g. a judge) is served and never trained. The agent is handed the lead's name as
``model``; it knows its teammates' names from its own configuration (``agent_kwargs``).

Samples (:func:`merge_calls`): the endpoint recorded every call's prompt and completion tokens.
A call whose prompt token ids start with the tokens of an earlier segment (that segment's prompt,
completions and everything between) extends it -- the usual case of an agent that appends the
model's message and the tool results to its conversation: the new prompt tokens between the two
completions (the template's closing of the assistant turn, tool results, the next generation
prompt) are masked (loss mask 0, version -1, log-prob 0), the completion is trained. Any other
call starts a new segment (an agent that rewrites, summarises or truncates its history, or a
template that re-renders earlier turns differently, or a tokenizer that merges across the
boundary). Each segment is one sample.

Group rule for an episode split into several samples: every sample of the episode carries the
episode's reward and ``group_index`` = the episode's index (0..n-1); ``sample_index`` numbers the
task's samples consecutively; ``metadata`` says ``episode``, ``segment``, ``segments``. The
dataflow's group baseline is taken over samples, so a split episode weighs as many samples as it
has segments in its group's mean and std (as in per-call RL agent trainers, e.g. Agent
Lightning's transition samples); an appending agent gives one sample per episode and the
baseline is the usual per-episode GRPO one. Eval tasks keep one sample per episode (its last
segment), so avg@k counts episodes. ``merge=False`` gives one sample per call.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from astralight.agents.stats import ERROR_KINDS
from astralight.engine import SamplingSpec, gather_all
from astralight.protocol import Sample, Task
from astralight.rewards.base import Reward
from astralight.workflows.base import (BrokenWorkflowError, TaskFailedError, Workflow, blocking,
                                       episode_jobs)
from astralight.workflows.chat_episodes import task_messages

log = logging.getLogger(__name__)

#: the answer text kept in sample metadata is cut to this many characters
MAX_ANSWER_CHARS = 500


_AGENT_LOOP: asyncio.AbstractEventLoop | None = None
_AGENT_LOOP_LOCK = threading.Lock()


def agent_loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for async agents, running on a daemon thread (started on
    first use, never closed: a framework's per-process clients stay bound to it)."""
    global _AGENT_LOOP
    with _AGENT_LOOP_LOCK:
        if _AGENT_LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="openai-agents-loop",
                             daemon=True).start()
            _AGENT_LOOP = loop
        return _AGENT_LOOP


async def _run_async_agent(call: Callable[[], Any]) -> Any:
    """On the agent loop: the agent's coroutine; what would stop the loop is an error instead."""
    try:
        return await call()
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit & co. would stop every agent
        raise RuntimeError(f"agent raised {type(exc).__name__}: {exc}") from None


def is_async_agent(agent: Any) -> bool:
    """An ``async def`` function (or partial of one, or an object whose ``__call__`` is)."""
    return inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(
        getattr(agent, "__call__", None))


def _constrained(records: Sequence[Any], indices: Sequence[int]) -> dict:
    """``{"constrained": [kinds]}`` when some call of a segment had constrained decoding
    (``response_format`` JSON, forced tool calls), so a user sees it in the sample; else {}."""
    kinds = sorted({r.constrained for r in records
                    if r.index in set(indices) and getattr(r, "constrained", None)})
    return {"constrained": kinds} if kinds else {}


def load_agent(agent: Any) -> Callable[..., Any]:
    """The agent function from an import path (``pkg.module.function``) or a callable."""
    if callable(agent):
        return agent
    if not isinstance(agent, str) or "." not in agent:
        raise ValueError(f"agent: expected an import path like pkg.module.function or a "
                         f"callable, got {agent!r}")
    module, _, name = agent.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"agent: cannot import {agent!r} ({exc}); is its folder on "
                         "PYTHONPATH (a recipe's `pythonpath:` folders are)?") from None
    if not callable(fn):
        raise ValueError(f"agent: {agent!r} is a {type(fn).__name__}, not a function")
    return fn


def member_rewards(value: Any, members: list[str]) -> tuple[Any, dict[str, float]]:
    """An ``agent_rewards`` agent's return value, ``{"answer": ..., "rewards": {model_id:
    float}}``, as (answer, rewards); ValueError naming the shape for anything else (the
    agent's error: it is counted and scored as one). A command agent's stdout is read as JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    if not isinstance(value, dict) or set(value) != {"answer", "rewards"} or not isinstance(
            value["rewards"], dict):
        raise ValueError(f"agent_rewards: the agent must return {{'answer': ..., 'rewards': "
                         f"{{model_id: float}}}}, got {str(value)[:200]!r}")
    rewards = {}
    for model, r in value["rewards"].items():
        if model not in members:
            raise ValueError(f"agent_rewards: rewards names {model!r}, which this episode "
                             f"does not serve ({members})")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or r != r:
            raise ValueError(f"agent_rewards: rewards[{model!r}] must be a number, got {r!r}")
        rewards[model] = float(r)
    return value["answer"], rewards


def describe_error(exc: BaseException) -> str:
    """``Type: message``; for an exception group (an agent's ``TaskGroup``, e.g. an MCP
    client's), also its first leaf exception, which says what actually failed."""
    text = f"{type(exc).__name__}: {exc}"
    leaf = exc
    while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
        leaf = leaf.exceptions[0]
    return text if leaf is exc else f"{text} (first: {type(leaf).__name__}: {leaf})"


def answer_text(value: Any) -> str:
    """An agent's return value as the text the reward scores."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


@dataclass
class Segment:
    """Consecutive calls merged into one token stream (see the module docstring)."""

    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    versions: list[int]
    prompt_len: int
    calls: list[int] = field(default_factory=list)
    temperature: float | None = None  # every call of a segment was sampled at this one

    def add_completion(self, record: Any) -> None:
        self.token_ids += record.completion_ids
        self.logprobs += record.logprobs
        self.loss_mask += [1] * len(record.completion_ids)
        self.versions += record.versions
        self.calls.append(record.index)

    def add_context(self, ids: Sequence[int]) -> None:
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.versions += [-1] * len(ids)


def merge_calls(calls: Sequence[Any], merge: bool = True) -> list[Segment]:
    """The episode's calls (``CallRecord``\\ s, in call order) as segments: a call extends the
    segment whose tokens its prompt starts with (the longest such, when several) and whose calls
    were sampled at the same temperature (a sample has one behaviour temperature), else starts a
    new one; ``merge=False``: one segment per call."""
    segments: list[Segment] = []
    for rec in calls:
        prompt = list(rec.prompt_ids)
        temperature = float(rec.temperature)
        target = None
        if merge:
            for seg in segments:
                n = len(seg.token_ids)
                if n <= len(prompt) and prompt[:n] == seg.token_ids and (
                        seg.temperature == temperature) and (
                        target is None or n > len(target.token_ids)):
                    target = seg
        if target is None:
            target = Segment([], [], [], [], prompt_len=len(prompt), temperature=temperature)
            target.add_context(prompt)
            segments.append(target)
        else:
            target.add_context(prompt[len(target.token_ids):])
        target.add_completion(rec)
    return [s for s in segments if any(s.loss_mask)]


@dataclass
class EpisodeResult:
    """What one agent run left: its calls, answer, reward and how it ended."""

    calls: list
    answer: str = ""
    reward: float = 0.0
    end: str = "answer"  # answer | error | timeout | no_calls
    error: str = ""  # how the agent failed: "ExceptionType: message" (error), or "timeout"
    rewards: dict = field(default_factory=dict)  # a team member's own reward (agent_rewards)


class OpenAIAgentWorkflow(Workflow):
    """Runs a user's ``openai``-client agent once per episode (``Task.workflow ==
    "openai_agent"``) and trains on what its calls generated.

    Args:
        agent: import path of the agent function (see the module docstring), or the callable.
        reward: scores the agent's answer text against ``task.metadata``.
        sampling / eval_sampling: defaults for what a request leaves unset (temperature, top_p,
            max_tokens, seed) on train / eval tasks; with a seed, call ``i`` of episode ``g`` is
            seeded from ``(task_id, g + i * n)``.
        force_sampling: True (default): on train tasks the sampling's temperature, top_p and
            seed replace the request's, so an agent written with ``temperature=0`` still
            explores and every sample has the temperature the trainer expects. False: the
            agent's own values are used (calls at different temperatures are never merged; the
            trainer refuses temperatures other than its own). Eval tasks always use the
            request's values over ``eval_sampling``'s.
        timeout_s: most seconds per episode (the agent's thread is not killed: its later calls
            are refused).
        max_calls: most model calls per episode (a further call is a 400 to the agent).
        max_context_tokens: most prompt + completion tokens per call (also bounded by the
            engine's ``max_model_len``).
        system_prompt: put first in ``task["messages"]`` for text prompts ("" for none).
        chat_template_kwargs: extra chat template variables (``enable_thinking``...).
        merge: merge calls that extend each other into one sample (see :func:`merge_calls`).
        max_parallel_agents: agents running at once (each on a daemon thread of its own); the
            episodes beyond wait for a slot before their timeout starts.
        agent_kwargs: extra keyword arguments for every agent call (its configuration).
        failed_reward: the reward of an episode whose agent raised or timed out, given to the
            calls it made (a misspelt tool, ``MaxTurnsExceeded``, a context overflow are the
            policy's failures too; eval accuracy counts them as wrong). None: no sample, as for
            an episode that made no call.
        fail_fast: when the first ``fail_fast`` episodes all raise the same error (type and
            message), the agent is broken, not the policy: the RaaS stops the run naming the
            error (exit 2, not restarted). 0: never.
        role: the samples' role tag.
        endpoint: the :class:`~astralight.raas.openai_endpoint.OpenAIEndpoint` to serve through
            (default: the process's shared one, started on first use).
        team: an agent team: the models (engines of this RaaS, by model_id) every episode may
            call, the lead first (the ``model`` the agent is handed). A task plays ``task.n``
            episodes, each calling any member; the calls of every policy in
            ``task.model_ids`` become samples of that policy, and calls to any other member
            (a frozen model, an engine the RaaS does not register) are served, never trained.
            Every policy the task trains must be a member. None: one policy per episode (each
            model in ``task.model_ids`` plays its own ``task.n`` episodes).
        agent_rewards: the agent returns ``{"answer": text, "rewards": {model_id: float}}``: a
            member named in ``rewards`` gets its own reward, the others share
            ``reward(answer)``. Another return value is the agent's error. False: every
            member's samples carry ``reward(answer)``.
    """

    name = "openai_agent"

    def __init__(self, agent: Any, reward: Reward, sampling: SamplingSpec | None = None,
                 eval_sampling: SamplingSpec | None = None, force_sampling: bool = True,
                 timeout_s: float = 300.0, max_calls: int = 16,
                 max_context_tokens: int | None = None, system_prompt: str = "",
                 chat_template_kwargs: dict | None = None, merge: bool = True,
                 max_parallel_agents: int = 128, agent_kwargs: dict | None = None,
                 failed_reward: float | None = 0.0, fail_fast: int = 8,
                 role: str = "", endpoint: Any = None, team: Sequence[str] | None = None,
                 agent_rewards: bool = False):
        if not callable(reward):
            raise TypeError(f"reward: expected a Reward, got {type(reward).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0 seconds, got {timeout_s}")
        if max_calls < 1:
            raise ValueError(f"max_calls: must be >= 1, got {max_calls}")
        if max_context_tokens is not None and max_context_tokens < 2:
            raise ValueError(f"max_context_tokens: must be >= 2 or None, got {max_context_tokens}")
        if max_parallel_agents < 1:
            raise ValueError(f"max_parallel_agents: must be >= 1, got {max_parallel_agents}")
        if isinstance(fail_fast, bool) or not isinstance(fail_fast, int) or fail_fast < 0:
            raise ValueError(f"fail_fast: episodes (an int >= 0; 0 never), got {fail_fast!r}")
        self.agent_kwargs = dict(agent_kwargs or {})
        self.agent = self._init_agent(agent)
        self.reward = reward
        self.sampling = sampling or SamplingSpec()
        self.eval_sampling = eval_sampling or SamplingSpec(temperature=1.0,
                                                           max_tokens=self.sampling.max_tokens)
        self.force_sampling = bool(force_sampling)
        self.timeout_s = float(timeout_s)
        self.max_calls = int(max_calls)
        self.max_context_tokens = max_context_tokens
        self.system_prompt = system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.merge = bool(merge)
        self.max_parallel_agents = int(max_parallel_agents)
        self.failed_reward = None if failed_reward is None else float(failed_reward)
        self.fail_fast = fail_fast
        self._first_ends: list[str] = []  # how the first fail_fast episodes ended ("" = answered)
        self.role = role
        self.endpoint = endpoint
        if team is not None and (isinstance(team, str) or not team or len(set(team)) != len(team)
                                 or not all(isinstance(m, str) and m for m in team)):
            raise ValueError(f"team: a list of distinct model ids, the lead first, got {team!r}")
        self.team = list(team) if team is not None else None
        self.agent_rewards = bool(agent_rewards)
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> Semaphore
        #: counters over the workflow's life (episodes, failures, calls, samples)
        self.stats = {"episodes": 0, "agent_errors": 0, "agent_timeouts": 0, "no_calls": 0,
                      "calls": 0, "merged_calls": 0, "samples": 0}

    def _init_agent(self, agent: Any) -> Any:
        """The agent to run, checked (here: the function, imported, whose signature accepts
        the call; :class:`~astralight.workflows.agent_process.ProcessAgentWorkflow` checks a
        path in another interpreter instead)."""
        fn = load_agent(agent)
        try:
            inspect.signature(fn).bind({}, base_url="", api_key="", model="",
                                       **self.agent_kwargs)
        except TypeError as exc:
            raise ValueError(f"agent: {getattr(fn, '__name__', fn)} must accept "
                             "(task, base_url, api_key, model"
                             f"{''.join(', ' + k for k in self.agent_kwargs)}): {exc}") from None
        except ValueError:  # no signature to inspect (a builtin): trust it
            pass
        return fn

    # -- plumbing

    def _endpoint(self) -> Any:
        if self.endpoint is None:
            from astralight.raas.openai_endpoint import shared_endpoint

            self.endpoint = shared_endpoint()
        return self.endpoint

    async def _on_thread(self, fn: Callable[[], Any], name: str) -> Any:
        """``fn()`` on a daemon thread of its own, awaited; cancelling the wait leaves the thread
        to finish unobserved (it cannot be killed; its endpoint calls are refused by then)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not done.done():
                (done.set_result if ok else done.set_exception)(value)

        def target() -> None:
            try:
                ok, value = True, fn()
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting episode
                ok, value = False, exc
            except BaseException as exc:  # noqa: BLE001 - SystemExit & co. would stop the loop
                ok, value = False, RuntimeError(f"agent raised {type(exc).__name__}: {exc}")
            if isinstance(value, StopIteration):  # a future cannot hold one
                value = RuntimeError(f"agent raised StopIteration: {value}")
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:  # the loop is gone (the RaaS stopped): nobody waits
                pass

        threading.Thread(target=target, name=name, daemon=True).start()
        return await done

    def _call_agent(self, task_view: dict, base_url: str, api_key: str, model: str) -> Any:
        """On an agent thread: a plain agent, to its end (one that returns an awaitable: that,
        in a loop of its own)."""
        out = self.agent(task_view, base_url=base_url, api_key=api_key, model=model,
                         **self.agent_kwargs)
        if inspect.isawaitable(out):
            async def wait():
                return await out

            out = asyncio.run(wait())
        return out

    def _start_agent(self, view: dict, base_url: str, api_key: str, model: str,
                     name: str) -> Any:
        """The episode's agent, started: an awaitable of its return value (which a timeout
        cancels). Here in this process: an ``async def`` as a task on the one agent loop, a
        plain one on a daemon thread of its own."""
        if is_async_agent(self.agent):
            coro = functools.partial(self.agent, view, base_url=base_url, api_key=api_key,
                                     model=model, **self.agent_kwargs)
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                _run_async_agent(coro), agent_loop()))
        return self._on_thread(functools.partial(self._call_agent, view, base_url, api_key,
                                                 model), f"openai-agent-{name}")

    # -- episodes

    def team_engines(self, task: Task, engines: dict[str, Any]) -> dict[str, Any]:
        """``{model_id: engine}`` of the team, lead first; KeyError naming the fix for a
        member this RaaS has no engine for, or a trained policy that is not a member."""
        missing = [m for m in self.team if m not in engines]
        if missing:
            raise KeyError(f"team: no engine for {missing}; this RaaS serves {sorted(engines)} "
                           "(a frozen member is an engine left out of the RaaS's model_ids)")
        outside = [m for m in task.model_ids if m not in self.team]
        if outside:
            raise KeyError(f"team: task {task.task_id} trains {outside}, which the team "
                           f"{self.team} never calls; add them to team")
        return {m: engines[m] for m in self.team}

    async def run(self, task: Task, engines: dict[str, Any]) -> list[Sample]:
        others: dict[str, Any] = {}
        if self.team is None:
            jobs = episode_jobs(task, engines)
        else:  # one episode per slot, led by the first member, calling any member
            members = self.team_engines(task, engines)
            lead, *rest = members
            jobs = [(lead, members[lead], g) for g in range(task.n)]
            others = {m: members[m] for m in rest}
        messages = task_messages(task, self.system_prompt)
        played = await gather_all(*(self.play(task, messages, engine, model_id, g, others=others)
                                    for model_id, engine, g in jobs))
        self.check_broken(task, played)
        samples: list[Sample] = []
        for (model_id, _, g), ep in zip(jobs, played):
            for member in ([model_id] if self.team is None else self.team):
                if member in task.model_ids:
                    samples += self.episode_samples(task, member, g, ep, len(samples))
        self.stats["samples"] += len(samples)
        failed = [ep for ep in played if ep.end in ("error", "timeout")]
        if not samples and played and len(failed) == len(played):
            raise TaskFailedError(f"every episode of task {task.task_id} failed before it left "
                                  f"a sample ({len(failed)} of {len(played)}; the first: "
                                  f"{failed[0].error[:300]})")
        return samples

    def check_broken(self, task: Task, played: list[EpisodeResult]) -> None:
        """Raise :class:`~astralight.workflows.base.BrokenWorkflowError` once the first
        ``fail_fast`` episodes all raised the same error."""
        if not self.fail_fast or len(self._first_ends) >= self.fail_fast:
            return
        for ep in played:
            if len(self._first_ends) < self.fail_fast:
                self._first_ends.append(ep.error if ep.end == "error" else "")
        ends = self._first_ends
        if len(ends) == self.fail_fast and ends[0] and all(e == ends[0] for e in ends):
            raise BrokenWorkflowError(
                f"the agent raised the same error in each of its first {self.fail_fast} "
                f"episodes (the last on task {task.task_id}): {ends[0][:500]}; fix the agent "
                "(run it once by hand against any OpenAI endpoint), or set the workflow's "
                "fail_fast: 0 to keep going")

    async def play(self, task: Task, messages: list[dict], engine: Any, model_id: str,
                   slot: int, others: dict[str, Any] | None = None) -> EpisodeResult:
        """One agent run through its own endpoint episode; never raises for the agent's
        failures (they end it as ``error`` / ``timeout``)."""
        from astralight.raas.openai_endpoint import EpisodeSettings

        endpoint = self.endpoint or await blocking(self._endpoint)  # started once, off the loop
        settings = EpisodeSettings(
            sampling=self.eval_sampling if task.kind == "eval" else self.sampling,
            force_sampling=self.force_sampling and task.kind != "eval", max_calls=self.max_calls,
            chat_template_kwargs=self.chat_template_kwargs,
            max_context_tokens=self.max_context_tokens, seed_key=task.task_id, seed_slot=slot,
            seed_stride=max(1, task.n))
        view = {"task_id": task.task_id, "prompt": task.prompt,
                "messages": [dict(m) for m in messages], "metadata": dict(task.metadata),
                "kind": task.kind, "episode": slot}
        self.stats["episodes"] += 1
        loop = asyncio.get_running_loop()
        slots = self._slots.get(loop)
        if slots is None:
            slots = self._slots[loop] = asyncio.Semaphore(self.max_parallel_agents)
        async with slots:
            return await self._play(task, view, endpoint, settings, engine, model_id, slot,
                                    others)

    async def _play(self, task: Task, view: dict, endpoint: Any, settings: Any, engine: Any,
                    model_id: str, slot: int, others: dict[str, Any] | None = None
                    ) -> EpisodeResult:
        ep = endpoint.open_episode(engine, model_id, settings, others=others)
        end, value, error, rewards = "answer", None, "", {}
        try:
            running = self._start_agent(view, endpoint.base_url(ep.id), ep.key, model_id,
                                        f"{task.task_id}-{slot}")
            value = await asyncio.wait_for(running, self.timeout_s)
            if self.agent_rewards:
                value, rewards = member_rewards(value, list(ep.engines))
        except asyncio.TimeoutError:
            end, error = "timeout", "timeout"
            self.stats["agent_timeouts"] += 1
            log.warning("task %s episode %d: the agent did not finish in timeout_s=%g s (%d "
                        "timeouts so far)", task.task_id, slot, self.timeout_s,
                        self.stats["agent_timeouts"])
        except BrokenWorkflowError:
            raise  # the agent cannot run at all (out of process: it does not import)
        except Exception as exc:  # noqa: BLE001 - the user's agent failed: counted, not fatal
            # an agent in another process raised there: its own type, message and traceback
            error = getattr(exc, "agent_error", "") or describe_error(exc)
            end = "error"
            self.stats["agent_errors"] += 1
            child_tb = getattr(exc, "agent_traceback", "")
            first = self.stats["agent_errors"] == 1
            log.warning("task %s episode %d: the agent raised %s (%d agent errors so far)%s",
                        task.task_id, slot, error, self.stats["agent_errors"],
                        f"\n{child_tb.rstrip()}" if child_tb and first else "",
                        exc_info=first and not child_tb)
        finally:
            calls = endpoint.close_episode(ep.id)
        self.stats["calls"] += len(calls)
        result = EpisodeResult(calls=calls, end=end, error=error)
        if end != "answer":  # scored failed_reward on the calls it made (None: no sample)
            if self.failed_reward is not None:
                result.reward = self.failed_reward
            return result
        if not calls:
            result.end = "no_calls"
            self.stats["no_calls"] += 1
            log.warning("task %s episode %d: the agent made no model call; no sample",
                        task.task_id, slot)
            return result
        result.answer = answer_text(value)
        result.reward = await self.score(result.answer, task.metadata)
        result.rewards = rewards
        return result

    def episode_samples(self, task: Task, model_id: str, slot: int, ep: EpisodeResult,
                        first_index: int) -> list[Sample]:
        """The samples of one episode: none when it made no call, or when its agent failed
        and ``failed_reward`` is None."""
        if ep.end == "no_calls" or not ep.calls or (ep.end != "answer"
                                                    and self.failed_reward is None):
            return []
        calls = [r for r in ep.calls if r.model_id == model_id]  # a team member's own calls
        if not calls:
            return []
        segments = merge_calls(calls, self.merge)
        self.stats["merged_calls"] += len(calls) - len(segments)
        if task.kind == "eval" and segments:
            last = calls[-1].index
            segments = [s for s in segments if last in s.calls][-1:]
        errors = {k: 0 for k in ERROR_KINDS}
        for r in calls:
            for kind, count in r.tool_call_errors.items():
                errors[kind] = errors.get(kind, 0) + count
        meta = {"episode": slot, "segments": len(segments), "turns": len(calls),
                "end": ep.end, "answer": ep.answer[:MAX_ANSWER_CHARS],
                "agent_error": ep.error[:MAX_ANSWER_CHARS],
                "tool_calls": sum(len(r.tool_calls) for r in calls), "tool_errors": errors}
        if self.team is not None:  # how the episode's calls spread over the team
            meta["team_calls"] = {m: sum(r.model_id == m for r in ep.calls) for m in self.team}
        reward = ep.rewards.get(model_id, ep.reward)
        out = []
        for j, seg in enumerate(segments):
            out.append(Sample(
                task_id=task.task_id, sample_index=first_index + j, model_id=model_id,
                token_ids=np.asarray(seg.token_ids, dtype=np.int32),
                logprobs=np.asarray(seg.logprobs, dtype=np.float32),
                loss_mask=np.asarray(seg.loss_mask, dtype=np.uint8),
                versions=np.asarray(seg.versions, dtype=np.int32),
                reward=float(reward), prompt_len=seg.prompt_len, group_index=slot,
                role=self.role,
                metadata={**meta, "segment": j, "calls": len(seg.calls),
                          "temperature": seg.temperature,
                          **_constrained(calls, seg.calls)}))
        return out

    async def score(self, text: str, metadata: dict) -> float:
        if getattr(self.reward, "cheap", False):
            return float(self.reward(text, metadata))
        return float(await blocking(self.reward, text, metadata))
