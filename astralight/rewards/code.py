"""Code rewards: pull the program out of a completion and run it against stdin/stdout tests.

Every program runs in :func:`astralight.rewards.sandbox.run_program` (one sandboxed process per
test case, so one test's state cannot leak into the next). Outputs are compared after stripping
surrounding whitespace and trailing whitespace on each line, the usual judge tolerance.
"""

from __future__ import annotations

import inspect
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from astralight.rewards.base import Reward
from astralight.rewards.sandbox import SandboxResult, run_program

__all__ = ["TestFailure", "TestReport", "run_tests", "extract_code", "outputs_match",
           "normalize_output", "validate_tests", "HiddenTestsReward"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The program in a completion: the last ```python (or ```py) fenced block; else the last
    fenced block of any language; else the whole text. An unclosed final fence (generation hit
    its token limit) counts as a block running to the end of the text."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    python = [body for lang, body in blocks if lang in ("python", "python3", "py")]
    if python:
        return python[-1].strip("\n") + "\n"
    if blocks:
        return blocks[-1][1].strip("\n") + "\n"
    return text.strip("\n") + "\n"


def normalize_output(text: str) -> str:
    """Output as compared: trailing whitespace of each line and surrounding blank space removed."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def outputs_match(got: str, expected: str) -> bool:
    return normalize_output(got) == normalize_output(expected)


def validate_tests(tests, where: str = "tests") -> list[dict]:
    """``tests`` as a list of ``{"input": str, "output": str}``; raises naming the bad field."""
    if not isinstance(tests, (list, tuple)):
        raise TypeError(f"{where}: expected a list of {{'input', 'output'}} maps, "
                        f"got {type(tests).__name__}")
    out = []
    for i, t in enumerate(tests):
        if not isinstance(t, dict):
            raise TypeError(f"{where}[{i}]: expected a map with 'input' and 'output', "
                            f"got {type(t).__name__}")
        for key in ("input", "output"):
            if not isinstance(t.get(key), str):
                raise TypeError(f"{where}[{i}].{key}: expected a string, "
                                f"got {type(t.get(key)).__name__}")
        out.append({"input": t["input"], "output": t["output"]})
    return out


@dataclass
class TestFailure:
    """One failed case: what went in, what was expected, what came out and how the run ended."""

    __test__ = False  # not a pytest class

    index: int
    input: str
    expected: str
    got: str
    status: str  # the sandbox status ("ok" = ran fine but printed the wrong answer)
    stderr: str = ""


@dataclass
class TestReport:
    """``passed`` of ``total`` cases passed; one :class:`TestFailure` per failed case."""

    __test__ = False

    passed: int
    total: int
    failures: list[TestFailure] = field(default_factory=list)

    @property
    def all_passed(self) -> bool:
        return self.passed == self.total

    @property
    def fraction(self) -> float:
        """Share of cases passed (0.0 when there are none)."""
        return self.passed / self.total if self.total else 0.0


def judge(result: SandboxResult, expected: str) -> bool:
    """A case passes when the program exited cleanly and printed the expected output."""
    return result.status == "ok" and not result.stdout_truncated and outputs_match(
        result.stdout, expected)


def run_tests(code: str, tests: list[dict], *, workers: int = 1,
              stop_on_first_failure: bool = False, **limits) -> TestReport:
    """Run ``code`` once per test (``input`` as stdin) and compare its stdout with ``output``.

    ``limits`` go to :func:`run_program` (``cpu_s``, ``wall_s``, ``memory_mb``, ...); the kept
    output is raised above the expected output's length so a long correct answer is not cut.
    ``workers`` > 1 runs cases in parallel threads (each still its own sandboxed process).
    ``stop_on_first_failure`` stops at the first failed case (sequential only); the report's
    ``total`` still counts every case.
    """
    tests = validate_tests(tests)

    def one(i: int) -> tuple[int, SandboxResult]:
        t = tests[i]
        kw = dict(limits)
        kw["output_cap"] = max(kw.get("output_cap", 64 * 1024), 2 * len(t["output"]) + 1024)
        return i, run_program(code, t["input"], **kw)

    results: dict[int, SandboxResult] = {}
    if workers > 1 and not stop_on_first_failure:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = dict(pool.map(one, range(len(tests))))
    else:
        for i in range(len(tests)):
            results[i] = one(i)[1]
            if stop_on_first_failure and not judge(results[i], tests[i]["output"]):
                break
    failures, passed = [], 0
    for i, t in enumerate(tests):
        r = results.get(i)
        if r is not None and judge(r, t["output"]):
            passed += 1
        elif r is not None:
            failures.append(TestFailure(i, t["input"], t["output"], r.stdout, r.status,
                                        r.stderr[-2000:]))
    return TestReport(passed=passed, total=len(tests), failures=failures)


class HiddenTestsReward(Reward):
    """``reward(completion, metadata)``: share (or all-or-nothing) of ``metadata["hidden_tests"]``
    the completion's program passes; a single-turn code reward.

    Named by import path from any workflow's YAML::

        reward:
          class_path: astralight.rewards.code.HiddenTestsReward
          init_args: {all_or_nothing: true, limits: {wall_s: 4.0, memory_mb: 512, workers: 2}}

    ``limits`` (or, from Python, keyword arguments) go to :func:`run_tests` /
    :func:`~astralight.rewards.sandbox.run_program` (``cpu_s``, ``wall_s``, ``memory_mb``,
    ``workers``, ...). The tests may also arrive as a JSON string (verl-style data sets).
    """

    def __init__(self, all_or_nothing: bool = False, tests_key: str = "hidden_tests",
                 limits: dict | None = None, **extra_limits):
        self.all_or_nothing = all_or_nothing
        self.tests_key = tests_key
        self.limits = {**(limits or {}), **extra_limits}
        allowed = _limit_names()
        unknown = sorted(set(self.limits) - allowed)
        if unknown:
            raise TypeError(f"limits: unknown {unknown}; allowed: {sorted(allowed)}")

    def __call__(self, completion: str, metadata: dict) -> float:
        tests = metadata.get(self.tests_key)
        if tests is None:
            raise KeyError(f"metadata.{self.tests_key}: missing; the task must carry its tests")
        if isinstance(tests, str):
            try:
                tests = json.loads(tests)
            except ValueError:
                raise TypeError(f"metadata.{self.tests_key}: a string that is not JSON") from None
        report = run_tests(extract_code(completion), tests, **self.limits)
        if self.all_or_nothing:
            return float(report.total > 0 and report.all_passed)
        return report.fraction


def _limit_names() -> set[str]:
    """Keyword arguments run_tests accepts (its own and run_program's limits)."""
    names = set()
    for fn in (run_tests, run_program):
        for p in inspect.signature(fn).parameters.values():
            if p.kind is inspect.Parameter.KEYWORD_ONLY:
                names.add(p.name)
    return names
