"""SolverVerifier: flow (verdict -> retry), rewards per role, routing fields, batching, parser.

Most tests use a scripted engine (the char tokenizer, answers looked up from the prompt text), so
every branch (correct/wrong answer x approve/reject/invalid verdict) is forced and checked; one
test runs the real tiny model through HFEngine for the protocol layout.
"""

from __future__ import annotations

import numpy as np
import pytest

from astralight.protocol import Sample, Task, decode, encode
from astralight.raas.engine import Completion, SamplingSpec
from astralight.rewards.toy import ExactMatchReward
from astralight.tinymodel import build_tokenizer
from astralight.workflows.solver_verifier import (PAPER_RETRY_PROMPT, PAPER_SOLVER_PROMPT,
                                                  PAPER_VERIFIER_PROMPT, TOY_TEMPLATES,
                                                  SolverVerifier, VerdictParser, fill_template)

TOK = build_tokenizer()
EOS = TOK.eos_token_id


class ScriptedEngine:
    """Answers by prompt text: ``script[prompt]`` is a list of texts served in turn (cycled)."""

    def __init__(self, script: dict[str, list[str]], version: int = 0):
        self.script, self.version, self.tokenizer = script, version, TOK
        self.max_model_len = 64
        self.calls: list[tuple[list[str], SamplingSpec]] = []
        self.served: dict[str, int] = {}

    def generate(self, prompts, params):
        texts = [TOK.decode(p) for p in prompts]
        self.calls.append((texts, params))
        out = []
        for t in texts:
            k = self.served.get(t, 0)
            self.served[t] = k + 1
            answers = self.script[t]
            ids = TOK(answers[k % len(answers)], add_special_tokens=False)["input_ids"] + [EOS]
            out.append(Completion(ids, [-0.5] * len(ids), "stop"))
        return out


def _wf(**kw):
    args = dict(TOY_TEMPLATES, sampling=SamplingSpec(temperature=1.0, max_tokens=4),
                verifier_sampling=SamplingSpec(temperature=1.0, max_tokens=2),
                eval_sampling=SamplingSpec(temperature=0.6, max_tokens=4))
    args.update(kw)
    return SolverVerifier(ExactMatchReward(), **args)


def _task(task_id="t0", prompt="37+45=", answer="82", n=4, kind="train",
          model_ids=("solver", "verifier")):
    return Task(task_id=task_id, prompt=prompt, n=n, model_ids=list(model_ids), kind=kind,
                workflow="solver_verifier", metadata={"answer": answer})


def test_flow_rewards_and_team_correct():
    # four slots: right+approve, right+reject(->retry wrong), wrong+reject(->retry right),
    # wrong+approve (no retry), and a fifth wrong + unparseable verdict (fallback: retry, reward 0)
    solver = ScriptedEngine({"37+45=": ["82", "82", "81", "80", "70"],
                             "37+45=82?N;37+45=": ["83"],
                             "37+45=81?N;37+45=": ["82"],
                             "37+45=70?Q;37+45=": ["82"]}, version=5)
    verifier = ScriptedEngine({"37+45=82?": ["Y", "N"], "37+45=81?": ["N"], "37+45=80?": ["Y"],
                               "37+45=70?": ["Q"]}, version=9)
    out = _wf().run([_task(n=5)], {"solver": solver, "verifier": verifier})
    samples = out["t0"]
    sol = [s for s in samples if s.role == "solver"]
    ver = [s for s in samples if s.role == "verifier"]
    assert all(s.model_id == "solver" for s in sol) and all(s.model_id == "verifier" for s in ver)
    assert len(ver) == 5 and len(sol) == 5 + 3  # three rejections -> three retries
    # sample_index unique per model id, retries continue after the first attempts
    assert [s.sample_index for s in sol] == list(range(8))
    assert [s.sample_index for s in ver] == list(range(5))
    first = {s.group_index: s for s in sol if s.metadata["attempt"] == 0}
    retry = {s.group_index: s for s in sol if s.metadata["attempt"] == 1}
    verd = {s.group_index: s for s in ver}
    assert sorted(retry) == [1, 2, 4]
    assert [first[g].reward for g in range(5)] == [1, 1, 0, 0, 0]
    assert [retry[g].reward for g in (1, 2, 4)] == [0, 1, 1]
    assert [verd[g].metadata["verdict"] for g in range(5)] == ["approve", "reject", "reject",
                                                               "approve", "invalid"]
    # verifier reward: right verdict 1, wrong verdict 0, invalid 0 (the fallback)
    assert [verd[g].reward for g in range(5)] == [1, 0, 1, 0, 0]
    assert [verd[g].metadata["judged_correct"] for g in range(5)] == [1, 1, 0, 0, 0]
    team = [1, 0, 1, 0, 1]
    for g in range(5):
        for s in [first[g], verd[g]] + ([retry[g]] if g in retry else []):
            assert s.metadata["team_correct"] == team[g] and s.metadata["slot"] == g
    # versions: each role's tokens carry its own engine's version
    for s in sol:
        assert set(s.versions[s.loss_mask == 1].tolist()) == {5}
    for s in ver:
        assert set(s.versions[s.loss_mask == 1].tolist()) == {9}
    # the retry saw the verifier's text in its context, and its prompt is masked out
    r = retry[2]
    assert TOK.decode(r.token_ids[:r.prompt_len].tolist()) == "37+45=81?N;37+45="
    assert r.loss_mask.tolist() == [0] * r.prompt_len + [1] * 3
    assert all(isinstance(decode(encode(s)), Sample) for s in samples)


def test_one_generate_call_per_round_and_eval_sampling():
    solver = ScriptedEngine({"1+2=": ["4"], "3+4=": ["7"], "1+2=4?N;1+2=": ["3"],
                             "5+5=": ["10"], "5+5=10?N;5+5=": ["10"]})
    verifier = ScriptedEngine({"1+2=4?": ["N"], "3+4=7?": ["Y"], "5+5=10?": ["N"]})
    tasks = [_task("a", "1+2=", "3", n=2), _task("b", "3+4=", "7", n=3),
             _task("e", "5+5=", "10", n=2, kind="eval")]
    out = _wf().run(tasks, {"solver": solver, "verifier": verifier})
    assert sorted(out) == ["a", "b", "e"]
    # solver: first attempts (train, eval), then retries (train, eval) -> 4 calls; verifier 2
    assert [len(c[0]) for c in solver.calls] == [5, 2, 2, 2]
    assert [c[1].temperature for c in solver.calls] == [1.0, 0.6, 1.0, 0.6]
    assert [len(c[0]) for c in verifier.calls] == [5, 2]
    assert [c[1].max_tokens for c in verifier.calls] == [2, 2]
    assert all(s.metadata["temperature"] == 0.6 for s in out["e"] if s.role == "solver")
    assert [s.metadata["team_correct"] for s in out["a"] if s.role == "verifier"] == [1, 1]


def test_same_model_plays_both_roles():
    engine = ScriptedEngine({"2+2=": ["5"], "2+2=5?": ["N"], "2+2=5?N;2+2=": ["4"]})
    wf = _wf(roles={"solver": "p", "verifier": "p"})
    out = wf.run([_task("t", "2+2=", "4", n=2, model_ids=["p"])], {"p": engine})
    s = out["t"]
    assert all(x.model_id == "p" for x in s)
    assert sorted(x.sample_index for x in s) == list(range(6))  # unique within the model id
    assert [x.role for x in s].count("verifier") == 2


def test_missing_engine_or_model_id_is_a_clear_error():
    eng = ScriptedEngine({})
    with pytest.raises(KeyError, match="roles.verifier"):
        _wf().run([_task()], {"solver": eng})
    with pytest.raises(KeyError, match="task.model_ids"):
        _wf().run([_task(model_ids=["solver"])], {"solver": eng, "verifier": eng})
    with pytest.raises(ValueError, match="verifier_prompt"):
        _wf(verifier_prompt="{problem}{feedback}")  # the verifier has no feedback to read


def test_verdict_parser_and_fallback():
    p = VerdictParser()
    assert p("analysis ... <verify>approve</verify>") == "approve"
    assert p("<VERIFY> reject </VERIFY>") == "reject"
    # both tags: the last one is the verdict
    assert p("if wrong I'd say <verify>reject</verify>; final: <verify>approve</verify>") == "approve"
    assert p("no verdict at all") == "invalid"
    toy = VerdictParser(TOY_TEMPLATES["approve_pattern"], TOY_TEMPLATES["reject_pattern"])
    assert [toy(t) for t in ("Y", "N", "YN", "", "y")] == ["approve", "reject", "invalid",
                                                            "invalid", "approve"]
    # the toy verifier shows its sum first: "82N"; a letter inside the digits is not a verdict
    assert [toy(t) for t in ("82N", "82Y", "-3Y", "8Y2", "82")] == ["reject", "approve", "approve",
                                                                   "invalid", "invalid"]
    with pytest.raises(ValueError, match="approve_pattern"):
        VerdictParser("(", "x")


def test_templates_keep_literal_braces_and_toy_fits():
    text = fill_template(PAPER_SOLVER_PROMPT, problem="What is 1+1?")
    assert "\\boxed{}" in text and "What is 1+1?" in text and "{problem}" not in text
    v = fill_template(PAPER_VERIFIER_PROMPT, problem="P", answer="A {feedback}")
    assert "A {feedback}" in v and "<verify>approve</verify>" in v  # answers are not re-filled
    assert "{feedback}" not in PAPER_VERIFIER_PROMPT
    r = fill_template(PAPER_RETRY_PROMPT, problem="P", answer="A", feedback="F")
    assert "Solver Agent:\nA" in r and "Verifier Agent:\nF" in r
    with pytest.raises(KeyError, match="feedback"):
        fill_template("{feedback}", problem="x")
    # the toy templates use only characters the char tokenizer knows, and fit max_model_len 64
    retry = fill_template(TOY_TEMPLATES["retry_prompt"], problem="98+99=", answer="1977",
                          feedback="N")
    ids = TOK(retry, add_special_tokens=False)["input_ids"]
    assert TOK.unk_token_id not in ids and len(ids) + 6 < 64


def test_real_tiny_model_layout(tiny_model_dir):
    from astralight.raas.hf_engine import HFEngine

    solver = HFEngine(str(tiny_model_dir), seed=0, version=2)
    verifier = HFEngine(str(tiny_model_dir), seed=1, version=7)
    out = _wf().run([_task(n=3)], {"solver": solver, "verifier": verifier})
    samples = out["t0"]
    ver = [s for s in samples if s.role == "verifier"]
    assert len(ver) == 3
    # a random model almost never writes exactly "Y"/"N": the fallback makes those rejections
    for s in samples:
        p = s.prompt_len
        gen = len(s.token_ids) - p
        assert gen >= 1 and s.loss_mask.tolist() == [0] * p + [1] * gen
        assert np.all(s.logprobs[:p] == 0) and np.all(s.logprobs[p:] < 0)
        assert set(s.versions[p:].tolist()) == ({7} if s.role == "verifier" else {2})
        assert set(s.versions[:p].tolist()) == {-1}
    for s in ver:
        if s.metadata["verdict"] == "invalid":
            assert s.reward == 0.0
    retries = [s for s in samples if s.role == "solver" and s.metadata["attempt"] == 1]
    assert len(retries) == sum(s.metadata["verdict"] != "approve" for s in ver)


def test_chat_mode_wraps_each_filled_template_as_a_user_message():
    class ChatTok:
        """The char tokenizer plus a minimal chat template ("u:" + content + "a:")."""

        def __init__(self):
            self.seen = []

        def __call__(self, text, add_special_tokens=False):
            return TOK(text, add_special_tokens=add_special_tokens)

        def decode(self, ids, **kw):
            return TOK.decode(ids, **kw)

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            self.seen.append(messages)
            assert add_generation_prompt and tokenize and len(messages) == 1
            return TOK("u:" + messages[0]["content"] + "a:", add_special_tokens=False)["input_ids"]

    solver = ScriptedEngine({"u:1+1=a:": ["2"]})
    verifier = ScriptedEngine({"u:1+1=2?a:": ["Y"]})
    solver.tokenizer, verifier.tokenizer = ChatTok(), ChatTok()
    out = _wf(chat=True).run([_task("c", "1+1=", "2", n=1)], {"solver": solver, "verifier": verifier})
    assert [s.metadata["verdict"] for s in out["c"]] == ["approve", "approve"]
    assert solver.tokenizer.seen == [[{"role": "user", "content": "1+1="}]]
    assert verifier.tokenizer.seen == [[{"role": "user", "content": "1+1=2?"}]]
