"""Hidden tests of code data sets, normalised to what the sandbox judge runs.

:class:`astralight.rewards.code.HiddenTestsReward` runs stdin/stdout tests: a list of
``{"input": str, "output": str}``. DeepCoder-Preview-Dataset stores each problem's ``tests`` as a
JSON string in one of its subsets' layouts:

- ``taco``: ``{"inputs": [...], "outputs": [...]}`` (with ``"fn_name"`` for call-based problems);
- ``lcbv5``: ``[{"input", "output", "testtype": "stdin" | "functional"}]`` (the function name of a
  functional problem is in the row's ``metadata`` JSON, ``func_name``);
- ``primeintellect``: ``[{"input", "output", "type": "stdin_stdout" | "function_call"}]``;
- ``codeforces``: ``[{"input", "output"}]``.

Call-based (functional) problems need a harness that calls a named function, which the stdin
judge has not; they are reported as skipped (with the reason) rather than silently mis-scored.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["normalize_tests", "STDIN_KINDS"]

#: test kinds that mean "program reads stdin, prints stdout"
STDIN_KINDS = {"stdin", "stdin_stdout", "stdio", "standard_io"}


def normalize_tests(raw: Any, max_tests: int | None = None) -> tuple[list[dict] | None, str]:
    """``(tests, "")`` as ``[{"input", "output"}]``, or ``(None, reason)`` when unusable.

    ``raw`` is the row's ``tests`` value (a JSON string or the decoded value). ``max_tests`` keeps
    the first N (the task carries its tests to the RaaS in every message).
    """
    tests = raw
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except ValueError:
            return None, "tests_not_json"
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:  # TACO layout
        if tests.get("fn_name"):
            return None, "functional"
        if len(tests["inputs"]) != len(tests["outputs"]):
            return None, "tests_mismatched"
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
    elif isinstance(tests, dict):
        tests = [tests]
    if not isinstance(tests, list) or not tests:
        return None, "no_tests"
    out = []
    for t in tests:
        if not isinstance(t, dict):
            return None, "tests_malformed"
        kind = t.get("testtype") or t.get("type") or "stdin"
        if kind not in STDIN_KINDS or t.get("fn_name"):
            return None, "functional"
        inp, expected = t.get("input"), t.get("output")
        if isinstance(inp, list) and all(isinstance(x, str) for x in inp):
            inp = "\n".join(inp)  # some TACO rows give stdin as a list of lines
        if isinstance(expected, list) and all(isinstance(x, str) for x in expected):
            expected = "\n".join(expected)
        if not isinstance(inp, str) or not isinstance(expected, str):
            return None, "tests_not_text"
        out.append({"input": inp, "output": expected})
    if max_tests is not None:
        out = out[:max_tests]
    return out, ""
