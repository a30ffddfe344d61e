"""The Workflow API: what a RaaS runs on the tasks it leases.

A workflow turns tasks into samples using the engines it is given; it owns the interaction
(single turn, multi turn with tools, several policies talking to each other) and the reward, and
nothing else: leasing, pushing and weight refresh belong to the RaaS service. Workflows are
plain classes named by import path in the RaaS config (``workflow: {class_path, init_args}``),
so a new one needs no change to the service.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

from astralight.protocol import Sample, Task

log = logging.getLogger(__name__)


class BrokenWorkflowError(RuntimeError):
    """Raised by a workflow's ``run`` when every episode fails the same way, so the fault is in
    the workflow or the user's code, not in the policy: the RaaS stops with the message and
    exit status 2 (a config error: the launcher does not restart it, and shows the line)."""


class TaskFailedError(RuntimeError):
    """Raised by a workflow's ``run`` when none of the task's episodes left anything to train on
    because each one failed (its agent raised or timed out before any model call): the RaaS
    returns the task to the dataflow as failed at once, with this one line in its log, instead
    of leaving the lease to expire (an eval task would hold its version's evaluation that long)."""


class Workflow:
    """Base class. ``name`` is matched against ``Task.workflow`` by the service.

    A workflow is an episode runner for ONE task: ``async def run(task, engines)`` returns that
    task's samples. The RaaS runs every leased task as its own asyncio task, so episodes advance
    independently (a long one never holds a short one) and the engine batches whatever all
    episodes have in flight. Inside ``run``:

    - generate with ``await engine.generate(ids, spec)`` / ``await engine.generate_many(...)``;
    - run anything that blocks (an environment step, a tool call, a reward that runs code) with
      ``await blocking(fn, *args)``: it goes to an executor thread and never blocks the loop.

    A workflow written for the older synchronous contract -- ``run(tasks, engines) ->
    {task_id: samples}``, engines with a blocking ``generate(prompts, spec) -> [Completion]`` --
    still works: :func:`as_episode_runner` adapts it (each task runs on an executor thread with
    blocking engine views).

    **The name.** ``name`` must equal the dataflow's ``workflow:`` setting: every task the
    dataflow creates carries that name (``Task.workflow``), the RaaS runs only tasks that name its
    workflow and hands the others back, and it sends ``name`` when it registers -- the dataflow
    refuses (409) a RaaS whose workflow has another name. An empty ``name`` runs any task.

    **The sample contract** -- what the dataflow, the trainer and the eval read from the samples
    ``run`` returns (the dataflow refuses a push that breaks a checked rule with a 422 naming the
    field; the unchecked ones fail silently, hence this list):

    - ``task_id`` is ``task.task_id``; ``model_id`` one of ``task.model_ids`` (``task.n``
      episodes for each); ``sample_index`` unique per task *and* model_id -- it is the push's
      idempotency key (task, model_id, sample_index), and a repeat refuses the whole push.
    - tokens in, tokens out: ``token_ids`` is prompt + completion (+ environment turns), never
      re-tokenized text; ``logprobs`` the engine's behaviour log-prob of every generated token
      (0 elsewhere); ``loss_mask`` 1 on generated tokens only, and at least one (a sample with
      none is refused); ``versions`` the policy version of every token (the engine's
      ``Completion.versions``; -1 on prompt and environment tokens), none newer than the
      published version. At most the engine's ``max_model_len`` tokens, ids below its
      ``vocab_size`` (both registered by the RaaS: :func:`astralight.engine.engine_limits`).
    - ``reward``: a finite float. Advantages are normalised per (``model_id``, ``role``) group
      of a task. On eval tasks (``task.kind == "eval"``) avg@k is the mean reward and a sample
      counts as **correct for pass@k when reward > 0.5**
      (:data:`astralight.dataflow.evals.CORRECT_THRESHOLD`): a 0/1 reward works as is, a graded
      one must put "right" above 0.5.

    Sample metadata keys the system reads (everything else is the workflow's own):

    - ``metadata["temperature"]``: the temperature the sample was drawn at. The trainer compares
      it with its policy's ``temperature`` (behaviour log-probs are only comparable at the same
      temperature) and the dataflow with its ``temperatures`` config, refusing a mismatch;
      **without the key both checks are silently skipped** and a mismatch trains on wrong ratios.
      Always set it (:class:`Reply` carries it); 0 (greedy) only on eval tasks.
    - ``metadata["attempt"]``: an int >= 0 in a multi-step workflow, 0 on a first attempt and
      > 0 on a retry; an eval counts only first attempts as the policy's accuracy.
    - ``metadata["team_correct"]``: on the first attempts of a team workflow (solver +
      verifier), whether the team's final answer was right; when every first attempt has it the
      eval reports ``team_accuracy``.
    - ``metadata["tool_calls"]``, ``metadata["turns"]``, ``metadata["tool_errors"]`` (a dict of
      counts per error kind): an agent episode's counts (ints, at most ``MAX_METADATA_COUNT``),
      summed into the dataflow's counters and the trainer's ``agent/*`` scalars;
      ``metadata["segment"]``: the index of the sample within an episode split into several
      samples (one per model call): only segment 0 (or a sample without the key) counts the
      episode, so it is counted once; ``metadata["end"]``: how the episode ended
      (``"error"`` / ``"timeout"``: its agent failed, counted as ``agent_failed_<kind>``);
      ``metadata["env"]``: an environment episode's outcome (the environment's ``metrics()``,
      :class:`~astralight.workflows.chat_env.ChatEnvWorkflow`): its ``invalid_actions`` (the
      commands the game did not accept) becomes the trainer's ``agent/invalid_actions``.
    - ``metadata["finish_reason"]``: ``"length"`` when the engine cut the completion at
      ``max_tokens`` (the ``length`` sample filter's ``drop_truncated`` drops those groups).
    """

    name: str = ""

    async def run(self, task: Task, engines: dict[str, Any]) -> list[Sample]:
        """Run one task and return its samples (may be empty: nothing to train on).

        ``engines`` maps a key (the model_id for single-policy workflows) to an
        :class:`astralight.engine.Engine`.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement async run(task, engines)")


async def blocking(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on the running loop's executor (environment steps, tools,
    rewards): the event loop keeps stepping every other episode meanwhile."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, functools.partial(fn, *args, **kwargs))


class BlockingEngineView:
    """An engine as the synchronous workflow contract saw it: ``generate(prompts, spec) ->
    [Completion]`` blocks (on an executor thread) while the requests are in flight; every other
    attribute is the engine's."""

    def __init__(self, engine: Any):
        self.inner = engine

    def generate(self, prompt_token_ids: list[list[int]], params: Any) -> list:
        return self.inner.generate_batch(prompt_token_ids, params)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy / pickle build the object without __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)


class SyncWorkflowAdapter(Workflow):
    """Runs a synchronous workflow (``run(tasks, engines) -> dict``) one task at a time on an
    executor thread, with :class:`BlockingEngineView` engines."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.name = getattr(inner, "name", "")

    async def run(self, task: Task, engines: dict[str, Any]) -> list[Sample]:
        views = {k: BlockingEngineView(e) for k, e in engines.items()}
        out = await blocking(self.inner.run, [task], views)
        return list((out or {}).get(task.task_id, []))

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy / pickle build the object without __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)


def as_episode_runner(workflow: Any) -> Workflow:
    """``workflow`` itself when its ``run`` is ``async def run(task, engines)``, else wrapped in a
    :class:`SyncWorkflowAdapter`; TypeError naming the fix for anything without ``run``."""
    run = getattr(workflow, "run", None)
    if run is None or not callable(run):
        raise TypeError(f"workflow: {type(workflow).__name__} has no run(); implement "
                        "async def run(self, task, engines) -> list[Sample]")
    if inspect.iscoroutinefunction(run):
        return workflow
    return SyncWorkflowAdapter(workflow)


@dataclass
class Reply:
    """One request's outcome in a multi-step workflow: its prompt ids, the completion, the
    version to stamp where the engine stamped none, the decoded text, the temperature it was
    sampled at, and (when scored as it arrived) its reward."""

    ids: list[int]
    completion: Any
    version: int
    text: str
    temperature: float
    reward: float = 0.0


def tokenize_prompt(tokenizer: Any, prompt: Any, add_special_tokens: bool = False) -> list[int]:
    """Token ids of a task prompt: text, chat messages (chat template), or ready token ids.

    ``add_special_tokens`` (text prompts): the tokenizer's own special tokens, and its
    ``bos_token`` first when it has one that its post-processor does not add (many tokenizers,
    the tiny one included, define a BOS but add none; without this a user would write it into
    the prompt)."""
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        bos = getattr(tokenizer, "bos_token_id", None) if add_special_tokens else None
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, int(bos))
        return ids
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise TypeError(
        f"task.prompt: expected text, chat messages [{{role, content}}] or token ids, "
        f"got {type(prompt).__name__}"
    )


def encode_text_prompt(engine: Any, text: str, chat: bool = False,
                       add_special_tokens: bool = False) -> list[int] | None:
    """Prompt ids of ``text`` (as one user message through the chat template when ``chat``), or
    None, logged, when the prompt leaves no room in the engine's ``max_model_len``."""
    prompt = [{"role": "user", "content": text}] if chat else text
    ids = tokenize_prompt(engine.tokenizer, prompt, add_special_tokens)
    limit = getattr(engine, "max_model_len", None)
    if not ids or (limit is not None and len(ids) >= limit):
        log.warning("prompt of %d tokens does not fit max_model_len=%s: %.60r", len(ids), limit,
                    text)
        return None
    return ids


def episode_jobs(task: Task, engines: dict[str, Any]) -> list[tuple[str, Any, int]]:
    """``(model_id, engine, episode index)`` for the ``task.n`` episodes of every policy the
    task names; KeyError naming the fix for a policy this RaaS has no engine for."""
    jobs = []
    for model_id in task.model_ids:
        engine = engines.get(model_id)
        if engine is None:
            raise KeyError(f"task.model_ids: no engine for {model_id!r} (task {task.task_id}); "
                           f"this RaaS serves {sorted(engines)}")
        jobs += [(model_id, engine, g) for g in range(task.n)]
    return jobs


def check_roles(workflow: str, roles: dict[str, str], tasks: list[Task],
                engines: dict[str, Any]) -> None:
    """Every role's model id has an engine here and is named by every task (a multi-policy
    workflow emits samples for each); KeyError naming the field and the fix otherwise."""
    for role, model_id in roles.items():
        if model_id not in engines:
            raise KeyError(f"roles.{role}: no engine for model id {model_id!r}; this RaaS "
                           f"serves {sorted(engines)}")
    for task in tasks:
        absent = [m for m in roles.values() if m not in task.model_ids]
        if absent:
            raise KeyError(f"task.model_ids: task {task.task_id} lists {task.model_ids} but "
                           f"{workflow} emits samples for {absent} too; add them to the "
                           "dataflow's model_ids")
