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
dataflow and evals can report team accuracy and verdict accuracy. One lease cycle is batched
into at most three rounds of ``generate`` calls: all first attempts, then all verdicts, then all
retries (one call per engine and sampling in each round).

Default templates are the paper's math role prompts (Appendix A.9, verbatim, with
``{task_description}`` -> ``{problem}`` and ``{team_context}`` filled with the teammates'
outputs); the toy recipe passes the short character-level templates of :data:`TOY_TEMPLATES`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from astralight.protocol import Sample, Task
from astralight.raas.engine import Completion, SamplingSpec
from astralight.rewards.base import Reward
from astralight.workflows.base import (Workflow, check_roles, encode_text_prompt,
                                       generate_round)
from astralight.workflows.single_turn import SingleTurnWorkflow, completion_sample

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
#: cannot learn to compare digits, measured in astralight.tasks.warmstart); retry
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
    def sub(m: re.Match) -> str:
        if m.group(1) not in fields:
            raise KeyError(f"template: placeholder {{{m.group(1)}}} has no value here; "
                           f"this template may use {sorted('{' + k + '}' for k in fields)}")
        return fields[m.group(1)]

    return _PLACEHOLDER.sub(sub, template)


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
    """One group slot of one task: first answer, verdict, optional retry."""

    task: Task
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


class SolverVerifier(Workflow):
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
            used = set(_PLACEHOLDER.findall(tpl))
            if used - allowed:
                raise ValueError(f"{name}: may use {sorted(allowed)}, uses {sorted(used)}")
            if "problem" not in used and name != "verifier_prompt":
                log.warning("%s does not contain {problem}", name)
        self.reward = reward
        self.roles = roles
        self.sampling = sampling or SamplingSpec()
        self.eval_sampling = eval_sampling or SamplingSpec(temperature=1.0,
                                                           max_tokens=self.sampling.max_tokens)
        self.verifier_sampling = verifier_sampling or self.sampling
        self.verifier_eval_sampling = verifier_eval_sampling or SamplingSpec(
            temperature=self.eval_sampling.temperature, top_p=self.eval_sampling.top_p,
            max_tokens=self.verifier_sampling.max_tokens)
        self.templates = {"solver": solver_prompt, "verifier": verifier_prompt, "retry": retry_prompt}
        self.parser = VerdictParser(approve_pattern, reject_pattern)
        self.invalid_reward = float(invalid_reward)
        self.correct_threshold = float(correct_threshold)
        self.chat = chat
        self.add_special_tokens = add_special_tokens

    # ------------------------------------------------------------------------------ helpers

    def _sampling(self, role: str, kind: str) -> SamplingSpec:
        if role == "verifier":
            return self.verifier_eval_sampling if kind == "eval" else self.verifier_sampling
        return self.eval_sampling if kind == "eval" else self.sampling

    def _encode(self, engine: Any, text: str) -> list[int] | None:
        return encode_text_prompt(engine, text, self.chat, self.add_special_tokens)

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

    def _round(self, engines: dict[str, Any], role: str, jobs: list[tuple[Task, list[int], Any]]
               ) -> list[tuple[Any, list[int], Completion, int, SamplingSpec]]:
        """Generate for every job of one round: one call per (engine, sampling kind).

        ``jobs``: (task, prompt_ids, key). Returns (key, prompt_ids, completion, version, sampling).
        """
        model_id = self.roles[role]
        return generate_round(engines[model_id], model_id, jobs,
                              lambda kind: self._sampling(role, kind))

    # ------------------------------------------------------------------------------ run

    def run(self, tasks: list[Task], engines: dict[str, Any]) -> dict[str, list[Sample]]:
        check_roles(self.name, self.roles, tasks, engines)
        solver_id, verifier_id = self.roles["solver"], self.roles["verifier"]
        solver, verifier = engines[solver_id], engines[verifier_id]
        next_index: dict[tuple[str, str], int] = {}

        def index(task: Task, model_id: str) -> int:
            key = (task.task_id, model_id)
            next_index[key] = next_index.get(key, 0) + 1
            return next_index[key] - 1

        # round 1: every first attempt
        attempts: list[_Attempt] = []
        jobs = []
        problems = {t.task_id: self.problem_text(t) for t in tasks}
        for task in tasks:
            ids = self._encode(solver, fill_template(self.templates["solver"],
                                                     problem=problems[task.task_id]))
            if ids is None:
                continue
            for g in range(task.n):
                att = _Attempt(task, g)
                attempts.append(att)
                jobs.append((task, ids, att))
        for att, ids, comp, version, sp in self._round(engines, "solver", jobs):
            att.first_text = SingleTurnWorkflow.decode(solver.tokenizer, comp)
            reward = float(self.reward(att.first_text, att.task.metadata))
            att.first_correct = reward >= self.correct_threshold
            att.first = completion_sample(att.task, solver_id, index(att.task, solver_id), att.slot,
                                          ids, comp, version, reward, sp.temperature,
                                          role="solver", text=att.first_text)
            att.first.metadata["attempt"] = 0

        # round 2: every verdict
        jobs = []
        for att in attempts:
            ids = self._encode(verifier, fill_template(
                self.templates["verifier"], problem=problems[att.task.task_id], answer=att.first_text))
            if ids is not None:
                jobs.append((att.task, ids, att))
        for att, ids, comp, version, sp in self._round(engines, "verifier", jobs):
            att.feedback = SingleTurnWorkflow.decode(verifier.tokenizer, comp)
            att.verdict = self.parser(att.feedback)
            if att.verdict == INVALID:
                reward = self.invalid_reward
            else:
                reward = 1.0 if (att.verdict == APPROVE) == att.first_correct else 0.0
            att.verifier = completion_sample(att.task, verifier_id, index(att.task, verifier_id),
                                             att.slot, ids, comp, version, reward, sp.temperature,
                                             role="verifier", text=att.feedback)
            att.verifier.metadata["judged_correct"] = int(att.first_correct)

        # round 3: a retry for every rejected (or unparseable) answer
        jobs = []
        for att in attempts:
            if att.verdict in (REJECT, INVALID):
                ids = self._encode(solver, fill_template(
                    self.templates["retry"], problem=problems[att.task.task_id],
                    answer=att.first_text, feedback=att.feedback))
                if ids is not None:
                    jobs.append((att.task, ids, att))
        for att, ids, comp, version, sp in self._round(engines, "solver", jobs):
            text = SingleTurnWorkflow.decode(solver.tokenizer, comp)
            reward = float(self.reward(text, att.task.metadata))
            att.retry_correct = reward >= self.correct_threshold
            att.retry = completion_sample(att.task, solver_id, index(att.task, solver_id), att.slot,
                                          ids, comp, version, reward, sp.temperature,
                                          role="solver", text=text)
            att.retry.metadata["attempt"] = 1

        results: dict[str, list[Sample]] = {t.task_id: [] for t in tasks}
        for att in attempts:
            team = int(att.team_correct)
            for s in (att.first, att.verifier, att.retry):
                if s is None:
                    continue
                s.metadata.update({"verdict": att.verdict, "team_correct": team, "slot": att.slot})
                results[att.task.task_id].append(s)
        for samples in results.values():
            samples.sort(key=lambda s: (s.model_id != solver_id, s.sample_index))
        return results
