"""Hidden tests of code data sets, normalised to what the sandbox judge runs.

:class:`astralight.rewards.code.HiddenTestsReward` runs two kinds of case (see
:mod:`astralight.rewards.code`): stdin/stdout ``{"input": str, "output": str}`` and function call
``{"fn_name": str, "input": <JSON text of the argument list>, "output": <JSON text of the expected
return value>, "match": "exact" | "wrapped"}``. DeepCoder-Preview-Dataset stores each problem's
``tests`` as a JSON string in one of its subsets' layouts:

- ``taco``: ``{"inputs": [...], "outputs": [...]}``; with ``"fn_name"`` the problem is call-based:
  each input is the list of arguments, each output the expected value, usually wrapped in a
  one-element list (APPS convention) -> ``match: "wrapped"``;
- ``lcbv5``: ``[{"input", "output", "testtype": "stdin" | "functional"}]``; a functional input is
  one JSON value per line (one line per argument), the output one JSON value; the function name
  is ``func_name`` in the row's ``metadata`` JSON (pass it as ``metadata=``) or, in rLLM's
  preprocessed copies, in each test's ``metadata`` -> ``match: "exact"``;
- ``primeintellect``: ``[{"input", "output", "type": "stdin_stdout" | "function_call"}]``; a
  ``function_call`` test names ``fn_name`` and holds the argument list and the (wrapped) expected
  value as JSON values, the TACO convention (rLLM judges them with TACO's judge) ->
  ``match: "wrapped"``;
- ``codeforces``: ``[{"input", "output"}]``.

Function-call tests are only produced with ``functional=True``: a consumer that runs stdin/stdout
programs only (the code test-generation workflow) must keep them out, so by default they are
reported as skipped (reason ``functional``) rather than silently mis-scored. A problem mixing both
kinds is skipped (``tests_mixed_kinds``): its prompt could not say which program to write.
:func:`call_prompt` words the instruction for a call-based problem.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["normalize_tests", "kind_of_tests", "call_prompt", "STDIN_KINDS", "CALL_KINDS"]

#: test kinds that mean "program reads stdin, prints stdout"
STDIN_KINDS = {"stdin", "stdin_stdout", "stdio", "standard_io"}
#: test kinds that mean "call a named function, compare its return value"
CALL_KINDS = {"functional", "function_call", "call_based", "call"}


class _Skip(Exception):
    """A row's tests are unusable; ``args[0]`` is the reason counted by the source."""


def normalize_tests(raw: Any, max_tests: int | None = None, *, functional: bool = False,
                    metadata: Any = None) -> tuple[list[dict] | None, str]:
    """``(tests, "")`` as a list of cases (see the module docstring), or ``(None, reason)``.

    ``raw`` is the row's ``tests`` value (a JSON string or the decoded value). ``max_tests`` keeps
    the first N (the task carries its tests to the RaaS in every message). ``functional`` turns
    call-based problems into function-call cases instead of skipping them. ``metadata`` is the
    row's ``metadata`` column (dict or JSON string), where LiveCodeBench rows keep ``func_name``.
    """
    tests = raw
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except ValueError:
            return None, "tests_not_json"
    try:
        out = _normalize(tests, functional, metadata)
    except _Skip as e:
        return None, e.args[0]
    if max_tests is not None:
        out = out[:max_tests]
    return out, ""


def kind_of_tests(tests: list[dict]) -> str:
    """``"call"`` when the (normalised) cases are function calls, ``"stdin"`` otherwise."""
    return "call" if tests and "fn_name" in tests[0] else "stdin"


def call_prompt(problem: str, fn_name: str, starter_code: str = "") -> str:
    """The instruction for a call-based problem (the stdin template would ask for the wrong
    program): implement ``fn_name`` (as a ``Solution`` method when the starter code has one)."""
    starter = starter_code.rstrip().strip("\n")
    if starter:
        where = ("the method `%s` of class `Solution`" % fn_name
                 if "class Solution" in starter else "the function `%s`" % fn_name)
        body = ("Complete %s, starting from this code:\n```python\n%s\n```\nIt is called with "
                "each test's arguments and its return value is checked; do not read input or "
                "print the answer." % (where, starter))
    else:
        body = ("Define a Python 3 function `%s` (a top-level function, or a method of a class "
                "`Solution`). It is called with each test's arguments and its return value is "
                "checked; do not read input or print the answer." % fn_name)
    return "%s\n\n%s Give the complete code in a single ```python code block." % (problem, body)


# --------------------------------------------------------------------------------------------


def _normalize(tests: Any, functional: bool, metadata: Any) -> list[dict]:
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:  # TACO layout
        fn = tests.get("fn_name")
        if fn and not functional:
            raise _Skip("functional")
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise _Skip("tests_mismatched")
        if fn:
            if not tests["inputs"]:
                raise _Skip("no_tests")
            return [_call_case(fn, _arg_list(i), o, "wrapped")
                    for i, o in zip(tests["inputs"], tests["outputs"])]
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
    elif isinstance(tests, dict):
        tests = [tests]
    if not isinstance(tests, list) or not tests:
        raise _Skip("no_tests")
    out = []
    for t in tests:
        if not isinstance(t, dict):
            raise _Skip("tests_malformed")
        kind = t.get("testtype") or t.get("type") or "stdin"
        call = kind in CALL_KINDS or bool(t.get("fn_name"))
        if not functional and (call or kind not in STDIN_KINDS):
            raise _Skip("functional")
        if call:
            out.append(_call_from_row_test(t, kind, metadata))
        elif kind in STDIN_KINDS:
            out.append(_stdin_case(t))
        else:
            raise _Skip("unknown_test_type")
    if len({"fn_name" in c for c in out}) > 1:
        raise _Skip("tests_mixed_kinds")
    return out


def _stdin_case(t: dict) -> dict:
    inp, expected = t.get("input"), t.get("output")
    if isinstance(inp, list) and all(isinstance(x, str) for x in inp):
        inp = "\n".join(inp)  # some TACO rows give stdin as a list of lines
    if isinstance(expected, list) and all(isinstance(x, str) for x in expected):
        expected = "\n".join(expected)
    if not isinstance(inp, str) or not isinstance(expected, str):
        raise _Skip("tests_not_text")
    return {"input": inp, "output": expected}


def _call_from_row_test(t: dict, kind: str, metadata: Any) -> dict:
    """A list-layout call test: LiveCodeBench ``functional`` (text, one JSON value per line) or
    PrimeIntellect ``function_call`` (JSON values, TACO convention)."""
    if kind == "functional":
        fn = t.get("fn_name") or t.get("func_name") or _fn_from(t.get("metadata")) or _fn_from(
            metadata)
        inp, out = t.get("input"), t.get("output")
        if not isinstance(inp, str) or not isinstance(out, str):
            raise _Skip("tests_not_text")
        try:
            args = [json.loads(line) for line in inp.strip().split("\n")] if inp.strip() else []
            expected = json.loads(out)
        except ValueError:
            raise _Skip("tests_not_json") from None
        return _call_case(fn, args, expected, "exact")
    fn = t.get("fn_name") or t.get("func_name") or _fn_from(metadata)
    return _call_case(fn, _arg_list(t.get("input")), t.get("output"), "wrapped")


def _arg_list(value: Any) -> list:
    """TACO/PrimeIntellect arguments: a list of values (or JSON text of one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _Skip("tests_not_json") from None
    if not isinstance(value, list):
        raise _Skip("tests_malformed")
    return value


def _fn_from(meta: Any) -> str | None:
    if isinstance(meta, (str, bytes)):
        try:
            meta = json.loads(meta)
        except ValueError:
            return None
    if isinstance(meta, dict):
        return meta.get("func_name") or meta.get("fn_name")
    return None


def _call_case(fn: Any, args: list, expected: Any, match: str) -> dict:
    if not fn:
        raise _Skip("no_fn_name")
    if not isinstance(fn, str) or not fn.isidentifier():
        raise _Skip("bad_fn_name")
    try:
        return {"fn_name": fn, "input": json.dumps(args), "output": json.dumps(expected),
                "match": match}
    except (TypeError, ValueError):
        raise _Skip("tests_malformed") from None
