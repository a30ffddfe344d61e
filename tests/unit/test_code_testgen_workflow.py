"""CodeSolverTestGen with scripted engines (a char tokenizer, fixed completions) and the real
sandbox: first-time success, a wrong program fixed on retry, invalid / weak generated tests,
roles, model ids and loss masks of every sample."""

from __future__ import annotations

import numpy as np
import pytest

from astralight.protocol import Sample, Task, decode, encode
from astralight.raas.engine import Completion, SamplingSpec
from astralight.workflows.code_testgen import CodeSolverTestGen, parse_tests

EOS = 1


class CharTokenizer:
    """One token per character (id = code point + 3); 0/1/2 are pad/eos/bos."""

    eos_token_id = EOS

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) + 3 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 3) for i in ids if i >= 3)


class ScriptedEngine:
    """Answers each prompt with ``respond(prompt_text, call_index)``; records every prompt."""

    def __init__(self, respond, version):
        self.respond = respond
        self.version = version
        self.tokenizer = CharTokenizer()
        self.prompts: list[list[str]] = []  # one list per generate call

    def generate(self, prompt_token_ids, params):
        texts = [self.tokenizer.decode(p) for p in prompt_token_ids]
        self.prompts.append(texts)
        out = []
        for i, text in enumerate(texts):
            ids = self.tokenizer(self.respond(text, i))["input_ids"] + [EOS]
            out.append(Completion(ids, [-0.25] * len(ids), "stop"))
        return out


RIGHT = "Here it is:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
GOOD_TESTS = "input: 1 2 ||| output: 3\ninput: 5 5 ||| output: 10\n"
BAD_TESTS = "input: 1 2 ||| output: 4\n"  # the reference prints 3: invalid
WEAK_TESTS = "input: 0 0 ||| output: 0\n"  # valid, but a - b passes it too: catches nothing
ROLES = {"solver": "pol-s", "testgen": "pol-t"}
LIMITS = {"cpu_s": 1, "wall_s": 5}


def make_task(n, task_id="t0"):
    return Task(task_id=task_id, prompt="ignored", n=n, model_ids=["pol-s", "pol-t"],
                workflow="code_testgen",
                metadata={"problem": "Read integers a and b; print a+b.",
                          "hidden_tests": [{"input": "1 2\n", "output": "3"},
                                           {"input": "10 -4\n", "output": "6"}],
                          "reference": "a, b = map(int, input().split())\nprint(a + b)\n"})


def run(solver_respond, testgen_respond, n=2, **kw):
    solver = ScriptedEngine(solver_respond, version=3)
    testgen = ScriptedEngine(testgen_respond, version=7)
    wf = CodeSolverTestGen(roles=ROLES, sampling=SamplingSpec(temperature=0.8, max_tokens=200),
                           limits=LIMITS, sandbox_workers=2, **kw)
    out = wf.run([make_task(n)], {"pol-s": solver, "pol-t": testgen})
    assert list(out) == ["t0"]
    return out["t0"], solver, testgen


def check_layout(samples, solver, testgen):
    """Role <-> model_id, unique indices, masks/versions/logprobs cover only generated tokens."""
    tok = CharTokenizer()
    engines = {"pol-s": solver, "pol-t": testgen}
    prompts = {m: [p for call in e.prompts for p in call] for m, e in engines.items()}
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
    samples, solver, testgen = run(lambda p, i: RIGHT, lambda p, i: GOOD_TESTS)
    check_layout(samples, solver, testgen)
    firsts, suites = by_role(samples, "solver", 0), by_role(samples, "testgen")
    assert len(firsts) == 2 and len(suites) == 2 and len(samples) == 4  # no retries
    assert len(solver.prompts) == 1 and len(testgen.prompts) == 1  # batched, one call each
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

    samples, solver, testgen = run(solver_respond, lambda p, i: GOOD_TESTS)
    check_layout(samples, solver, testgen)
    firsts, retries = by_role(samples, "solver", 0), by_role(samples, "solver", 1)
    assert len(firsts) == 2 and len(retries) == 2
    assert len(solver.prompts) == 2  # first attempts, then retries
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
    samples, solver, testgen = run(lambda p, i: WRONG, lambda p, i: suites_text[i], n=3)
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
    samples, solver, _ = run(lambda p, i: WRONG, lambda p, i: "I cannot write tests.")
    assert all(s.reward == 0.0 and s.metadata["validity"] == "no test parsed"
               for s in by_role(samples, "testgen"))
    assert by_role(samples, "solver", 1) == [] and len(solver.prompts) == 1


def test_retry_can_be_disabled_and_all_pass_reward():
    samples, solver, _ = run(lambda p, i: WRONG, lambda p, i: GOOD_TESTS, retry=False,
                             solver_reward="all_pass")
    assert by_role(samples, "solver", 1) == [] and len(solver.prompts) == 1
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
    engines = {"pol-s": ScriptedEngine(lambda p, i: RIGHT, 0),
               "pol-t": ScriptedEngine(lambda p, i: GOOD_TESTS, 0)}
    with pytest.raises(KeyError, match="roles.testgen"):
        wf.run([make_task(1)], {"pol-s": engines["pol-s"]})
    task = make_task(1)
    del task.metadata["hidden_tests"]
    with pytest.raises(TypeError, match="hidden_tests"):
        wf.run([task], engines)
