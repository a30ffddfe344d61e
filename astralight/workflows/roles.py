"""Rounds of role requests: what the two-role text workflows (solver/verifier, solver/test
generator) share.

Both fill text templates, encode them for the role's engine, and run *rounds*: every prompt of
one role in flight at once, each reply decoded (EOS stripped) and stamped with the engine version
that produced it, then turned into a sample of the role's model id with the next sample index of
that id. :class:`RoleRounds` holds that once. The solver samples with ``sampling`` /
``eval_sampling`` (train / eval tasks), any other role ``R`` with ``R_sampling`` /
``R_eval_sampling`` (:func:`role_samplings` fills the defaults).
"""

from __future__ import annotations

import re
from typing import Any, Awaitable, Callable, Iterator

from astralight.engine import SamplingSpec, gather_all
from astralight.protocol import Sample, Task
from astralight.workflows.base import Reply, Workflow, encode_text_prompt
from astralight.workflows.single_turn import SingleTurnWorkflow, completion_sample

#: the next sample index of each model id within one task (``defaultdict(count)``): roles that
#: share a model id share one sequence, so indices stay unique
Indices = dict[str, Iterator[int]]
#: awaited on each reply as soon as it arrives (score it, run its program...)
AfterReply = Callable[[Reply], Awaitable[None]]


def fill_placeholders(pattern: re.Pattern, template: str, fields: dict[str, str]) -> str:
    """``template`` with every placeholder ``pattern`` matches (group 1: its name) replaced from
    ``fields``; a placeholder with no value is a KeyError naming those this template may use.

    Not ``str.format``: real prompts contain literal braces (``\\boxed{}``) that must survive.
    """
    def sub(m: re.Match) -> str:
        if m.group(1) not in fields:
            raise KeyError(f"template: placeholder {{{m.group(1)}}} has no value here; this "
                           f"template may use {sorted('{' + k + '}' for k in fields)}")
        return fields[m.group(1)]

    return pattern.sub(sub, template)


def template_placeholders(pattern: re.Pattern, name: str, template: str,
                          allowed: set[str]) -> set[str]:
    """The placeholders ``template`` (the argument ``name``) uses; ValueError when it uses one
    outside ``allowed``."""
    used = set(pattern.findall(template))
    if used - allowed:
        raise ValueError(f"{name}: may use {sorted(allowed)}, uses {sorted(used)}")
    return used


def role_samplings(sampling: SamplingSpec, eval_sampling: SamplingSpec | None,
                   other: SamplingSpec | None, other_eval: SamplingSpec | None
                   ) -> tuple[SamplingSpec, SamplingSpec, SamplingSpec, SamplingSpec]:
    """``(sampling, eval_sampling, other, other_eval)`` with the defaults filled in: the solver
    evaluates at temperature 1.0 with its own token budget; the other role trains with the
    solver's sampling and evaluates at the solver's eval temperature and top-p with its own
    budget."""
    eval_sampling = eval_sampling or SamplingSpec(temperature=1.0, max_tokens=sampling.max_tokens)
    other = other or sampling
    other_eval = other_eval or SamplingSpec(temperature=eval_sampling.temperature,
                                            top_p=eval_sampling.top_p, max_tokens=other.max_tokens)
    return sampling, eval_sampling, other, other_eval


class RoleRounds(Workflow):
    """A workflow of roles (``roles``: role -> model id) that answer filled text templates in
    rounds; subclasses set ``roles``, the samplings (module docstring), ``chat`` and
    ``add_special_tokens``."""

    roles: dict[str, str]
    chat: bool = False
    add_special_tokens: bool = False

    def _sampling(self, role: str, kind: str) -> SamplingSpec:
        """The sampling of ``role`` for a task of ``kind`` (eval tasks use the eval specs)."""
        prefix = "" if role == "solver" else f"{role}_"
        return getattr(self, f"{prefix}eval_sampling" if kind == "eval" else f"{prefix}sampling")

    def _encode(self, engine: Any, text: str) -> list[int] | None:
        """Prompt ids of a filled template, or None when it does not fit the engine."""
        return encode_text_prompt(engine, text, self.chat, self.add_special_tokens)

    @staticmethod
    async def _ask(engine: Any, ids: list[int], spec: SamplingSpec,
                   then: AfterReply | None = None) -> Reply:
        """One request: generate and decode (EOS stripped); ``then(reply)``, if given, is
        awaited as soon as this reply arrives."""
        version = int(engine.version)
        comp = await engine.generate(ids, spec)
        reply = Reply(ids, comp, version, SingleTurnWorkflow.decode(engine.tokenizer, comp),
                      spec.temperature)
        if then is not None:
            await then(reply)
        return reply

    async def _round(self, engines: dict[str, Any], role: str, task: Task,
                     prompts: list[list[int]], then: AfterReply | None = None) -> list[Reply]:
        """Every prompt of one round of ``role`` in flight at once, replies in prompt order;
        request ``i`` samples with ``spec.for_request(i, task_id)`` (its own seed when seeded)."""
        engine = engines[self.roles[role]]
        spec = self._sampling(role, task.kind)
        return list(await gather_all(*(self._ask(engine, ids, spec.for_request(i, task.task_id),
                                                 then)
                                           for i, ids in enumerate(prompts))))

    def _sample(self, task: Task, role: str, index: Indices, slot: int, reply: Reply,
                reward: float = 0.0) -> Sample:
        """The sample of one reply of ``role`` (its model id, the next index of that id)."""
        model_id = self.roles[role]
        return completion_sample(task, model_id, next(index[model_id]), slot, reply.ids,
                                 reply.completion, reply.version, reward, reply.temperature,
                                 role=role, text=reply.text)

    def _fitting(self, role: str, engines: dict[str, Any],
                 prompts: list[tuple[Any, str]]) -> list[tuple[Any, list[int]]]:
        """``(item, prompt ids)`` of the ``(item, text)`` pairs whose text fits ``role``'s
        engine, in order (a prompt that does not fit drops its step)."""
        engine = engines[self.roles[role]]
        jobs = []
        for item, text in prompts:
            ids = self._encode(engine, text)
            if ids is not None:
                jobs.append((item, ids))
        return jobs


__all__ = ["AfterReply", "Indices", "RoleRounds", "fill_placeholders", "role_samplings",
           "template_placeholders"]
