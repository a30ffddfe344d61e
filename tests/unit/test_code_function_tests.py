"""Function-call hidden tests: parsing each data set's layout, the sandboxed call harness, and
attempts by the candidate program to pass without returning the right value.

Fixture rows: ``tests/fixtures/datasets/deepcoder_function_calls.jsonl`` (hand-written, one row
per layout: LiveCodeBench functional with row / per-test ``func_name``, TACO ``fn_name``,
PrimeIntellect ``function_call``) and the call-based rows of the DeepCoder Parquet fixtures.
Every run is a real sandboxed process (as rewards use it); limits are small to keep this fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from astralight.protocol import Task, decode, encode, expect
from astralight.rewards.code import (HiddenTestsReward, returns_match, run_tests,
                                     validate_tests)
from astralight.rewards.sandbox import run_call, run_program
from astralight.tasks.data.code_tests import call_prompt, normalize_tests, kind_of_tests

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"
ROWS = [json.loads(line) for line in (FIX / "deepcoder_function_calls.jsonl").read_text()
        .splitlines()]
LIMITS = {"cpu_s": 1, "wall_s": 10.0}


def parsed(i: int) -> list[dict]:
    row = ROWS[i]
    tests, reason = normalize_tests(row["tests"], functional=True, metadata=row["metadata"])
    assert reason == "" and tests is not None
    return tests


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\n"


# ------------------------------------------------------------------------------- parsing


def test_livecodebench_functional_rows_parse_with_the_row_or_test_func_name():
    assert parsed(0) == [
        {"fn_name": "twoSum", "input": "[[2, 7, 11, 15], 9]", "output": "[0, 1]", "match": "exact"},
        {"fn_name": "twoSum", "input": "[[3, 2, 4], 6]", "output": "[1, 2]", "match": "exact"},
        {"fn_name": "twoSum", "input": "[[3, 3], 6]", "output": "[0, 1]", "match": "exact"}]
    assert parsed(1)[0] == {"fn_name": "average", "input": "[[1, 2]]", "output": "[1.5, false]",
                            "match": "exact"}
    # without the row's metadata the LiveCodeBench row has no function name
    assert normalize_tests(ROWS[0]["tests"], functional=True) == (None, "no_fn_name")


def test_taco_and_primeintellect_call_rows_parse_as_wrapped_argument_lists():
    assert parsed(2) == [
        {"fn_name": "add_lists", "input": "[[1, 2, 3], [4, 5, 6]]", "output": "[[5, 7, 9]]",
         "match": "wrapped"},
        {"fn_name": "add_lists", "input": "[[], []]", "output": "[[]]", "match": "wrapped"},
        {"fn_name": "add_lists", "input": "[[-1], [1]]", "output": "[[0]]", "match": "wrapped"}]
    assert parsed(3)[1] == {"fn_name": "min_max", "input": "[[5]]", "output": "[[5, 5]]",
                            "match": "wrapped"}
    assert all(kind_of_tests(parsed(i)) == "call" for i in range(4))


def test_call_rows_of_the_deepcoder_parquet_fixtures():
    def rows(subset):
        return pq.read_table(next((FIX / "deepcoder" / subset).glob("*.parquet"))).to_pylist()

    taco, lcb, prime = rows("taco")[1], rows("lcbv5")[1], rows("primeintellect")[1]
    assert normalize_tests(taco["tests"], functional=True)[0] == [
        {"fn_name": "add", "input": "[1, 2]", "output": "3", "match": "wrapped"}]
    assert normalize_tests(lcb["tests"], functional=True, metadata=lcb["metadata"])[0] == [
        {"fn_name": "maxOf", "input": "[[1, 5, 2]]", "output": "5", "match": "exact"}]
    assert normalize_tests(prime["tests"], functional=True)[0] == [
        {"fn_name": "f", "input": "[2]", "output": "[4]", "match": "wrapped"}]
    # the default still skips them, as before (a stdin-only consumer must not get them)
    for row in (taco, lcb, prime):
        assert normalize_tests(row["tests"], metadata=row["metadata"]) == (None, "functional")
    stdin_row = rows("lcbv5")[0]
    assert normalize_tests(stdin_row["tests"], functional=True)[0][1] == {
        "input": "1\n-4\n", "output": "-4\n"}


@pytest.mark.parametrize("tests, reason", [
    (json.dumps([{"input": "1", "output": "1", "testtype": "functional"},
                 {"input": "1\n", "output": "1\n", "testtype": "stdin"}]), "tests_mixed_kinds"),
    (json.dumps([{"input": "[1, 2", "output": "3", "testtype": "functional"}]), "tests_not_json"),
    (json.dumps({"fn_name": "f", "inputs": [7], "outputs": [7]}), "tests_malformed"),
    (json.dumps({"fn_name": "not an identifier", "inputs": [[1]], "outputs": [1]}),
     "bad_fn_name"),
    (json.dumps([{"type": "function_call", "input": [1], "output": [1]}]), "no_fn_name"),
    (json.dumps([{"type": "mystery", "input": "1", "output": "1"}]), "unknown_test_type"),
])
def test_unusable_call_rows_are_skipped_with_a_reason(tests, reason):
    metadata = None if reason == "no_fn_name" else {"func_name": "f"}
    assert normalize_tests(tests, functional=True, metadata=metadata) == (None, reason)


def test_call_cases_survive_the_task_wire_and_stdin_consumers_refuse_them():
    tests = parsed(2)
    task = Task(task_id="t", prompt="p", n=1, model_ids=["m"], metadata={"hidden_tests": tests})
    assert expect(decode(encode(task)), Task).metadata["hidden_tests"] == tests
    assert validate_tests(tests, allow_calls=True) == tests
    with pytest.raises(TypeError, match=r"hidden\[0\].*function-call test.*'add_lists'"):
        validate_tests(tests, "hidden")  # e.g. the code test-gen workflow (stdin programs only)
    with pytest.raises(ValueError, match=r"tests\[0\]\.input: expected JSON text of the arg"):
        validate_tests([{"fn_name": "f", "input": "3", "output": "3"}], allow_calls=True)


def test_returns_match_rules():
    assert returns_match([1, [2, 3]], [1, [2, 3]])
    assert returns_match(1.0, 1) and not returns_match(0.1 + 0.2, 0.3)  # no float tolerance
    assert returns_match(5, [5], "wrapped") and not returns_match(5, [5])
    assert not returns_match(1, [1, 2], "wrapped")  # APPS would accept the first element
    assert returns_match([[5, 7, 9]], [[5, 7, 9]], "wrapped")
    assert returns_match({"1": 2}, {"1": 2})


def test_call_prompt_names_the_function():
    text = call_prompt("Add.", "twoSum", ROWS[0]["starter_code"])
    assert "method `twoSum` of class `Solution`" in text and "```python\nclass" in text
    assert "int]:\n```\n" in text  # the starter's trailing indentation is dropped
    assert "function `min_max`" in call_prompt("P.", "min_max")


# ----------------------------------------------------------------------------- execution

RIGHT = {
    0: "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
       "        seen = {}\n        for i, x in enumerate(nums):\n"
       "            if target - x in seen:\n                return [seen[target - x], i]\n"
       "            seen[x] = i\n",
    1: "class Solution:\n    def average(self, values):\n        m = sum(values) / len(values)\n"
       "        return (m, m == int(m))\n",
    2: "def add_lists(a, b):\n    return [x + y for x, y in zip(a, b)]\n",
    3: "def min_max(xs):\n    return min(xs), max(xs)\n",  # a tuple where lists are expected
}
WRONG = {
    0: "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n",
    1: "class Solution:\n    def average(self, values):\n"
       "        return [sum(values) // len(values), True]\n",
    2: "def add_lists(a, b):\n    return [x - y for x, y in zip(a, b)]\n",
    3: "def min_max(xs):\n    return max(xs), min(xs)\n",
}


@pytest.mark.parametrize("i", sorted(RIGHT))
def test_right_solution_passes_every_case_and_a_wrong_one_fails(i):
    tests = parsed(i)
    report = run_tests(RIGHT[i], tests, workers=3, **LIMITS)
    assert report.all_passed and report.total == len(tests), report.failures
    wrong = run_tests(WRONG[i], tests, workers=3, **LIMITS)
    assert wrong.passed < len(tests) and all(f.status == "ok" for f in wrong.failures)
    reward = HiddenTestsReward(all_or_nothing=True, limits=LIMITS)
    assert reward(fenced(RIGHT[i]), {"hidden_tests": tests}) == 1.0
    assert reward(fenced(WRONG[i]), {"hidden_tests": json.dumps(tests)}) == 0.0


def test_top_level_function_and_main_guard():
    # a top-level function is found when there is no Solution class; a stdin driver under
    # `if __name__ == "__main__":` does not run (it would block on input)
    code = ("def twoSum(nums, target):\n"
            "    for i in range(len(nums)):\n        for j in range(i):\n"
            "            if nums[i] + nums[j] == target:\n                return [j, i]\n"
            "if __name__ == '__main__':\n    print(twoSum(*eval(input())))\n")
    assert run_tests(code, parsed(0), **LIMITS).all_passed


def test_a_crash_or_timeout_fails_only_its_case():
    code = ("def add_lists(a, b):\n"
            "    if not a:\n        raise ValueError('empty')\n"
            "    if a[0] < 0:\n        while True: pass\n"
            "    return [x + y for x, y in zip(a, b)]\n")
    report = run_tests(code, parsed(2), workers=3, **LIMITS)
    assert report.passed == 1
    assert {f.index: f.status for f in report.failures} == {1: "error", 2: "timeout"}
    assert "ValueError: empty" in report.failures[0].stderr
    missing = run_tests("def other():\n    pass\n", parsed(2)[:1], **LIMITS)
    assert missing.passed == 0 and "neither Solution.add_lists" in missing.failures[0].stderr
    unencodable = run_tests("def add_lists(a, b):\n    return {1, 2}\n", parsed(2)[:1], **LIMITS)
    assert unencodable.failures[0].status == "error"


def test_stdin_and_call_cases_run_side_by_side():
    tests = [{"input": "2 3\n", "output": "5"}] + parsed(2)[:1]
    code = ("def add_lists(a, b):\n    return [x + y for x, y in zip(a, b)]\n"
            "if __name__ == '__main__':\n    print(sum(map(int, input().split())))\n")
    assert run_tests(code, tests, **LIMITS).all_passed
    assert run_tests(code, [{"input": "2 3\n", "output": "6"}], **LIMITS).passed == 0


# ------------------------------------------------------------------------ spoof attempts

EXPECTED_0 = "[0, 1]"  # what twoSum's first case expects
SPOOFS = {
    "prints the expected output": (
        "class Solution:\n    def twoSum(self, nums, target):\n"
        f"        print({EXPECTED_0!r}); print('PASS')\n"),
    "sys.exit(0) at import": (
        f"import sys\nprint({EXPECTED_0!r})\nsys.exit(0)\n"),
    "sys.exit(0) in the call": (
        "import sys\nclass Solution:\n    def twoSum(self, nums, target):\n"
        f"        print({EXPECTED_0!r}); sys.exit(0)\n"),
    "os._exit(0) in the call": (
        "import os\nclass Solution:\n    def twoSum(self, nums, target):\n"
        f"        os.write(1, b{EXPECTED_0!r}); os._exit(0)\n"),
    "forged records on every descriptor, then exit": (
        "import os, json\nclass Solution:\n    def twoSum(self, nums, target):\n"
        "        rec = json.dumps({'nonce': 'x' * 32, 'value': [0, 1]}) + '\\n'\n"
        "        for fd in map(int, os.listdir('/proc/self/fd')):\n"
        "            try: os.write(fd, rec.encode())\n            except OSError: pass\n"
        "        os._exit(0)\n"),
    "stolen nonce, forged record, then a wrong return": (
        "import os, sys, json\nclass Solution:\n    def twoSum(self, nums, target):\n"
        "        f = sys._getframe(1)\n"
        "        rec = json.dumps({'nonce': f.f_locals['nonce'], 'value': [0, 1]}) + '\\n'\n"
        "        for fd in range(3, 64):\n"
        "            try: os.write(fd, rec.encode())\n            except OSError: pass\n"
        "        return [9, 9]\n"),
    "an object equal to everything": (
        "class Any:\n    def __eq__(self, other): return True\n"
        "class Solution:\n    def twoSum(self, nums, target):\n        return Any()\n"),
    "patched json.dumps": (
        "import json\n"
        "json.dumps = lambda *a, **k: '{\"nonce\": \"\", \"value\": [0, 1]}'\n"
        "class Solution:\n    def twoSum(self, nums, target):\n        return [7, 7]\n"),
    "closes the result descriptor": (
        "import os\nfor fd in range(3, 64):\n"
        "    try: os.close(fd)\n    except OSError: pass\n"
        "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n"),
}


@pytest.mark.parametrize("name", sorted(SPOOFS))
def test_spoof_attempts_fail(name):
    report = run_tests(SPOOFS[name], parsed(0)[:1], **LIMITS)
    assert report.passed == 0, (name, report.failures)


def test_spoofs_that_exit_cleanly_are_reported_as_no_result():
    report = run_tests(SPOOFS["sys.exit(0) at import"], parsed(0)[:1], **LIMITS)
    failure = report.failures[0]
    assert failure.status == "no_result" and "no result record" in failure.stderr
    stolen = run_call(SPOOFS["stolen nonce, forged record, then a wrong return"], "twoSum",
                      "[[2, 7], 9]", **LIMITS)
    assert stolen.status == "ok" and stolen.returned is None
    assert "not exactly one result record" in stolen.harness_error


def test_the_call_harness_keeps_the_stdin_sandbox_layers_and_limits():
    plain = run_program("print(1)\n", **LIMITS)
    call = run_call("def f():\n    return 1\n", "f", "[]", **LIMITS)
    assert call.status == "ok" and call.returned == "1" and call.isolation == plain.isolation
    hog = run_call("def f():\n    x = bytearray(10**9)\n    return 1\n", "f", "[]", **LIMITS)
    assert hog.status == "memory" and hog.returned is None
    escape = run_call("import os\ndef f():\n    return os.fork()\n", "f", "[]", **LIMITS)
    assert escape.status == "error" and "os.fork" in escape.stderr
    big = run_call("def f():\n    return 'x' * 200000\n", "f", "[]", result_cap=1024, **LIMITS)
    assert big.returned is None and "result_cap" in big.harness_error
    with pytest.raises(ValueError, match="args_json"):
        run_call("def f(): pass\n", "f", "{}")
    with pytest.raises(ValueError, match="fn_name"):
        run_call("def f(): pass\n", "os.system", "[]")


@pytest.mark.parametrize("config", [
    {"isolation": "basic"},
    {"isolation": "namespaces", "guard": False},  # the OS layers alone, as in test_sandbox
])
def test_the_harness_works_under_each_isolation_mode(config):
    from astralight.rewards.sandbox import isolation_support

    support = isolation_support()
    if config.get("isolation") == "namespaces" and not (support["namespaces"] and support["root"]):
        pytest.skip(f"host refuses namespaces or not root: {support['reason']}")
    assert run_tests(RIGHT[0], parsed(0), **LIMITS, **config).all_passed
    assert run_tests(SPOOFS["stolen nonce, forged record, then a wrong return"], parsed(0)[:1],
                     **LIMITS, **config).passed == 0


def test_deepcoder_source_keeps_call_rows_only_when_functional(tmp_path):
    """DeepCoderSource: by default call-based rows are skipped (counted as "functional");
    with functional=True they load as call tests, and their prompt asks for the function (the
    stdin template would ask for a program that reads input)."""
    from astralight.tasks.data.presets import DeepCoderSource

    path = str(FIX / "deepcoder_function_calls.jsonl")
    rows = sum(1 for line in open(path) if line.strip())
    with pytest.raises(ValueError, match=f"'functional': {rows}"):  # nothing usable: said why
        DeepCoderSource(path)
    calls = DeepCoderSource(path, functional=True)
    assert len(calls) == rows
    for i in range(rows):
        prompt = calls.get(i)
        tests = prompt.metadata["hidden_tests"]
        assert kind_of_tests(tests) == "call"
        text = prompt.prompt if isinstance(prompt.prompt, str) else prompt.prompt[-1]["content"]
        assert f"`{tests[0]['fn_name']}`" in text and "do not read input" in text
