"""Single-turn workflow: prompt in, ``n`` completions out per policy, each scored by a reward."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from astralight.engine import Completion, SamplingSpec, gather_all
from astralight.protocol import Sample, Task
from astralight.rewards.base import Reward
from astralight.workflows.base import Workflow, blocking, tokenize_prompt

log = logging.getLogger(__name__)


def completion_sample(task: Task, model_id: str, sample_index: int, group_index: int,
                      prompt_ids: list[int], completion: Completion, version: int, reward: float,
                      temperature: float, role: str = "", text: str | None = None) -> Sample:
    """A :class:`Sample` for prompt + one completion, arrays laid out per the protocol.

    Per token of ``prompt_ids + completion.token_ids``: log-prob 0 / mask 0 / version -1 on the
    prompt; the behaviour log-prob / mask 1 / the version that sampled it on generated tokens
    (the EOS token included: emitting it is an action the policy is trained on). ``version`` is
    used for tokens of an engine that stamps no per-token versions.
    """
    p, c = len(prompt_ids), len(completion.token_ids)
    metadata = {"temperature": float(temperature), "finish_reason": completion.finish_reason}
    if text is not None:
        metadata["completion"] = text
    return Sample(
        task_id=task.task_id,
        sample_index=sample_index,
        model_id=model_id,
        token_ids=np.asarray(list(prompt_ids) + list(completion.token_ids), dtype=np.int32),
        logprobs=np.concatenate([np.zeros(p, np.float32),
                                 np.asarray(completion.logprobs, dtype=np.float32)]),
        loss_mask=np.concatenate([np.zeros(p, np.uint8), np.ones(c, np.uint8)]),
        versions=np.concatenate([np.full(p, -1, np.int32),
                                 np.asarray(completion.token_versions(version), dtype=np.int32)]),
        reward=float(reward),
        prompt_len=p,
        group_index=group_index,
        role=role,
        metadata=metadata,
    )


class SingleTurnWorkflow(Workflow):
    """Each task: ``task.n`` samples from the engine of every model id in ``task.model_ids``.

    Args:
        reward: scores the decoded completion (EOS stripped) against ``task.metadata``.
        sampling: sampling for train tasks.
        eval_sampling: sampling for eval tasks (``task.kind == "eval"``); temperature 1.0 by default
            so avg@k / pass@k measure the policy that is trained.
        roles: optional ``{role: model_id}``; a sample of that model id is tagged with the role
            (multi-policy workflows look engines up by role; here engines are keyed by model id).
        add_special_tokens: let the tokenizer add BOS etc. when tokenizing text prompts.

    All ``n`` completions of a task (for every policy) are in flight at once; the reward runs
    on an executor thread as each completion arrives.
    """

    name = "single_turn"

    def __init__(self, reward: Reward, sampling: SamplingSpec | None = None,
                 eval_sampling: SamplingSpec | None = None, roles: dict[str, str] | None = None,
                 add_special_tokens: bool = False):
        if not callable(reward):
            raise TypeError(f"reward: expected a Reward, got {type(reward).__name__}")
        self.reward = reward
        self.sampling = sampling or SamplingSpec()
        self.eval_sampling = eval_sampling or SamplingSpec(temperature=1.0,
                                                           max_tokens=self.sampling.max_tokens)
        self.roles = dict(roles or {})
        self.role_of = {mid: role for role, mid in self.roles.items()}
        self.add_special_tokens = add_special_tokens

    async def run(self, task: Task, engines: dict[str, Any]) -> list[Sample]:
        sampling = self.eval_sampling if task.kind == "eval" else self.sampling
        jobs = []  # (model_id, engine, sample_index, group_index, prompt_ids)
        next_index = 0
        for model_id in task.model_ids:
            engine = engines.get(model_id)
            if engine is None:
                raise KeyError(f"task.model_ids: no engine for {model_id!r} "
                               f"(task {task.task_id}); this RaaS serves {sorted(engines)}")
            prompt_ids = tokenize_prompt(engine.tokenizer, task.prompt, self.add_special_tokens)
            limit = getattr(engine, "max_model_len", None)
            if not prompt_ids or (limit is not None and len(prompt_ids) >= limit):
                log.warning("task %s: prompt of %d tokens does not fit max_model_len=%s; "
                            "no samples", task.task_id, len(prompt_ids), limit)
                next_index += task.n
                continue
            for g in range(task.n):
                jobs.append((model_id, engine, next_index, g, prompt_ids))
                next_index += 1

        async def one(model_id, engine, index, g, prompt_ids) -> Sample:
            version = int(engine.version)
            comp = await engine.generate(prompt_ids, sampling.for_request(g, task.task_id))
            text = self.decode(engine.tokenizer, comp)
            reward = float(await self.score(text, task.metadata))
            return completion_sample(task, model_id, index, g, prompt_ids, comp, version, reward,
                                     sampling.temperature, role=self.role_of.get(model_id, ""),
                                     text=text)

        samples = await gather_all(*(one(*job) for job in jobs))
        return sorted(samples, key=lambda s: s.sample_index)

    async def score(self, text: str, metadata: dict) -> float:
        """The reward of one completion; on an executor thread unless the reward says it is
        cheap (``reward.cheap = True``: exact match and other pure-Python checks)."""
        if getattr(self.reward, "cheap", False):
            return float(self.reward(text, metadata))
        return float(await blocking(self.reward, text, metadata))

    @staticmethod
    def decode(tokenizer: Any, completion: Completion) -> str:
        """Completion text without the final EOS / stop token (what the reward sees)."""
        ids = list(completion.token_ids)
        if completion.finish_reason == "stop" and ids:
            ids = ids[:-1]
        return tokenizer.decode(ids, skip_special_tokens=True)
