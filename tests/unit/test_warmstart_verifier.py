"""The solver-verifier warm starts (verifier, retry-aware solver) and their prepare function.

Tiny step counts: these check formats, masks and plumbing; the accuracies the defaults reach are
measured by hand (see the astralight.tasks.solver_verifier_warmstart docstring).
"""

from __future__ import annotations

import json

import pytest
import torch

from astralight.tasks.warmstart import (EOS_ID, build_toy_solver, build_toy_solver_verifier,
                                        build_toy_verifier, retry_examples, train_verifier_warmstart,
                                        verdict_accuracy, verifier_examples)
from astralight.trainer.tinymodel import build_tokenizer
from astralight.workflows.solver_verifier import TOY_TEMPLATES, VerdictParser, fill_template

SMALL = {"min_operand": 0, "max_operand": 9, "ops": "+"}
TINY = dict(sft_steps=3, batch_size=8, progress=False, num_threads=1)
TOK = build_tokenizer()


def _truth(problem: str) -> str:
    a, b = problem[:-1].split("+")
    return str(int(a) + int(b))


def test_verifier_examples_are_balanced_near_misses_in_the_workflow_format():
    prompts, targets, problems, cands = verifier_examples(2000, seed=3)
    assert 0.45 < sum(t.endswith("Y") for t in targets) / len(targets) < 0.55
    parser = VerdictParser(TOY_TEMPLATES["approve_pattern"], TOY_TEMPLATES["reject_pattern"])
    offsets = []
    for prompt, target, problem, cand in zip(prompts, targets, problems, cands):
        assert prompt == fill_template(TOY_TEMPLATES["verifier_prompt"], problem=problem, answer=cand)
        assert TOK.unk_token_id not in TOK(prompt, add_special_tokens=False)["input_ids"]
        truth = _truth(problem)
        # the target shows the true sum, then the verdict, and the workflow's parser reads it
        assert target == truth + ("Y" if cand == truth else "N")
        assert parser(target) == ("approve" if cand == truth else "reject")
        if cand != truth:
            offsets.append(abs(int(cand) - int(truth)))
    near = [o for o in offsets if 1 <= o <= 10]
    assert len(near) > 0.4 * len(offsets)  # about half are off by 1..10
    assert verifier_examples(50, seed=3)[0] == prompts[:50]  # deterministic
    assert verifier_examples(5, seed=3, show_work=False)[1] == [t[-1] for t in targets[:5]]
    # eval-split problems come from the held-out pairs
    assert not set(verifier_examples(3000, seed=0)[2]) & set(verifier_examples(200, split="eval")[2])


def test_retry_examples_follow_the_workflow_retry_template():
    prompts, answers = retry_examples(300, seed=1)
    for prompt, answer in zip(prompts, answers):
        problem = prompt.split(";")[-1]
        first, feedback = prompt.split(";")[0][len(problem):].split("?")
        assert prompt == fill_template(TOY_TEMPLATES["retry_prompt"], problem=problem,
                                       answer=first, feedback=feedback)
        assert answer == _truth(problem) and feedback.endswith("N")
    shown_right = sum(p.split("?")[1].split(";")[0][:-1] == a for p, a in zip(prompts, answers))
    assert 0.35 < shown_right / len(prompts) < 0.65  # copying the verifier is no shortcut


def test_folders_load_and_record_provenance(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for build, role in ((build_toy_verifier, "verifier"), (build_toy_solver, "solver")):
        path = build(tmp_path / role, source_kwargs=SMALL, seed=0, **TINY)
        model = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        assert model.config.eos_token_id == EOS_ID
        assert tok("1+2=3?", add_special_tokens=False)["input_ids"] == TOK("1+2=3?")["input_ids"]
        meta = json.loads((path / "warmstart.json").read_text())
        assert meta["role"] == role and meta["sft_steps"] == 3 and meta["source_kwargs"] == SMALL
        assert meta["spec"]["num_hidden_layers"] == 2
        with pytest.raises(FileExistsError, match="out_dir"):
            build(path, source_kwargs=SMALL, **TINY)
    assert not list(tmp_path.glob(".*tmp*"))
    with pytest.raises(ValueError, match="retry_share"):
        build_toy_solver(tmp_path / "bad", retry_share=1.0, **TINY)


def test_training_learns_the_format_and_smoothing_caps_confidence():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = train_verifier_warmstart(source_kwargs=SMALL, sft_steps=80, batch_size=32,
                                              seed=0, label_smoothing=0.5)
    finally:
        torch.set_num_threads(before)
    stats = verdict_accuracy(model, tok, SMALL, count=200, temperature=1.0, split="train")
    assert stats["invalid"] < 0.2  # 80 steps teach the "<digits><letter>" format
    # the verdict letter is smoothed (no letter near-certain), the <eos> after it is not
    ids = tok("3+4=7?7", add_special_tokens=False)["input_ids"]
    y, n = tok("YN", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([ids])).logits[0, -1], -1)
        q = torch.softmax(model(torch.tensor([ids + [y]])).logits[0, -1], -1)
    assert float(p[y] + p[n]) > 0.8 and max(float(p[y]), float(p[n])) < 0.9
    assert float(q[EOS_ID]) > 0.9


def test_prepare_builds_both_and_reuses(tmp_path):
    out = build_toy_solver_verifier(tmp_path / "init", source_kwargs=SMALL,
                                    solver={"sft_steps": 2, "batch_size": 4},
                                    verifier={"sft_steps": 2, "batch_size": 4},
                                    progress=False, num_threads=1)
    assert out == tmp_path / "init"
    assert json.loads((out / "solver" / "warmstart.json").read_text())["role"] == "solver"
    assert json.loads((out / "verifier" / "warmstart.json").read_text())["role"] == "verifier"
    stamp = (out / "verifier" / "model.safetensors").stat().st_mtime_ns
    build_toy_solver_verifier(out, source_kwargs=SMALL, progress=False)  # reuses both
    assert (out / "verifier" / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="top level"):
        build_toy_solver_verifier(tmp_path / "x", verifier={"seed": 1}, progress=False)
    assert not (tmp_path / "x").exists()  # checked before building anything
