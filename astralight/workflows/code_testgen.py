"""Code solver + test generator: two policies that write a program and its tests together.

Per task (``task.metadata``: ``problem`` text, ``hidden_tests`` ``[{input, output}]``, optional
``reference`` program):

1. the **solver** writes ``task.n`` programs, the **test generator** ``task.n`` test suites (all
   ``2 * task.n`` requests in flight at once);
2. every generated suite is parsed (format below) and judged **valid** or not; the union of the
   valid suites' cases is the **feedback suite**;
3. every solver program runs against the feedback suite in the sandbox
   (:mod:`astralight.rewards.sandbox`); a program that fails a case is **retried once**: another
   solver sample whose prompt holds the first attempt's full text and up to
   ``max_failures_shown`` failing cases (input, expected, what the program printed); prompt tokens
   are masked out of the loss as for every sample;
4. every solver program (first attempts and retries) runs against the hidden tests.

Each leased task is its own episode: the engines batch the requests of every task in flight, and
every sandboxed program runs on the workflow's sandbox threads (``sandbox_workers`` of them,
shared by all tasks), never on the event loop.

Rewards (each sample carries its own role, model_id and reward):

- **solver** samples, first attempts and retries alike: the share of hidden tests their own
  program passes (``solver_reward="fraction"``) or 1/0 for passing all (``"all_pass"``).
- **testgen** samples: ``0`` when the suite is invalid, else
  ``(1 - diagnostic_weight) + diagnostic_weight * catch_rate``, where
  - *valid*: at least one case parsed, and — with a ``reference`` — the reference passes every
    case; without one, every first-attempt program that passes all hidden tests (a known-correct
    program) passes every case; with neither, any parsed suite counts as valid (nothing can
    judge it);
  - *catch_rate*: of this task's first-attempt programs that fail a hidden test (known-wrong
    programs), the share that also fail at least one case of the suite — the suite is
    *diagnostic* when it tells wrong programs from right ones; ``1.0`` when every program was
    right (there was nothing to catch, so validity is all that can be judged).

A program "passes" a case when it exits 0 within the limits and its stdout equals the expected
output after stripping (:func:`astralight.rewards.code.outputs_match`). With an empty feedback
suite no program is retried (nothing is known to fail).

**Test-generator output format** (stated in the default prompt), either

- one case per line: ``input: <stdin> ||| output: <expected stdout>``, where ``\\n`` inside a
  field is a line break (``\\t`` a tab, ``\\\\`` a backslash); list markers (``-``, ``1.``) before
  ``input:`` are allowed and other lines are ignored; or
- a JSON list ``[{"input": "...", "output": "..."}, ...]`` (optionally in a ```json block).

A non-empty input without a final newline gets one (programs read lines). At most ``max_tests``
distinct cases are kept per suite.

Templates are plain text with placeholders (not ``str.format``: literal braces survive):
solver ``{problem}``; retry ``{problem}``, ``{prompt}`` (the filled solver prompt),
``{attempt}`` (the first attempt's text), ``{failures}`` (the rendered failing cases); testgen
``{problem}``; one failing case ``{input}``, ``{expected}``, ``{got}``, ``{status}``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from astralight.engine import SamplingSpec, gather_all
from astralight.protocol import Sample, Task
from astralight.rewards.code import extract_code, judge, validate_tests
from astralight.rewards.sandbox import SandboxResult, run_program
from astralight.workflows.base import Reply, check_roles
from astralight.workflows.roles import (Indices, RoleRounds, fill_placeholders, role_samplings,
                                        template_placeholders)

log = logging.getLogger(__name__)

DEFAULT_SOLVER_PROMPT = (
    "Solve the programming problem below with a Python 3 program that reads its input from "
    "standard input and prints the answer to standard output. Reply with the complete program "
    "in one ```python code block.\n\nProblem:\n{problem}\n"
)
DEFAULT_RETRY_PROMPT = (
    "{prompt}\nYour previous answer was:\n{attempt}\n\nIts program failed these tests:\n"
    "{failures}\nFix the program. Reply with the complete corrected program in one ```python "
    "code block.\n"
)
DEFAULT_TESTGEN_PROMPT = (
    "Write test cases for the programming problem below. Write one test per line, in exactly "
    "this form:\ninput: <the program's standard input> ||| output: <the expected standard "
    "output>\nWrite \\n for a line break inside a field. Give 3 to 8 tests, including edge "
    "cases, and make sure every expected output is correct.\n\nProblem:\n{problem}\n"
)
DEFAULT_FAILURE_FORMAT = (
    "input:\n{input}\nexpected output:\n{expected}\nprogram output ({status}):\n{got}\n"
)

_TEMPLATE_FIELDS = {
    "solver_prompt": {"problem"},
    "retry_prompt": {"problem", "prompt", "attempt", "failures"},
    "testgen_prompt": {"problem"},
    "failure_format": {"input", "expected", "got", "status"},
}
_PLACEHOLDER = re.compile(r"\{(problem|prompt|attempt|failures|input|expected|got|status)\}")


def fill(template: str, **fields: str) -> str:
    """Substitute the known ``{placeholders}`` only; other braces are left alone."""
    return fill_placeholders(_PLACEHOLDER, template, fields)


# ------------------------------------------------------------------------------ test parsing

_LINE = re.compile(
    r"^\s*(?:[-*]\s*|\d+[.)]\s*)?input\s*:\s?(.*?)\s*\|\|\|\s*output\s*:\s?(.*?)\s*$",
    re.IGNORECASE)
_ESCAPE = re.compile(r"\\(.)")
_JSON_BLOCK = re.compile(r"```json[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def _unescape(s: str) -> str:
    return _ESCAPE.sub(lambda m: {"n": "\n", "t": "\t", "\\": "\\"}.get(m.group(1),
                                                                     "\\" + m.group(1)), s)


def _case(inp: Any, out: Any) -> dict | None:
    if isinstance(inp, (int, float)) and not isinstance(inp, bool):
        inp = str(inp)
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        out = str(out)
    if not isinstance(inp, str) or not isinstance(out, str):
        return None
    if inp and not inp.endswith("\n"):
        inp += "\n"
    return {"input": inp, "output": out}


def _parse_json(text: str) -> list[dict]:
    candidates = _JSON_BLOCK.findall(text)
    if "[" in text and "]" in text:
        candidates.append(text[text.index("["):text.rindex("]") + 1])
    for c in candidates:
        try:
            data = json.loads(c)
        except ValueError:
            continue
        if isinstance(data, list):
            cases = [_case(d.get("input"), d.get("output")) for d in data if isinstance(d, dict)]
            cases = [c for c in cases if c is not None]
            if cases:
                return cases
    return []


def parse_tests(text: str, max_tests: int | None = None) -> list[dict]:
    """Test cases written by the test generator (format in the module docstring), de-duplicated,
    at most ``max_tests``; ``[]`` when nothing parses."""
    cases = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            cases.append(_case(_unescape(m.group(1)), _unescape(m.group(2))))
    if not cases:
        cases = _parse_json(text)
    seen, out = set(), []
    for c in cases:
        key = (c["input"], c["output"])
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out[:max_tests] if max_tests is not None else out


# ------------------------------------------------------------------------------ state


@dataclass
class _Attempt:
    task: "_TaskState"
    slot: int
    text: str = ""
    code: str = ""
    sample: Sample | None = None
    hidden_passed: int = 0
    failing: list[dict] = field(default_factory=list)  # feedback cases it fails
    retry: Sample | None = None
    retry_code: str = ""
    retry_hidden_passed: int = 0
    retry_skipped: bool = False

    @property
    def correct(self) -> bool:
        return self.hidden_passed == len(self.task.hidden)

    @property
    def team_correct(self) -> bool:
        if self.retry is not None:
            return self.retry_hidden_passed == len(self.task.hidden)
        return self.correct


@dataclass
class _Suite:
    slot: int
    text: str = ""
    tests: list[dict] = field(default_factory=list)
    sample: Sample | None = None
    valid: bool = False
    reason: str = ""
    catch_rate: float = 0.0


@dataclass
class _TaskState:
    task: Task
    problem: str
    hidden: list[dict]
    reference: str | None
    solver_prompt: str = ""
    attempts: list[_Attempt] = field(default_factory=list)
    suites: list[_Suite] = field(default_factory=list)
    feedback: list[dict] = field(default_factory=list)


class _Executions:
    """Sandboxed runs of one task, memoized by (program, stdin), each on a thread of ``pool``
    (the thread waits on the child process; the event loop never does)."""

    def __init__(self, limits: dict, pool: ThreadPoolExecutor):
        self.limits = limits
        self.pool = pool
        self.runs: dict[tuple[str, str], asyncio.Future] = {}

    async def run(self, pairs) -> None:
        """Run every (program, stdin) pair not run yet, all at once; return when all of
        ``pairs`` have results (a pair already running is awaited, not run twice)."""
        loop = asyncio.get_running_loop()
        wanted = list(dict.fromkeys(pairs))
        for code, stdin in wanted:
            if (code, stdin) not in self.runs:
                self.runs[(code, stdin)] = loop.run_in_executor(
                    self.pool, functools.partial(run_program, code, stdin, **self.limits))
        if wanted:
            await asyncio.gather(*(self.runs[p] for p in wanted))

    def passes(self, code: str, case: dict) -> bool:
        """Whether ``code`` printed ``case``'s expected output (the run must be done)."""
        return judge(self.result(code, case), case["output"])

    def result(self, code: str, case: dict) -> SandboxResult:
        """The finished run of ``code`` on ``case``'s input."""
        return self.runs[(code, case["input"])].result()


# ------------------------------------------------------------------------------ workflow


class CodeSolverTestGen(RoleRounds):
    """The code solver + test-generator workflow (``Task.workflow == "code_testgen"``).

    Args:
        roles: ``{"solver": model_id, "testgen": model_id}``; engines are keyed by model id (both
            roles may name the same one).
        sampling / eval_sampling: the solver's sampling for train / eval tasks.
        testgen_sampling / testgen_eval_sampling: the test generator's (default: the solver's).
        solver_prompt, retry_prompt, testgen_prompt, failure_format: templates (module docstring).
        retry: retry a program that fails the feedback suite (once).
        max_tests: cases kept per generated suite.
        max_failures_shown: failing cases rendered into a retry prompt.
        max_shown_chars: each rendered field (input / expected / got) is cut to this many chars.
        solver_reward: ``"fraction"`` of hidden tests passed, or ``"all_pass"`` (1/0).
        diagnostic_weight: weight of ``catch_rate`` in the testgen reward (module docstring).
        limits: sandbox limits for every run (:func:`run_program` keywords); defaults
            ``cpu_s=2, wall_s=5, memory_mb=256``.
        sandbox_workers: sandboxed programs running at once, over all tasks in flight
            (default: the CPU count).
        chat: wrap each filled template as one user message and apply the chat template.
        add_special_tokens: passed to the tokenizer for plain-text prompts.
    """

    name = "code_testgen"

    def __init__(self, roles: dict[str, str] | None = None,
                 sampling: SamplingSpec | None = None, eval_sampling: SamplingSpec | None = None,
                 testgen_sampling: SamplingSpec | None = None,
                 testgen_eval_sampling: SamplingSpec | None = None,
                 solver_prompt: str = DEFAULT_SOLVER_PROMPT,
                 retry_prompt: str = DEFAULT_RETRY_PROMPT,
                 testgen_prompt: str = DEFAULT_TESTGEN_PROMPT,
                 failure_format: str = DEFAULT_FAILURE_FORMAT,
                 retry: bool = True, max_tests: int = 8, max_failures_shown: int = 3,
                 max_shown_chars: int = 300, solver_reward: str = "fraction",
                 diagnostic_weight: float = 0.5, limits: dict | None = None,
                 sandbox_workers: int | None = None, chat: bool = False,
                 add_special_tokens: bool = False):
        roles = dict(roles or {"solver": "solver", "testgen": "testgen"})
        if set(roles) != {"solver", "testgen"} or not all(isinstance(v, str) and v
                                                           for v in roles.values()):
            raise ValueError(f"roles: need exactly 'solver' and 'testgen' mapped to non-empty "
                             f"model ids, got {roles}")
        templates = {"solver_prompt": solver_prompt, "retry_prompt": retry_prompt,
                     "testgen_prompt": testgen_prompt, "failure_format": failure_format}
        for name, tpl in templates.items():
            if not isinstance(tpl, str):
                raise TypeError(f"{name}: expected a string template, got {type(tpl).__name__}")
            template_placeholders(_PLACEHOLDER, name, tpl, _TEMPLATE_FIELDS[name])
            unknown = set(re.findall(r"\{([A-Za-z_]\w*)\}", tpl)) - set(_TEMPLATE_FIELDS[name])
            if unknown:
                log.warning("%s: %s are not placeholders here and stay as written (this template "
                            "may use %s)", name, sorted(unknown), sorted(_TEMPLATE_FIELDS[name]))
        if solver_reward not in ("fraction", "all_pass"):
            raise ValueError(f"solver_reward: expected 'fraction' or 'all_pass', "
                             f"got {solver_reward!r}")
        if not 0.0 <= diagnostic_weight <= 1.0:
            raise ValueError(f"diagnostic_weight: must be in [0, 1], got {diagnostic_weight}")
        if max_tests < 1 or max_failures_shown < 1:
            raise ValueError("max_tests and max_failures_shown: must be >= 1")
        self.roles = roles
        (self.sampling, self.eval_sampling, self.testgen_sampling,
         self.testgen_eval_sampling) = role_samplings(sampling or SamplingSpec(max_tokens=512),
                                                      eval_sampling, testgen_sampling,
                                                      testgen_eval_sampling)
        self.templates = templates
        self.retry = retry
        self.max_tests = int(max_tests)
        self.max_failures_shown = int(max_failures_shown)
        self.max_shown_chars = int(max_shown_chars)
        self.solver_reward = solver_reward
        self.diagnostic_weight = float(diagnostic_weight)
        self.limits = {"cpu_s": 2.0, "wall_s": 5.0, "memory_mb": 256, **(limits or {})}
        self.sandbox_workers = max(1, int(sandbox_workers or os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.chat = chat
        self.add_special_tokens = add_special_tokens

    # ------------------------------------------------------------------------------ helpers

    def _sandbox_pool(self) -> ThreadPoolExecutor:
        """The ``sandbox_workers`` threads every task's programs run on (made on first use, so
        building the workflow from a config starts no threads)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.sandbox_workers,
                                                thread_name_prefix="code-sandbox")
            return self._pool

    def _state(self, task: Task) -> _TaskState:
        md = task.metadata or {}
        problem = md.get("problem", task.prompt if isinstance(task.prompt, str) else None)
        if not isinstance(problem, str) or not problem:
            raise ValueError(f"task.metadata.problem: task {task.task_id} needs the problem text "
                             "(or a text prompt)")
        hidden = validate_tests(md.get("hidden_tests"),
                                f"task.metadata.hidden_tests (task {task.task_id})")
        if not hidden:
            raise ValueError(f"task.metadata.hidden_tests: task {task.task_id} has none; the "
                             "solver reward needs at least one")
        reference = md.get("reference")
        if reference is not None and not isinstance(reference, str):
            raise TypeError(f"task.metadata.reference: expected program text, "
                            f"got {type(reference).__name__}")
        return _TaskState(task, problem, hidden, extract_code(reference) if reference else None)

    def _cut(self, s: str) -> str:
        s = s.rstrip("\n")
        return s if len(s) <= self.max_shown_chars else s[:self.max_shown_chars] + "..."

    def _render_failures(self, att: _Attempt, ex: _Executions) -> str:
        parts = []
        for case in att.failing[:self.max_failures_shown]:
            r = ex.result(att.code, case)
            got = r.stdout if r.stdout.strip() or r.status == "ok" else r.stderr.strip()[-200:]
            parts.append(fill(self.templates["failure_format"], input=self._cut(case["input"]),
                              expected=self._cut(case["output"]), got=self._cut(got),
                              status=r.status))
        return "\n".join(parts)

    def _solver_reward(self, passed: int, total: int) -> float:
        if self.solver_reward == "all_pass":
            return float(passed == total)
        return passed / total

    # ------------------------------------------------------------------------------ run

    async def run(self, task: Task, engines: dict[str, Any]) -> list[Sample]:
        """The task's samples: programs (first attempts, then retries) and test suites, rewards
        as in the module docstring; solver samples first, each model id by sample index."""
        check_roles(self.name, self.roles, [task], engines)
        st = self._state(task)
        index: Indices = defaultdict(count)
        await self._write(st, engines, index)
        ex = _Executions(self._limits_for(st), self._sandbox_pool())
        await self._test(st, ex)
        await self._retries(st, ex, engines, index)
        return self._collect(st)

    async def _write(self, st: _TaskState, engines: dict[str, Any], index: Indices) -> None:
        """Round 1: ``n`` programs and ``n`` test suites, all in flight at once; suites parsed."""
        solver, testgen = engines[self.roles["solver"]], engines[self.roles["testgen"]]
        n = st.task.n
        st.solver_prompt = fill(self.templates["solver_prompt"], problem=st.problem)
        solver_ids = self._encode(solver, st.solver_prompt)
        testgen_ids = self._encode(testgen, fill(self.templates["testgen_prompt"],
                                                 problem=st.problem))
        programs, suites = await gather_all(
            self._round(engines, "solver", st.task, [solver_ids] * n if solver_ids else []),
            self._round(engines, "testgen", st.task, [testgen_ids] * n if testgen_ids else []))
        for g, reply in enumerate(programs):
            att = _Attempt(st, g, text=reply.text, code=extract_code(reply.text))
            att.sample = self._sample(st.task, "solver", index, g, reply)
            st.attempts.append(att)
        for g, reply in enumerate(suites):
            suite = _Suite(g, text=reply.text, tests=parse_tests(reply.text, self.max_tests))
            suite.sample = self._sample(st.task, "testgen", index, g, reply)
            st.suites.append(suite)

    async def _test(self, st: _TaskState, ex: _Executions) -> None:
        """Sandbox the reference and every first attempt against every generated case, the
        attempts against the hidden tests; then judge the suites, build the feedback suite and
        list each attempt's failing feedback cases."""
        generated = [c for s in st.suites for c in s.tests]
        codes = list(dict.fromkeys(a.code for a in st.attempts))
        pairs = [(st.reference, c["input"]) for c in generated] if st.reference else []
        pairs += [(code, c["input"]) for code in codes for c in generated + st.hidden]
        await ex.run(pairs)
        for att in st.attempts:
            att.hidden_passed = sum(ex.passes(att.code, c) for c in st.hidden)
        self._judge_suites(st, ex)
        seen = set()
        for s in st.suites:
            for c in s.tests if s.valid else ():
                if (c["input"], c["output"]) not in seen:
                    seen.add((c["input"], c["output"]))
                    st.feedback.append(c)
        for att in st.attempts:
            att.failing = [c for c in st.feedback if not ex.passes(att.code, c)]

    async def _retries(self, st: _TaskState, ex: _Executions, engines: dict[str, Any],
                       index: Indices) -> None:
        """Round 2: one retry per program that failed the feedback suite, all in flight at
        once; each retry's program runs the hidden tests as soon as it arrives."""
        if not self.retry:
            return
        solver = engines[self.roles["solver"]]
        jobs = []
        for att in st.attempts:
            if not att.failing:
                continue
            text = fill(self.templates["retry_prompt"], problem=st.problem,
                        prompt=st.solver_prompt, attempt=att.text,
                        failures=self._render_failures(att, ex))
            ids = self._encode(solver, text)
            if ids is None:
                att.retry_skipped = True
            else:
                jobs.append((att, ids))

        async def run_hidden(reply: Reply) -> None:
            await ex.run([(extract_code(reply.text), c["input"]) for c in st.hidden])

        replies = await self._round(engines, "solver", st.task, [ids for _, ids in jobs],
                                    then=run_hidden)
        for (att, _), reply in zip(jobs, replies):
            att.retry_code = extract_code(reply.text)
            att.retry = self._sample(st.task, "solver", index, att.slot, reply)
            att.retry_hidden_passed = sum(ex.passes(att.retry_code, c) for c in st.hidden)

    def _limits_for(self, st: _TaskState) -> dict:
        """Sandbox limits, with the kept output raised above the task's longest expected
        output (hidden or generated)."""
        longest = max((len(c["output"]) for c in st.hidden + [c for s in st.suites
                                                              for c in s.tests]), default=0)
        limits = dict(self.limits)
        limits["output_cap"] = max(limits.get("output_cap", 64 * 1024), 2 * longest + 1024)
        return limits

    def _judge_suites(self, st: _TaskState, ex: _Executions) -> None:
        """Validity and catch rate of every suite of one task (definitions: module docstring)."""
        right = [a for a in st.attempts if a.correct]
        wrong = [a for a in st.attempts if not a.correct]
        for s in st.suites:
            if not s.tests:
                s.valid, s.reason = False, "no test parsed"
            elif st.reference:
                s.valid = all(ex.passes(st.reference, c) for c in s.tests)
                s.reason = "" if s.valid else "the reference fails a case"
            elif right:
                s.valid = all(ex.passes(a.code, c) for a in right for c in s.tests)
                s.reason = "" if s.valid else "a program that passes the hidden tests fails a case"
            else:
                s.valid, s.reason = True, "unjudged (no reference, no correct program)"
            if not wrong:
                s.catch_rate = 1.0
            else:
                caught = sum(any(not ex.passes(a.code, c) for c in s.tests) for a in wrong)
                s.catch_rate = caught / len(wrong)

    def _collect(self, st: _TaskState) -> list[Sample]:
        """Rewards and metadata of every sample of the task (module docstring); solver samples
        first, each model id by sample index."""
        w = self.diagnostic_weight
        total = len(st.hidden)
        out = []
        for att in st.attempts:
            team = int(att.team_correct)
            s = att.sample
            s.reward = self._solver_reward(att.hidden_passed, total)
            s.metadata.update({"attempt": 0, "slot": att.slot,
                               "hidden_passed": att.hidden_passed, "hidden_total": total,
                               "feedback_failed": len(att.failing),
                               "feedback_total": len(st.feedback),
                               "retried": int(att.retry is not None),
                               "retry_skipped": int(att.retry_skipped),
                               "team_correct": team})
            out.append(s)
            if att.retry is not None:
                r = att.retry
                r.reward = self._solver_reward(att.retry_hidden_passed, total)
                r.metadata.update({"attempt": 1, "slot": att.slot,
                                   "hidden_passed": att.retry_hidden_passed,
                                   "hidden_total": total, "team_correct": team})
                out.append(r)
        n_wrong = sum(not a.correct for a in st.attempts)
        for suite in st.suites:
            s = suite.sample
            s.reward = ((1.0 - w) + w * suite.catch_rate) if suite.valid else 0.0
            s.metadata.update({"slot": suite.slot, "num_tests": len(suite.tests),
                               "valid": int(suite.valid), "validity": suite.reason,
                               "catch_rate": float(suite.catch_rate),
                               "wrong_programs": n_wrong})
            out.append(s)
        solver_id = self.roles["solver"]
        out.sort(key=lambda s: (s.role != "solver", s.model_id != solver_id, s.sample_index))
        return out

