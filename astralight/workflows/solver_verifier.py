"""Solver + verifier: two policies that solve one problem together (AstraFlow Section 4.1).

Per task the solver answers ``task.n`` times; for each answer the verifier reads the problem and
the answer and emits a verdict (approve / reject, parsed from a tag); on a rejection the solver
retries once with the verifier's text in its context. The team answer is the retry's answer when
the first one was rejected, else the first answer.

Rewards (each role's samples carry their own, and their own ``model_id``, so each policy's trainer
learns only from its own tokens):

- solver samples (first attempts and retries): the configured :class:`Reward` of the sample's
  own answer (correctness against ``task.metadata``);
- verifier samples: 1 if the verdict was right (approve a correct answer, reject a wrong one),
  else 0; a verdict that matches neither pattern counts as a rejection for the flow (the solver
  retries) and earns ``invalid_reward`` (0 by default), so a verifier is never paid for noise.

Every sample's metadata holds ``verdict`` and ``team_correct`` (0/1) of its attempt chain, so the
dataflow and evals can report team accuracy and verdict accuracy. One task runs as at most three
rounds: its ``n`` first attempts in flight at once, then their verdicts, then the retries; each
reply is decoded and scored as it arrives. Every leased task is its own episode, so the engines
batch the requests of all tasks in flight (a task in its retry round shares an engine step with
another's first attempts).

Default templates are the paper's math role prompts (Appendix A.9, verbatim, with
``{task_description}`` -> ``{problem}`` and ``{team_context}`` filled with the teammates'
outputs); the toy recipe passes the short character-level templates of :data:`TOY_TEMPLATES`.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from itertools import count
from typing import Any

from astralight.engine import SamplingSpec
from astralight.protocol import Sample, Task
from astralight.rewards.base import Reward
from astralight.workflows.base import Reply, blocking, check_roles
from astralight.workflows.roles import (AfterReply, Indices, RoleRounds, fill_placeholders,
                                        role_samplings, template_placeholders)

log = logging.getLogger(__name__)

APPROVE, REJECT, INVALID = "approve", "reject", "invalid"

# -- the paper's role prompts (AstraFlow, Appendix A.9 "Multi-Agent Solver/Actor Prompt (Math)"
#    and "Multi-Agent Verifier Prompt (Math)"), verbatim except for the placeholder names; the
#    paper fills {team_context} with the teammates' outputs so far, here "None yet." on the first
#    attempt, the solver's answer for the verifier, answer + verdict text for the retry.
_PAPER_INTRO = (
    "# Task Introduction\n"
    "You are a member of an expert multi-agent team tasked with solving the math problem. "
    "The team\u2019s math problem is: {problem}\n\n"
    "# Your Teammates\u2019 Outputs\n"
)
_PAPER_SOLVER_ROLE = (
    "# Your Role\n"
    "You are a \u201cSolver Agent\u201d. Your job is to carefully reason through the math problem "
    "step by step and derive the correct answer. When reasoning, consider your teammates\u2019 "
    "outputs if available. Put the final answer in \\boxed{}."
)
PAPER_SOLVER_PROMPT = _PAPER_INTRO + "None yet.\n\n" + _PAPER_SOLVER_ROLE
PAPER_VERIFIER_PROMPT = (
    _PAPER_INTRO + "Solver Agent:\n{answer}\n\n"
    "# Your Role\n"
    "You are a \u201cVerifier Agent\u201d. Your responsibility is to critically review the most "
    "recent solution provided by the \u201cSolver Agent\u201d. First, carefully examine each "
    "reasoning step, formula, and conclusion for accuracy, completeness, and logical consistency. "
    "Explain your analysis in detail. After completing your analysis, at the very end of your "
    "output, you MUST provide your final verdict within <verify> </verify> using exactly one of: "
    "(1) <verify>approve</verify> if all steps and the final answer are correct. "
    "(2) <verify>reject</verify> if you detect any issue. Important: Do NOT output your verdict "
    "until you have finished your full analysis."
)
PAPER_RETRY_PROMPT = (
    _PAPER_INTRO + "Solver Agent:\n{answer}\n\nVerifier Agent:\n{feedback}\n\n" + _PAPER_SOLVER_ROLE
)
PAPER_APPROVE_PATTERN = r"<verify>\s*approve\s*</verify>"
PAPER_REJECT_PATTERN = r"<verify>\s*reject\s*</verify>"

#: character-level templates for the toy task (every character is in the tiny tokenizer and a
#: whole retry prompt for two-digit operands is ~20 tokens, far inside max_model_len 64):
#: solver "37+45=" -> "81"; verifier "37+45=81?" -> its own sum, then the verdict letter: "82N"
#: (the toy verifier "shows its work" like the paper's: a 2-layer model judging with a bare Y/N
#: cannot learn to compare digits, measured in astralight.tasks.solver_verifier_warmstart); retry
#: "37+45=81?82N;37+45=" -> "82". A verdict is exactly [-]digits then Y or N; anything else is
#: invalid (reward 0, the solver retries).
TOY_TEMPLATES = {
    "solver_prompt": "{problem}",
    "verifier_prompt": "{problem}{answer}?",
    "retry_prompt": "{problem}{answer}?{feedback};{problem}",
    "approve_pattern": r"^\s*-?\d*Y\s*$",
    "reject_pattern": r"^\s*-?\d*N\s*$",
}

_PLACEHOLDER = re.compile(r"\{(problem|answer|feedback)\}")


def fill_template(template: str, **fields: str) -> str:
    """Substitute ``{problem}``, ``{answer}``, ``{feedback}`` only.

    Not ``str.format``: real prompts contain literal braces (``\\boxed{}``) that must survive.
    """
    return fill_placeholders(_PLACEHOLDER, template, fields)


class VerdictParser:
    """``text -> "approve" | "reject" | "invalid"`` from two regexes (``re.search``).

    When both patterns match, the later match wins (the paper's verifier reasons first and puts
    its verdict at the very end, so an earlier quote of the other tag is not the verdict). When
    neither matches the verdict is ``"invalid"``: the workflow treats it as a rejection and the
    verifier sample earns ``invalid_reward``.
    """

    def __init__(self, approve_pattern: str = PAPER_APPROVE_PATTERN,
                 reject_pattern: str = PAPER_REJECT_PATTERN, ignore_case: bool = True):
        flags = re.IGNORECASE if ignore_case else 0
        try:
            self.approve = re.compile(approve_pattern, flags)
        except re.error as exc:
            raise ValueError(f"approve_pattern: not a valid regex ({exc})") from None
        try:
            self.reject = re.compile(reject_pattern, flags)
        except re.error as exc:
            raise ValueError(f"reject_pattern: not a valid regex ({exc})") from None

    def __call__(self, text: str) -> str:
        last_a = [m.start() for m in self.approve.finditer(text)]
        last_r = [m.start() for m in self.reject.finditer(text)]
        if not last_a and not last_r:
            return INVALID
        if not last_r:
            return APPROVE
        if not last_a:
            return REJECT
        return APPROVE if last_a[-1] > last_r[-1] else REJECT




@dataclass
class _Attempt:
    """One group slot of the task: first answer, verdict, optional retry."""

    slot: int
    first: Sample | None = None
    first_text: str = ""
    first_correct: bool = False
    verifier: Sample | None = None
    verdict: str = "unverified"  # approve | reject | invalid | unverified (prompt did not fit)
    feedback: str = ""
    retry: Sample | None = None
    retry_correct: bool = False

    @property
    def team_correct(self) -> bool:
        if self.verdict in (REJECT, INVALID) and self.retry is not None:
            return self.retry_correct
        return self.first_correct


class SolverVerifier(RoleRounds):
    """The solver-verifier workflow (``Task.workflow == "solver_verifier"``).

    Args:
        reward: scores a solver answer (decoded, EOS stripped) against ``task.metadata``.
        roles: ``{"solver": model_id, "verifier": model_id}``; engines are keyed by model id.
            Both may name the same model id (one policy playing both roles).
        sampling / eval_sampling: the solver's sampling for train / eval tasks.
        verifier_sampling / verifier_eval_sampling: the verifier's (default: the solver's).
        solver_prompt: template of the first attempt; ``{problem}`` is the task prompt text.
        verifier_prompt: template with ``{problem}`` and ``{answer}`` (the solver's text).
        retry_prompt: template with ``{problem}``, ``{answer}`` and ``{feedback}`` (the verifier's
            text, EOS stripped).
        approve_pattern / reject_pattern: regexes for :class:`VerdictParser`.
        invalid_reward: verifier reward when neither pattern matches (the defined fallback).
        correct_threshold: a solver answer counts as correct when its reward is >= this.
        chat: wrap each filled template as one user message and apply the engine's chat template
            (real models); False tokenizes the text as is (the char-level toy).
        add_special_tokens: passed to the tokenizer for plain-text prompts.
    """

    name = "solver_verifier"

    def __init__(self, reward: Reward, roles: dict[str, str] | None = None,
                 sampling: SamplingSpec | None = None, eval_sampling: SamplingSpec | None = None,
                 verifier_sampling: SamplingSpec | None = None,
                 verifier_eval_sampling: SamplingSpec | None = None,
                 solver_prompt: str = PAPER_SOLVER_PROMPT,
                 verifier_prompt: str = PAPER_VERIFIER_PROMPT,
                 retry_prompt: str = PAPER_RETRY_PROMPT,
                 approve_pattern: str = PAPER_APPROVE_PATTERN,
                 reject_pattern: str = PAPER_REJECT_PATTERN,
                 invalid_reward: float = 0.0, correct_threshold: float = 1.0,
                 chat: bool = False, add_special_tokens: bool = False):
        if not callable(reward):
            raise TypeError(f"reward: expected a Reward, got {type(reward).__name__}")
        roles = dict(roles or {"solver": "solver", "verifier": "verifier"})
        missing = {"solver", "verifier"} - set(roles)
        if missing or not all(isinstance(v, str) and v for v in roles.values()):
            raise ValueError(f"roles: need non-empty model ids for 'solver' and 'verifier', got {roles}")
        for name, tpl, allowed in (("solver_prompt", solver_prompt, {"problem"}),
                                   ("verifier_prompt", verifier_prompt, {"problem", "answer"}),
                                   ("retry_prompt", retry_prompt, {"problem", "answer", "feedback"})):
            used = template_placeholders(_PLACEHOLDER, name, tpl, allowed)
            if "problem" not in used and name != "verifier_prompt":
                log.warning("%s does not contain {problem}", name)
        self.reward = reward
        self.roles = roles
        (self.sampling, self.eval_sampling, self.verifier_sampling,
         self.verifier_eval_sampling) = role_samplings(sampling or SamplingSpec(), eval_sampling,
                                                       verifier_sampling, verifier_eval_sampling)
        self.templates = {"solver": solver_prompt, "verifier": verifier_prompt, "retry": retry_prompt}
        self.parser = VerdictParser(approve_pattern, reject_pattern)
        self.invalid_reward = float(invalid_reward)
        self.correct_threshold = float(correct_threshold)
        self.chat = chat
        self.add_special_tokens = add_special_tokens

    # ------------------------------------------------------------------------------ helpers

    @staticmethod
    def problem_text(task: Task) -> str:
        """The ``{problem}`` text: the prompt, or the user turns of chat messages joined."""
        prompt = task.prompt
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return "\n\n".join(str(m.get("content", "")) for m in prompt if m.get("role") == "user")
        raise TypeError(f"task.prompt: solver_verifier needs text or chat messages, "
                        f"got {type(task.prompt).__name__} (task {task.task_id})")

    async def _score(self, text: str, metadata: dict) -> float:
        """The solver reward of one answer; on an executor thread unless the reward is cheap
        (``reward.cheap``), so a reward that runs a verifier never blocks other episodes."""
        if getattr(self.reward, "cheap", False):
            return float(self.reward(text, metadata))
        return float(await blocking(self.reward, text, metadata))

    def _scorer(self, metadata: dict) -> AfterReply:
        """What a solver round does with each answer as soon as it arrives: score it against
        ``metadata`` with the solver reward (``reply.reward``)."""
        async def score(reply: Reply) -> None:
            reply.reward = await self._score(reply.text, metadata)

        return score

    # ------------------------------------------------------------------------------ run

    async def run(self, task: Task, engines: dict[str, Any]) -> list[Sample]:
        """The task's samples: first attempts, verdicts, retries (solver samples first, each
        role by sample index). A prompt that does not fit its engine drops that step."""
        check_roles(self.name, self.roles, [task], engines)
        problem = self.problem_text(task)
        index: Indices = defaultdict(count)
        attempts = await self._first_attempts(task, problem, engines, index)
        await self._verdicts(task, problem, attempts, engines, index)
        await self._retries(task, problem, attempts, engines, index)
        return self._collect(attempts)

    async def _first_attempts(self, task: Task, problem: str, engines: dict[str, Any],
                              index: Indices) -> list[_Attempt]:
        """Round 1: the task's ``n`` answers to the solver prompt, each scored."""
        solver = engines[self.roles["solver"]]
        ids = self._encode(solver, fill_template(self.templates["solver"], problem=problem))
        if ids is None:
            return []
        attempts = [_Attempt(g) for g in range(task.n)]
        replies = await self._round(engines, "solver", task, [ids] * task.n,
                                    then=self._scorer(task.metadata))
        for att, reply in zip(attempts, replies):
            att.first_text = reply.text
            att.first_correct = reply.reward >= self.correct_threshold
            att.first = self._sample(task, "solver", index, att.slot, reply, reply.reward)
            att.first.metadata["attempt"] = 0
        return attempts

    def _verdict_reward(self, verdict: str, judged_correct: bool) -> float:
        """1 for a right verdict, 0 for a wrong one, ``invalid_reward`` for no verdict."""
        if verdict == INVALID:
            return self.invalid_reward
        return 1.0 if (verdict == APPROVE) == judged_correct else 0.0

    async def _verdicts(self, task: Task, problem: str, attempts: list[_Attempt],
                        engines: dict[str, Any], index: Indices) -> None:
        """Round 2: the verifier judges every first answer (verdict parsing is a regex search:
        cheap, on the loop)."""
        jobs = self._fitting("verifier", engines, [
            (att, fill_template(self.templates["verifier"], problem=problem, answer=att.first_text))
            for att in attempts])
        replies = await self._round(engines, "verifier", task, [ids for _, ids in jobs])
        for (att, _), reply in zip(jobs, replies):
            att.feedback = reply.text
            att.verdict = self.parser(att.feedback)
            reward = self._verdict_reward(att.verdict, att.first_correct)
            att.verifier = self._sample(task, "verifier", index, att.slot, reply, reward)
            att.verifier.metadata["judged_correct"] = int(att.first_correct)

    async def _retries(self, task: Task, problem: str, attempts: list[_Attempt],
                       engines: dict[str, Any], index: Indices) -> None:
        """Round 3: one retry, with the verifier's text in context, for every rejected (or
        unparseable) answer, each scored."""
        jobs = self._fitting("solver", engines, [
            (att, fill_template(self.templates["retry"], problem=problem, answer=att.first_text,
                                feedback=att.feedback))
            for att in attempts if att.verdict in (REJECT, INVALID)])
        replies = await self._round(engines, "solver", task, [ids for _, ids in jobs],
                                    then=self._scorer(task.metadata))
        for (att, _), reply in zip(jobs, replies):
            att.retry_correct = reply.reward >= self.correct_threshold
            att.retry = self._sample(task, "solver", index, att.slot, reply, reply.reward)
            att.retry.metadata["attempt"] = 1

    def _collect(self, attempts: list[_Attempt]) -> list[Sample]:
        """Every sample tagged with its chain's verdict, team outcome and slot; solver samples
        first, each model id by sample index."""
        out = []
        for att in attempts:
            team = int(att.team_correct)
            for s in (att.first, att.verifier, att.retry):
                if s is not None:
                    s.metadata.update({"verdict": att.verdict, "team_correct": team,
                                       "slot": att.slot})
                    out.append(s)
        solver_id = self.roles["solver"]
        out.sort(key=lambda s: (s.model_id != solver_id, s.sample_index))
        return out

