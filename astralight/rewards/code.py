"""Code rewards: pull the program out of a completion and run it against hidden tests.

Two kinds of test case (both plain strings, so they travel in task metadata as msgpack):

- **stdin/stdout** ``{"input": str, "output": str}``: the program reads ``input`` and must print
  ``output``. Runs in :func:`astralight.rewards.sandbox.run_program`; outputs are compared after
  stripping surrounding whitespace and trailing whitespace on each line (the usual judge
  tolerance).
- **function call** ``{"fn_name": str, "input": str, "output": str, "match": "exact"|"wrapped"}``:
  ``input`` is the JSON text of the argument list, ``output`` the JSON text of the expected return
  value. Runs in :func:`astralight.rewards.sandbox.run_call`, which calls ``Solution().<fn_name>``
  or the top-level ``<fn_name>`` and reports the returned value as JSON; the comparison happens
  here, in the parent, with :func:`returns_match` (the expected value never enters the sandbox;
  see ``run_call`` for the threat model). :func:`astralight.tasks.data.code_tests.normalize_tests`
  builds these from TACO, LiveCodeBench and PrimeIntellect rows.

Every case is its own sandboxed process, so one test's state cannot leak into the next, and a
crash or timeout fails only that case.
"""

from __future__ import annotations

import inspect
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from astralight.rewards.base import Reward
from astralight.rewards.sandbox import SandboxResult, run_call, run_program

__all__ = ["TestFailure", "TestReport", "run_tests", "extract_code", "outputs_match",
           "normalize_output", "validate_tests", "returns_match", "judge", "judge_call",
           "is_call_test", "CALL_MATCHES", "HiddenTestsReward"]

#: ``match`` values of a function-call case (see :func:`returns_match`)
CALL_MATCHES = ("exact", "wrapped")

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


def returns_match(got, expected, match: str = "exact") -> bool:
    """Whether a returned value (decoded from the harness's JSON) equals the expected one.

    Both sides are JSON-decoded, so tuples are lists, dict keys are strings, and Python ``==``
    decides (``1 == 1.0``, ``True == 1``). No float tolerance: LiveCodeBench's call-based judge and
    TACO's compare returned values with plain ``==`` too (LiveCodeBench's ``Decimal`` comparison
    applies to stdout lines only), so rewards stay comparable with theirs. ``match="wrapped"``
    (TACO/APPS and PrimeIntellect rows, whose expected outputs are usually the return value in a
    one-element list) also accepts ``got == expected[0]`` when ``expected`` is a one-element list;
    APPS accepts the first element of any non-empty list, which would pass ``1`` for ``[1, 2]``.
    """
    if match not in CALL_MATCHES:
        raise ValueError(f"match: expected one of {CALL_MATCHES}, got {match!r}")
    try:
        if got == expected:
            return True
        return (match == "wrapped" and isinstance(expected, list) and len(expected) == 1
                and got == expected[0])
    except RecursionError:
        return False


def is_call_test(case) -> bool:
    """A function-call case (it names ``fn_name``) rather than a stdin/stdout one."""
    return isinstance(case, dict) and "fn_name" in case


def validate_tests(tests, where: str = "tests", *, allow_calls: bool = False) -> list[dict]:
    """``tests`` as a list of cases; raises naming the bad field.

    Stdin/stdout cases come back as ``{"input": str, "output": str}``. Function-call cases
    (``fn_name`` present) are refused unless ``allow_calls`` (a consumer that feeds ``input`` to
    stdin must not silently run them), and come back as ``{"fn_name", "input", "output",
    "match"}`` with both JSON texts checked (``input`` must hold a list).
    """
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
        if not is_call_test(t):
            out.append({"input": t["input"], "output": t["output"]})
            continue
        if not allow_calls:
            raise TypeError(f"{where}[{i}]: a function-call test (fn_name {t['fn_name']!r}); "
                            f"this consumer runs stdin/stdout programs only: load the data set "
                            f"without function-call tests (normalize_tests(functional=False))")
        fn, match = t["fn_name"], t.get("match", "exact")
        if not isinstance(fn, str) or not fn.isidentifier():
            raise TypeError(f"{where}[{i}].fn_name: expected a Python identifier, got {fn!r}")
        if match not in CALL_MATCHES:
            raise ValueError(f"{where}[{i}].match: expected one of {CALL_MATCHES}, "
                             f"got {match!r}")
        for key in ("input", "output"):
            try:
                value = json.loads(t[key])
            except ValueError as e:
                raise ValueError(f"{where}[{i}].{key}: not JSON text ({e})") from None
            if key == "input" and not isinstance(value, list):
                raise ValueError(f"{where}[{i}].input: expected JSON text of the argument "
                                 f"list, got a {type(value).__name__}")
        out.append({"fn_name": fn, "input": t["input"], "output": t["output"], "match": match})
    return out


@dataclass
class TestFailure:
    """One failed case: what went in, what was expected, what came out and how the run ended."""

    __test__ = False  # not a pytest class

    index: int
    input: str
    expected: str
    got: str
    # the sandbox status ("ok" = ran fine but printed/returned the wrong answer; "no_result" =
    # a function-call case whose run ended cleanly without a valid harness record)
    status: str
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


def judge_call(result: SandboxResult, case: dict) -> bool:
    """A function-call case passes when the harness reported a value (the run ended cleanly with
    exactly one valid record) and it matches ``case["output"]`` (:func:`returns_match`)."""
    if result.status != "ok" or result.returned is None:
        return False
    try:
        got = json.loads(result.returned)
    except (ValueError, RecursionError):
        return False
    return returns_match(got, json.loads(case["output"]), case.get("match", "exact"))


def _passes(result: SandboxResult, case: dict) -> bool:
    return judge_call(result, case) if is_call_test(case) else judge(result, case["output"])


def run_tests(code: str, tests: list[dict], *, workers: int = 1,
              stop_on_first_failure: bool = False, **limits) -> TestReport:
    """Run ``code`` once per test and compare: a stdin/stdout case feeds ``input`` as stdin and
    compares stdout with ``output``; a function-call case calls the function in the sandbox
    (:func:`~astralight.rewards.sandbox.run_call`) and compares the returned value here.

    ``limits`` go to :func:`run_program` / ``run_call`` (``cpu_s``, ``wall_s``, ``memory_mb``,
    ...), the same for both kinds; the kept output (or result record) is raised above the
    expected output's length so a long correct answer is not cut.
    ``workers`` > 1 runs cases in parallel threads (each still its own sandboxed process).
    ``stop_on_first_failure`` stops at the first failed case (sequential only); the report's
    ``total`` still counts every case.
    """
    tests = validate_tests(tests, allow_calls=True)

    def one(i: int) -> tuple[int, SandboxResult]:
        t = tests[i]
        kw = dict(limits)
        if is_call_test(t):
            kw["result_cap"] = max(64 * 1024, 2 * len(t["output"]) + 1024)
            return i, run_call(code, t["fn_name"], t["input"], **kw)
        kw["output_cap"] = max(kw.get("output_cap", 64 * 1024), 2 * len(t["output"]) + 1024)
        return i, run_program(code, t["input"], **kw)

    results: dict[int, SandboxResult] = {}
    if workers > 1 and not stop_on_first_failure:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = dict(pool.map(one, range(len(tests))))
    else:
        for i in range(len(tests)):
            results[i] = one(i)[1]
            if stop_on_first_failure and not _passes(results[i], tests[i]):
                break
    failures, passed = [], 0
    for i, t in enumerate(tests):
        r = results.get(i)
        if r is not None and _passes(r, t):
            passed += 1
        elif r is not None and is_call_test(t):
            status = "no_result" if r.status == "ok" and r.returned is None else r.status
            note = f"[harness] {r.harness_error}\n" if r.harness_error else ""
            failures.append(TestFailure(i, t["input"], t["output"], r.returned or "", status,
                                        note + r.stderr[-2000:]))
        elif r is not None:
            failures.append(TestFailure(i, t["input"], t["output"], r.stdout, r.status,
                                        r.stderr[-2000:]))
    return TestReport(passed=passed, total=len(tests), failures=failures)


class HiddenTestsReward(Reward):
    """``reward(completion, metadata)``: share (or all-or-nothing) of ``metadata["hidden_tests"]``
    the completion's program passes; a single-turn code reward. Stdin/stdout and function-call
    cases (see the module docstring) are both judged.

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
