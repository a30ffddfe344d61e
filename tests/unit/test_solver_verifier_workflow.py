"""SolverVerifier: flow (verdict -> retry), rewards per role, routing fields, rounds in flight,
concurrent tasks, parser.

Most tests use a scripted engine (the char tokenizer, answers looked up from the prompt text), so
every branch (correct/wrong answer x approve/reject/invalid verdict) is forced and checked; one
test runs the real tiny model through HFEngine for the protocol layout.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from astralight.engine import SamplingSpec
from astralight.protocol import Sample, Task, decode, encode
from astralight.rewards.base import Reward
from astralight.rewards.toy import ExactMatchReward
from astralight.trainer.tinymodel import build_tokenizer
from astralight.workflows.solver_verifier import (PAPER_RETRY_PROMPT, PAPER_SOLVER_PROMPT,
                                                  PAPER_VERIFIER_PROMPT, TOY_TEMPLATES,
                                                  SolverVerifier, VerdictParser, fill_template)
from tests.unit.engine_fakes import PromptScriptEngine, run_tasks

TOK = build_tokenizer()
EOS = TOK.eos_token_id


def ScriptedEngine(script, version=0, name="", log=None):
    """Answers by prompt text: ``script[prompt]`` is a list of texts served in turn (cycled)."""
    return PromptScriptEngine(script, TOK, version=version, max_model_len=64, name=name, log=log)


def run_one(wf, task, engines):
    """The samples of one task, run alone in its own event loop."""
    return asyncio.run(wf.run(task, engines))


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
    log = []
    solver = ScriptedEngine({"37+45=": ["82", "82", "81", "80", "70"],
                             "37+45=82?N;37+45=": ["83"],
                             "37+45=81?N;37+45=": ["82"],
                             "37+45=70?Q;37+45=": ["82"]}, version=5, name="s", log=log)
    verifier = ScriptedEngine({"37+45=82?": ["Y", "N"], "37+45=81?": ["N"], "37+45=80?": ["Y"],
                               "37+45=70?": ["Q"]}, version=9, name="v", log=log)
    samples = run_one(_wf(), _task(n=5), {"solver": solver, "verifier": verifier})
    # three rounds: every first attempt submitted before any verdict, every verdict before any
    # retry, and each round's requests all in flight at once
    assert [name for name, _ in log] == ["s"] * 5 + ["v"] * 5 + ["s"] * 3
    assert solver.peak == 5 and verifier.peak == 5
    assert all(s.task_id == "t0" for s in samples)
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


def _arith_engines(log=None):
    """Scripted engines for three problems: a (wrong, rejected, fixed), b (right, approved),
    e (right, wrongly rejected, still right on retry)."""
    solver = ScriptedEngine({"1+2=": ["4"], "3+4=": ["7"], "1+2=4?N;1+2=": ["3"],
                             "5+5=": ["10"], "5+5=10?N;5+5=": ["10"]}, name="s", log=log)
    verifier = ScriptedEngine({"1+2=4?": ["N"], "3+4=7?": ["Y"], "5+5=10?": ["N"]}, name="v",
                              log=log)
    return {"solver": solver, "verifier": verifier}


def _arith_tasks():
    return [_task("a", "1+2=", "3", n=2), _task("b", "3+4=", "7", n=3),
            _task("e", "5+5=", "10", n=2, kind="eval")]


def test_eval_sampling_and_seeds_per_request():
    seeded = dict(sampling=SamplingSpec(temperature=1.0, max_tokens=4, seed=10),
                  verifier_sampling=SamplingSpec(temperature=1.0, max_tokens=2, seed=20))
    engines = _arith_engines()
    samples = run_one(_wf(**seeded), _task("a", "1+2=", "3", n=2), engines)
    solver, verifier = engines["solver"], engines["verifier"]
    # request i of a round gets seed + crc32(task id) + i: first attempts k, k+1; both
    # rejected -> retries k, k+1 (another task gets other seeds for the same prompt)
    k = SamplingSpec(seed=10).for_request(0, "a").seed
    assert k != 10 and SamplingSpec(seed=10).for_request(0, "b").seed != k
    assert [(t, sp.seed) for t, sp in solver.requests] == [
        ("1+2=", k), ("1+2=", k + 1), ("1+2=4?N;1+2=", k), ("1+2=4?N;1+2=", k + 1)]
    v = SamplingSpec(seed=20).for_request(0, "a").seed
    assert [sp.seed for _, sp in verifier.requests] == [v, v + 1]
    assert [s.metadata["team_correct"] for s in samples if s.role == "verifier"] == [1, 1]
    # an eval task samples with the eval specs, for both roles
    engines = _arith_engines()
    samples = run_one(_wf(), _task("e", "5+5=", "10", n=2, kind="eval"), engines)
    assert [sp.temperature for _, sp in engines["solver"].requests] == [0.6] * 4
    assert {sp.max_tokens for _, sp in engines["verifier"].requests} == {2}
    assert all(s.metadata["temperature"] == 0.6 for s in samples if s.role == "solver")


def _fields(s):
    return (s.task_id, s.model_id, s.role, s.sample_index, s.group_index, s.reward,
            s.token_ids.tolist(), s.loss_mask.tolist(), s.versions.tolist(), s.metadata)


def test_concurrent_tasks_each_get_exactly_their_own_samples():
    tasks = _arith_tasks()
    alone = {t.task_id: run_one(_wf(), t, _arith_engines()) for t in tasks}
    log = []
    engines = _arith_engines(log)
    together = run_tasks(_wf(), tasks, engines)
    assert sorted(together) == ["a", "b", "e"]
    for t in tasks:
        assert all(s.task_id == t.task_id for s in together[t.task_id])
        assert [_fields(s) for s in together[t.task_id]] == [_fields(s) for s in alone[t.task_id]]
    # every task's first attempts were in flight at once (2 + 3 + 2): all submitted before any
    # verdict, the engine sees one stream of requests from all episodes
    assert engines["solver"].peak == 7
    assert [name for name, _ in log[:7]] == ["s"] * 7
    b = together["b"]
    assert [s.metadata["verdict"] for s in b if s.role == "verifier"] == ["approve"] * 3
    assert [s.reward for s in together["a"] if s.role == "solver"] == [0, 0, 1, 1]


def test_a_reward_that_is_not_cheap_runs_off_the_event_loop():
    import threading

    class Recording(Reward):
        """Exact match that records the thread it ran on."""

        def __init__(self):
            self.threads = set()

        def __call__(self, completion, metadata):
            self.threads.add(threading.get_ident())
            return float(completion.strip() == metadata["answer"])

    reward = Recording()
    wf = SolverVerifier(reward, **dict(TOY_TEMPLATES, sampling=SamplingSpec(max_tokens=4)))
    samples = run_one(wf, _task("a", "1+2=", "3", n=2), _arith_engines())
    assert threading.get_ident() not in reward.threads and reward.threads
    assert [s.reward for s in samples if s.role == "solver"] == [0, 0, 1, 1]


def test_same_model_plays_both_roles():
    engine = ScriptedEngine({"2+2=": ["5"], "2+2=5?": ["N"], "2+2=5?N;2+2=": ["4"]})
    wf = _wf(roles={"solver": "p", "verifier": "p"})
    s = run_one(wf, _task("t", "2+2=", "4", n=2, model_ids=["p"]), {"p": engine})
    assert all(x.model_id == "p" for x in s)
    assert sorted(x.sample_index for x in s) == list(range(6))  # unique within the model id
    assert [x.role for x in s].count("verifier") == 2


def test_missing_engine_or_model_id_is_a_clear_error():
    eng = ScriptedEngine({})
    with pytest.raises(KeyError, match="roles.verifier"):
        run_one(_wf(), _task(), {"solver": eng})
    with pytest.raises(KeyError, match="task.model_ids"):
        run_one(_wf(), _task(model_ids=["solver"]), {"solver": eng, "verifier": eng})
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
    samples = run_one(_wf(), _task(n=3), {"solver": solver, "verifier": verifier})
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

        eos_token_id = EOS

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
    out = run_one(_wf(chat=True), _task("c", "1+1=", "2", n=1),
                  {"solver": solver, "verifier": verifier})
    assert [s.metadata["verdict"] for s in out] == ["approve", "approve"]
    assert solver.tokenizer.seen == [[{"role": "user", "content": "1+1="}]]
    assert verifier.tokenizer.seen == [[{"role": "user", "content": "1+1=2?"}]]
