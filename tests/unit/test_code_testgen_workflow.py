"""CodeSolverTestGen with scripted engines (a char tokenizer, fixed completions) and the real
sandbox: first-time success, a wrong program fixed on retry, invalid / weak generated tests,
roles, model ids and loss masks of every sample, concurrent tasks, sandbox off the event loop."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from astralight.engine import SamplingSpec
from astralight.protocol import Sample, Task, decode, encode
from astralight.workflows import code_testgen
from astralight.workflows.code_testgen import CodeSolverTestGen, parse_tests
from tests.unit.engine_fakes import PromptScriptEngine, run_tasks

EOS = 1


class CharTokenizer:
    """One token per character (id = code point + 3); 0/1/2 are pad/eos/bos."""

    eos_token_id = EOS

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) + 3 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 3) for i in ids if i >= 3)


def ScriptedEngine(respond, version, name="", log=None):
    """Answers each prompt with ``respond(prompt_text, k)``, ``k`` = earlier requests with that
    prompt; records every request."""
    return PromptScriptEngine(respond, CharTokenizer(), version=version, logprob=-0.25,
                              name=name, log=log)


RIGHT = "Here it is:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
GOOD_TESTS = "input: 1 2 ||| output: 3\ninput: 5 5 ||| output: 10\n"
BAD_TESTS = "input: 1 2 ||| output: 4\n"  # the reference prints 3: invalid
WEAK_TESTS = "input: 0 0 ||| output: 0\n"  # valid, but a - b passes it too: catches nothing
ROLES = {"solver": "pol-s", "testgen": "pol-t"}
LIMITS = {"cpu_s": 1, "wall_s": 5}


def make_task(n, task_id="t0", op="+"):
    """A task "print a<op>b" with two hidden tests and a reference program."""
    f = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}[op]
    return Task(task_id=task_id, prompt="ignored", n=n, model_ids=["pol-s", "pol-t"],
                workflow="code_testgen",
                metadata={"problem": f"Read integers a and b; print a{op}b.",
                          "hidden_tests": [{"input": "1 2\n", "output": str(f(1, 2))},
                                           {"input": "10 -4\n", "output": str(f(10, -4))}],
                          "reference": f"a, b = map(int, input().split())\nprint(a {op} b)\n"})


def make_wf(**kw):
    return CodeSolverTestGen(roles=ROLES, sampling=SamplingSpec(temperature=0.8, max_tokens=200),
                             limits=LIMITS, sandbox_workers=2, **kw)


def run(solver_respond, testgen_respond, n=2, log=None, **kw):
    solver = ScriptedEngine(solver_respond, version=3, name="solver", log=log)
    testgen = ScriptedEngine(testgen_respond, version=7, name="testgen", log=log)
    samples = asyncio.run(make_wf(**kw).run(make_task(n), {"pol-s": solver, "pol-t": testgen}))
    assert {s.task_id for s in samples} == {"t0"}
    return samples, solver, testgen


def check_layout(samples, solver, testgen):
    """Role <-> model_id, unique indices, masks/versions/logprobs cover only generated tokens."""
    tok = CharTokenizer()
    engines = {"pol-s": solver, "pol-t": testgen}
    prompts = {m: e.prompts() for m, e in engines.items()}
    seen = set()
    for s in samples:
        assert s.role in ROLES and s.model_id == ROLES[s.role]
        assert (s.model_id, s.sample_index) not in seen
        seen.add((s.model_id, s.sample_index))
        p = s.prompt_len
        gen = len(s.token_ids) - p
        assert p > 0 and gen > 0
        assert tok.decode(s.token_ids[:p].tolist()) in prompts[s.model_id]
        assert s.token_ids[-1] == EOS
        assert s.loss_mask.tolist() == [0] * p + [1] * gen
        assert s.versions.tolist() == [-1] * p + [engines[s.model_id].version] * gen
        assert np.all(s.logprobs[:p] == 0) and np.all(s.logprobs[p:] == np.float32(-0.25))
        assert s.metadata["completion"] == tok.decode(s.token_ids[p:].tolist())
        back = decode(encode(s))  # survives the wire, metadata included
        assert isinstance(back, Sample) and back.metadata == s.metadata
    return seen


def by_role(samples, role, attempt=None):
    return [s for s in samples if s.role == role
            and (attempt is None or s.metadata.get("attempt") == attempt)]


def test_solver_right_the_first_time():
    samples, solver, testgen = run(lambda p, k: RIGHT, lambda p, k: GOOD_TESTS)
    check_layout(samples, solver, testgen)
    firsts, suites = by_role(samples, "solver", 0), by_role(samples, "testgen")
    assert len(firsts) == 2 and len(suites) == 2 and len(samples) == 4  # no retries
    assert len(solver.requests) == 2 and len(testgen.requests) == 2
    # programs and suites all in flight at once
    assert solver.peak == 2 and testgen.peak == 2
    for s in firsts:
        assert s.reward == 1.0 and s.metadata["hidden_passed"] == 2
        assert s.metadata["retried"] == 0 and s.metadata["team_correct"] == 1
        assert s.metadata["feedback_failed"] == 0 and s.metadata["feedback_total"] == 2
    for s in suites:
        # valid, and no wrong program existed to catch: full reward
        assert s.metadata["valid"] == 1 and s.metadata["num_tests"] == 2
        assert s.metadata["wrong_programs"] == 0 and s.reward == 1.0
    assert [s.sample_index for s in firsts] == [0, 1]
    assert [s.sample_index for s in suites] == [0, 1]


def test_wrong_program_fixed_on_retry():
    def solver_respond(prompt, i):
        return RIGHT if "failed these tests" in prompt else WRONG

    log = []
    samples, solver, testgen = run(solver_respond, lambda p, k: GOOD_TESTS, log=log)
    check_layout(samples, solver, testgen)
    firsts, retries = by_role(samples, "solver", 0), by_role(samples, "solver", 1)
    assert len(firsts) == 2 and len(retries) == 2
    # round 1 (programs and suites) is submitted before any retry, the retries together
    assert sorted(name for name, _ in log[:4]) == ["solver", "solver", "testgen", "testgen"]
    assert [name for name, _ in log[4:]] == ["solver", "solver"]
    assert all("failed these tests" in text for _, text in log[4:])
    for s in firsts:
        assert s.reward == 0.0 and s.metadata["hidden_passed"] == 0  # a - b fails both
        assert s.metadata["retried"] == 1 and s.metadata["team_correct"] == 1
        assert s.metadata["feedback_failed"] == 2
    for s in retries:
        assert s.reward == 1.0 and s.metadata["team_correct"] == 1
        prompt = CharTokenizer().decode(s.token_ids[:s.prompt_len].tolist())
        # the first attempt's whole text and the failing case are in the retry's (masked) prompt
        assert WRONG in prompt and "Read integers a and b" in prompt
        assert "input:\n1 2\nexpected output:\n3\nprogram output (ok):\n-1" in prompt
        assert s.loss_mask[:s.prompt_len].sum() == 0
    assert sorted(s.metadata["slot"] for s in retries) == [0, 1]
    assert sorted(s.sample_index for s in firsts + retries) == [0, 1, 2, 3]
    for s in by_role(samples, "testgen"):
        # both wrong programs fail one of its cases: valid and fully diagnostic
        assert s.metadata["catch_rate"] == 1.0 and s.reward == 1.0


def test_invalid_tests_get_zero_and_are_not_used_as_feedback():
    suites_text = [GOOD_TESTS, BAD_TESTS, WEAK_TESTS]
    # the k-th request for the (one) testgen prompt is slot k's suite
    samples, solver, testgen = run(lambda p, k: WRONG, lambda p, k: suites_text[k], n=3)
    check_layout(samples, solver, testgen)
    suites = sorted(by_role(samples, "testgen"), key=lambda s: s.metadata["slot"])
    assert [s.metadata["valid"] for s in suites] == [1, 0, 1]
    assert suites[1].reward == 0.0 and "reference fails" in suites[1].metadata["validity"]
    assert suites[0].reward == 1.0  # valid, catches every wrong program
    assert suites[2].metadata["catch_rate"] == 0.0 and suites[2].reward == 0.5  # valid only
    firsts = by_role(samples, "solver", 0)
    # feedback = GOOD's 2 cases + WEAK's 1; BAD's "1 2 -> 4" is left out
    assert all(s.metadata["feedback_total"] == 3 for s in firsts)
    for s in by_role(samples, "solver", 1):
        prompt = CharTokenizer().decode(s.token_ids[:s.prompt_len].tolist())
        assert "expected output:\n4" not in prompt
        assert s.reward == 0.0 and s.metadata["team_correct"] == 0  # still wrong after retry


def test_unparseable_tests_are_invalid_and_no_feedback_means_no_retry():
    samples, solver, _ = run(lambda p, k: WRONG, lambda p, k: "I cannot write tests.")
    assert all(s.reward == 0.0 and s.metadata["validity"] == "no test parsed"
               for s in by_role(samples, "testgen"))
    assert by_role(samples, "solver", 1) == [] and len(solver.requests) == 2


def test_retry_can_be_disabled_and_all_pass_reward():
    samples, solver, _ = run(lambda p, k: WRONG, lambda p, k: GOOD_TESTS, retry=False,
                             solver_reward="all_pass")
    assert by_role(samples, "solver", 1) == [] and len(solver.requests) == 2
    assert all(s.reward == 0.0 for s in by_role(samples, "solver"))


def test_parse_tests_formats():
    text = "Tests:\n- input: 1\\n2 ||| output: 3\n2. INPUT: x ||| OUTPUT: a\\tb\nnoise\n" \
           "input: 1\\n2 ||| output: 3\n"
    assert parse_tests(text) == [{"input": "1\n2\n", "output": "3"},
                                 {"input": "x\n", "output": "a\tb"}]
    js = 'Sure:\n```json\n[{"input": "4 5", "output": "9"}, {"input": 7, "output": 7}]\n```'
    assert parse_tests(js) == [{"input": "4 5\n", "output": "9"}, {"input": "7\n", "output": "7"}]
    assert parse_tests("nothing here [1, 2]") == []
    assert len(parse_tests("\n".join(f"input: {i} ||| output: {i}" for i in range(20)),
                           max_tests=5)) == 5


def test_configuration_errors_name_the_field():
    with pytest.raises(ValueError, match="roles"):
        CodeSolverTestGen(roles={"solver": "a"})
    with pytest.raises(ValueError, match="retry_prompt"):
        CodeSolverTestGen(retry_prompt="{problem} {input}")
    wf = CodeSolverTestGen(roles=ROLES, limits=LIMITS)
    engines = {"pol-s": ScriptedEngine(lambda p, k: RIGHT, 0),
               "pol-t": ScriptedEngine(lambda p, k: GOOD_TESTS, 0)}
    with pytest.raises(KeyError, match="roles.testgen"):
        asyncio.run(wf.run(make_task(1), {"pol-s": engines["pol-s"]}))
    task = make_task(1)
    del task.metadata["hidden_tests"]
    with pytest.raises(TypeError, match="hidden_tests"):
        asyncio.run(wf.run(task, engines))


MINUS = WRONG  # the a - b program: wrong for "a+b", right for "a-b"


def _solver_for_both(prompt, k):
    """a+b first; for a retry, the program the failing cases ask for (a - b when the problem
    is a-b): right first time on the a+b task, fixed on retry on the a-b task."""
    if "failed these tests" in prompt:
        return MINUS if "print a-b" in prompt else RIGHT
    return RIGHT


def _tests_for(prompt, k):
    return GOOD_TESTS if "print a+b" in prompt else "input: 1 2 ||| output: -1\n"


def _fields(s):
    return (s.task_id, s.model_id, s.role, s.sample_index, s.group_index, s.reward,
            s.token_ids.tolist(), s.metadata)


def test_concurrent_tasks_each_get_exactly_their_own_samples():
    tasks = [make_task(2, "plus", "+"), make_task(2, "minus", "-"), make_task(1, "plus2", "+")]

    def engines():
        return {"pol-s": ScriptedEngine(_solver_for_both, 3),
                "pol-t": ScriptedEngine(_tests_for, 7)}

    alone = {t.task_id: asyncio.run(make_wf().run(t, engines())) for t in tasks}
    together = run_tasks(make_wf(), tasks, engines())
    for t in tasks:
        assert all(s.task_id == t.task_id for s in together[t.task_id])
        assert [_fields(s) for s in together[t.task_id]] == [_fields(s) for s in alone[t.task_id]]
    plus, minus = together["plus"], together["minus"]
    assert [s.reward for s in by_role(plus, "solver")] == [1.0, 1.0]  # right, no retry
    # minus: a+b fails its hidden tests and its generated case, the retry (a - b) passes them
    assert [s.reward for s in by_role(minus, "solver", 0)] == [0.0, 0.0]
    assert [s.reward for s in by_role(minus, "solver", 1)] == [1.0, 1.0]
    assert all(s.metadata["valid"] == 1 for s in by_role(minus, "testgen"))


def test_sandbox_runs_off_the_event_loop_on_the_shared_pool(monkeypatch):
    threads, real = [], code_testgen.run_program

    def recording(code, stdin="", **limits):
        threads.append(threading.current_thread().name)
        return real(code, stdin, **limits)

    monkeypatch.setattr(code_testgen, "run_program", recording)
    wf = make_wf()
    engines = {"pol-s": ScriptedEngine(_solver_for_both, 3), "pol-t": ScriptedEngine(_tests_for, 7)}
    run_tasks(wf, [make_task(2, "plus", "+"), make_task(2, "minus", "-")], engines)
    assert threads and all(name.startswith("code-sandbox") for name in threads)
    assert len(set(threads)) <= 2  # one pool of sandbox_workers=2 threads for every task
