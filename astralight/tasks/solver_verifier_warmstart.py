"""Warm starts of the solver-verifier toy pair: a verifier that judges ``"a+b=c?"``, and a
solver that also knows the retry format (the ``examples/multi_agent`` recipe).

Why a verifier warm start: a random verifier never emits a parseable verdict, so every verdict
is invalid, every verifier reward 0 and RL has nothing to work with.

Why the verifier "shows its work" (``"37+45=81?"`` -> ``"82N"``: its own sum, then Y/N):
measured with the default 2-layer spec, a verifier trained to answer a bare ``"Y"``/``"N"``
learns only to spot answers of the wrong length; on same-length near misses it stays at chance
(0% of them rejected greedily after 3000 steps, 14-21% even with 4 layers), so RL could not lift
it either. Writing the sum first turns the check into a comparison of adjacent digits, which it
learns (greedy verdict accuracy ~82% after 1000 steps, ~92% after 1500).

Why label smoothing: the recipe must show verdict accuracy *rising* under RL, so the verifier is
made right clearly above chance but far from perfect at temperature 1.0. The smoothing mass of
the verdict letter goes to the other letter only (target 1 - eps/2 on the right one); the sum
digits and <eos> are not smoothed, so outputs stay parseable. With the defaults: held-out verdict
accuracy 64.5% at temperature 1.0 (82% greedy), ~61% on the warm-started solver's own answers;
~25 s on two idle cores.

Why a separate solver warm start: the toy policy
(:func:`astralight.tasks.arithmetic_warmstart.build_toy_policy`) sees only prompts that start
with the problem; a retry prompt that carries the first answer and the verifier's text in front
of the problem drops its accuracy from ~25% to <1%, and RL cannot climb from there.
:func:`build_toy_solver` therefore mixes retry-format prompts (``retry_share``) into the same
warm start (same smoothing, so first-attempt accuracy matches the toy policy's).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from astralight.tasks.arithmetic import ArithmeticSource
from astralight.tasks.arithmetic_warmstart import (
    DEFAULT_BATCH_SIZE, DEFAULT_LABEL_SMOOTHING, DEFAULT_LR, DEFAULT_SFT_STEPS, POOL_SIZE,
    answer_support, check_toy_args, encode_examples, sample_completions, toy_source_kwargs,
)
from astralight.tasks.sft_loop import Progress, sft
from astralight.tasks.warmstart_folder import as_spec, build_folder, tiny_vocab_size
from astralight.trainer.tinymodel import TinyModelSpec, build_model, build_tokenizer

#: verifier defaults, chosen by measurement (see the module docstring)
DEFAULT_VERIFIER_STEPS = 1000
DEFAULT_VERIFIER_LR = 1e-2
DEFAULT_VERIFIER_LABEL_SMOOTHING = 0.5
#: wrong candidate answers are off by 1..this (either sign) or have one character corrupted
DEFAULT_MAX_OFFSET = 10
#: share of wrong candidates that are off by 1..max_offset; the rest have one character
#: substituted, dropped or inserted, like the smoothed solver's own mistakes
DEFAULT_NEAR_SHARE = 0.5
#: the verifier writes its own sum before the verdict letter
DEFAULT_SHOW_WORK = True
#: share of the toy solver's warm-start examples in the retry format
DEFAULT_RETRY_SHARE = 0.3
APPROVE_TOKEN, REJECT_TOKEN = "Y", "N"


def _wrong_answer(answer: str, rng, max_offset: int, near_share: float) -> str:
    """A wrong candidate near ``answer``: off by 1..max_offset, or one character corrupted."""
    value = int(answer)
    if rng.random() < near_share:
        d = int(rng.integers(1, max_offset + 1))
        cand = value - d if (rng.random() < 0.5 and value - d >= 0) else value + d
        return str(cand)
    while True:
        chars = list(answer)
        op = int(rng.integers(3))
        pos = int(rng.integers(len(chars) + (op == 2)))
        digit = str(int(rng.integers(10)))
        if op == 0:
            chars[pos] = digit
        elif op == 1 and len(chars) > 1:
            del chars[pos]
        else:
            chars.insert(pos, digit)
        cand = "".join(chars)
        if cand and cand != answer:  # wrong by the exact-match reward ("082" != "82" too)
            return cand


def _toy_templates() -> dict:
    from astralight.workflows.solver_verifier import TOY_TEMPLATES

    return TOY_TEMPLATES


def _problems(count: int, source_kwargs: dict | None, split: str,
              seed: int) -> list[tuple[str, str]]:
    """``count`` ``(prompt, answer)`` arithmetic problems of ``split``: the eval split cycles
    through its fixed set, the train split streams fresh ones."""
    src = ArithmeticSource(split=split, seed=seed, **toy_source_kwargs(source_kwargs))
    n_src = len(src) if split == "eval" else count
    return [(p.prompt, str(p.metadata["answer"]))
            for p in (src.get(i % n_src) for i in range(count))]


def verifier_examples(count: int, source_kwargs: dict | None = None, split: str = "train",
                      seed: int = 0, max_offset: int = DEFAULT_MAX_OFFSET,
                      near_share: float = DEFAULT_NEAR_SHARE,
                      show_work: bool = DEFAULT_SHOW_WORK):
    """``count`` balanced verifier examples: ``(prompts, targets, problems, candidates)``.

    Prompt ``i`` is the toy verifier template (``TOY_TEMPLATES``, what the workflow sends) filled
    with an arithmetic prompt of ``split`` and a candidate answer that is right with probability
    1/2 (verdict ``"Y"``) and otherwise a near miss (verdict ``"N"``). The target is the letter,
    or with ``show_work`` the true sum followed by the letter (``"82N"``).
    """
    import numpy as np

    from astralight.workflows.solver_verifier import fill_template

    template = _toy_templates()["verifier_prompt"]
    rng = np.random.default_rng([seed, 7])
    prompts, targets, problems, candidates = [], [], [], []
    for problem, answer in _problems(count, source_kwargs, split, seed):
        right = bool(rng.random() < 0.5)
        cand = answer if right else _wrong_answer(answer, rng, max_offset, near_share)
        verdict = APPROVE_TOKEN if right else REJECT_TOKEN
        prompts.append(fill_template(template, problem=problem, answer=cand))
        targets.append(answer + verdict if show_work else verdict)
        problems.append(problem)
        candidates.append(cand)
    return prompts, targets, problems, candidates


def retry_examples(count: int, source_kwargs: dict | None = None, split: str = "train",
                   seed: int = 0, max_offset: int = DEFAULT_MAX_OFFSET,
                   near_share: float = DEFAULT_NEAR_SHARE):
    """``count`` solver examples in the toy retry format: ``(prompts, answers)``.

    ``"37+45=81?82N;37+45="`` -> ``"82"``: a first answer (wrong 3 times in 4, as retries follow
    rejections), then a verifier text (its shown sum, right half of the time so that copying it
    is no substitute for adding, then ``N``), then the problem again.
    """
    import numpy as np

    from astralight.workflows.solver_verifier import fill_template

    template = _toy_templates()["retry_prompt"]
    rng = np.random.default_rng([seed, 11])
    prompts, answers = [], []
    for problem, answer in _problems(count, source_kwargs, split, seed):
        first = answer if rng.random() < 0.25 else _wrong_answer(answer, rng, max_offset, near_share)
        shown = answer if rng.random() < 0.5 else _wrong_answer(answer, rng, max_offset, near_share)
        prompts.append(fill_template(template, problem=problem, answer=first,
                                     feedback=shown + REJECT_TOKEN))
        answers.append(answer)
    return prompts, answers


def train_verifier_warmstart(spec: TinyModelSpec | dict | None = None,
                             source_kwargs: dict | None = None,
                             sft_steps: int = DEFAULT_VERIFIER_STEPS, lr: float = DEFAULT_VERIFIER_LR,
                             batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
                             progress: Progress | None = None,
                             label_smoothing: float = DEFAULT_VERIFIER_LABEL_SMOOTHING,
                             max_offset: int = DEFAULT_MAX_OFFSET,
                             near_share: float = DEFAULT_NEAR_SHARE,
                             show_work: bool = DEFAULT_SHOW_WORK):
    """Train the tiny model to answer ``"a+b=c?"`` with ``[sum]Y|N<eos>``; ``(model, tokenizer)``.

    Same optimiser and schedule as the toy policy's
    (:func:`~astralight.tasks.arithmetic_warmstart.train_warmstart`); the loss covers the target
    and ``<eos>``, the verdict letter's target smoothed by ``label_smoothing`` over ``{Y, N}``.
    """
    spec = as_spec(spec)
    source_kwargs = toy_source_kwargs(source_kwargs)
    check_toy_args(source_kwargs, sft_steps, batch_size, lr, label_smoothing)
    if max_offset < 1:
        raise ValueError(f"max_offset: must be >= 1, got {max_offset}")
    if not 0.0 <= near_share <= 1.0:
        raise ValueError(f"near_share: must be in [0, 1], got {near_share}")
    tokenizer = build_tokenizer()
    letters = torch.tensor(tokenizer(APPROVE_TOKEN + REJECT_TOKEN, add_special_tokens=False)["input_ids"])
    model = build_model(spec)
    prompts, targets, _, _ = verifier_examples(min(POOL_SIZE, max(sft_steps * batch_size, 1)),
                                               source_kwargs, "train", seed, max_offset,
                                               near_share, show_work)
    ids, attn, loss_mask = encode_examples(tokenizer, prompts, targets)
    smooth_mask = torch.isin(ids, letters) & loss_mask.bool()  # the verdict letter only
    sft(model, ids, attn, loss_mask, smooth_mask, letters, sft_steps, lr, batch_size, seed,
        label_smoothing, progress)
    return model, tokenizer


def train_solver_warmstart(spec: TinyModelSpec | dict | None = None,
                           source_kwargs: dict | None = None, sft_steps: int = DEFAULT_SFT_STEPS,
                           lr: float = DEFAULT_LR, batch_size: int = DEFAULT_BATCH_SIZE,
                           seed: int = 0, progress: Progress | None = None,
                           label_smoothing: float = DEFAULT_LABEL_SMOOTHING,
                           retry_share: float = DEFAULT_RETRY_SHARE):
    """The toy policy's warm start (:func:`~astralight.tasks.arithmetic_warmstart.train_warmstart`)
    on a pool where ``retry_share`` of the examples are in the toy retry format
    (:func:`retry_examples`); smoothing over the answer alphabet as there."""
    spec = as_spec(spec)
    source_kwargs = toy_source_kwargs(source_kwargs)
    check_toy_args(source_kwargs, sft_steps, batch_size, lr, label_smoothing)
    if not 0.0 <= retry_share < 1.0:
        raise ValueError(f"retry_share: must be in [0, 1), got {retry_share}")
    tokenizer = build_tokenizer()
    model = build_model(spec)
    pool = min(POOL_SIZE, max(sft_steps * batch_size, 1))
    n_retry = int(round(pool * retry_share))
    src = ArithmeticSource(split="train", seed=seed, **source_kwargs)
    plain = [src.get(i) for i in range(pool - n_retry)]
    prompts, answers = retry_examples(n_retry, source_kwargs, "train", seed + 1)
    ids, attn, loss_mask = encode_examples(tokenizer, [p.prompt for p in plain] + prompts,
                                           [p.metadata["answer"] for p in plain] + answers)
    sft(model, ids, attn, loss_mask, loss_mask.bool(), answer_support(tokenizer), sft_steps, lr,
        batch_size, seed, label_smoothing, progress)
    return model, tokenizer


def verdict_accuracy(model, tokenizer, source_kwargs: dict | None = None, count: int = 400,
                     temperature: float = 1.0, seed: int = 0, split: str = "eval",
                     max_offset: int = DEFAULT_MAX_OFFSET, near_share: float = DEFAULT_NEAR_SHARE,
                     show_work: bool = DEFAULT_SHOW_WORK) -> dict:
    """Verdict accuracy on ``count`` balanced held-out candidates, sampled at ``temperature``.

    Returns ``{"accuracy", "approve_correct" (recall on right answers), "reject_wrong" (recall on
    wrong ones), "invalid" (share of outputs neither pattern matches)}``. Verdicts are parsed by
    the toy workflow's :class:`VerdictParser` (``TOY_TEMPLATES`` patterns); an invalid output
    counts as wrong, as it earns reward 0 in the workflow.
    """
    from astralight.workflows.solver_verifier import APPROVE, INVALID, REJECT, VerdictParser

    toy = _toy_templates()
    parser = VerdictParser(toy["approve_pattern"], toy["reject_pattern"])
    prompts, targets, _, _ = verifier_examples(count, source_kwargs, split, seed + 1, max_offset,
                                               near_share, show_work)
    was_training = model.training
    model.eval()
    texts, _ = sample_completions(model, tokenizer, prompts, max_new_tokens=6,
                                  temperature=temperature,
                                  generator=torch.Generator().manual_seed(seed))
    model.train(was_training)
    verdicts = [parser(t) for t in texts]
    truth = [t.endswith(APPROVE_TOKEN) for t in targets]
    right = [v == (APPROVE if ok else REJECT) for v, ok in zip(verdicts, truth)]
    pos = [r for r, ok in zip(right, truth) if ok]
    neg = [r for r, ok in zip(right, truth) if not ok]
    return {"accuracy": sum(right) / len(right),
            "approve_correct": sum(pos) / max(1, len(pos)),
            "reject_wrong": sum(neg) / max(1, len(neg)),
            "invalid": sum(v == INVALID for v in verdicts) / len(verdicts)}


def build_toy_verifier(out_dir: str | Path, spec: TinyModelSpec | dict | None = None,
                       source_kwargs: dict | None = None, sft_steps: int = DEFAULT_VERIFIER_STEPS,
                       lr: float = DEFAULT_VERIFIER_LR, batch_size: int = DEFAULT_BATCH_SIZE,
                       seed: int = 0, label_smoothing: float = DEFAULT_VERIFIER_LABEL_SMOOTHING,
                       max_offset: int = DEFAULT_MAX_OFFSET, near_share: float = DEFAULT_NEAR_SHARE,
                       show_work: bool = DEFAULT_SHOW_WORK, progress: Progress | bool = True,
                       num_threads: int | None = 1) -> Path:
    """Warm-start the toy verifier and save it as a transformers/vLLM model folder at ``out_dir``.

    Folder format, atomic rename, ``warmstart.json`` and ``num_threads`` as in
    :func:`~astralight.tasks.arithmetic_warmstart.build_toy_policy`; ``out_dir`` must not exist
    or be empty. The verifier reads ``"37+45=81?"`` and answers ``"82N"`` (``show_work``) or
    ``"N"``.
    """
    spec = as_spec(spec)
    source_kwargs = toy_source_kwargs(source_kwargs)
    kwargs = dict(spec=spec, source_kwargs=source_kwargs, sft_steps=sft_steps, lr=lr,
                  batch_size=batch_size, seed=seed, label_smoothing=label_smoothing,
                  max_offset=max_offset, near_share=near_share, show_work=show_work)
    provenance = {"role": "verifier", **kwargs, "spec": asdict(spec)}
    return build_folder(out_dir, train_verifier_warmstart, kwargs, provenance, sft_steps,
                        progress, num_threads)


def build_toy_solver(out_dir: str | Path, spec: TinyModelSpec | dict | None = None,
                     source_kwargs: dict | None = None, sft_steps: int = DEFAULT_SFT_STEPS,
                     lr: float = DEFAULT_LR, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
                     label_smoothing: float = DEFAULT_LABEL_SMOOTHING,
                     retry_share: float = DEFAULT_RETRY_SHARE, progress: Progress | bool = True,
                     num_threads: int | None = 1) -> Path:
    """The toy solver of the solver-verifier recipe: the toy policy
    (:func:`~astralight.tasks.arithmetic_warmstart.build_toy_policy`) plus retry-format examples
    (``retry_share``); ``retry_share=0`` trains on plain prompts only."""
    spec = as_spec(spec)
    source_kwargs = toy_source_kwargs(source_kwargs)
    kwargs = dict(spec=spec, source_kwargs=source_kwargs, sft_steps=sft_steps, lr=lr,
                  batch_size=batch_size, seed=seed, label_smoothing=label_smoothing,
                  retry_share=retry_share)
    provenance = {"role": "solver", **kwargs, "spec": asdict(spec)}
    return build_folder(out_dir, train_solver_warmstart, kwargs, provenance, sft_steps,
                        progress, num_threads)


def build_toy_solver_verifier(out_dir: str | Path, source_kwargs: dict | None = None,
                              solver: dict | None = None, verifier: dict | None = None,
                              seed: int = 0, progress: Progress | bool = True,
                              num_threads: int | None = 1) -> Path:
    """A recipe ``prepare`` function: ``out_dir/solver`` (:func:`build_toy_solver`) and
    ``out_dir/verifier`` (:func:`build_toy_verifier`); returns ``out_dir``.

    Recipes use ``{init_model}/solver`` and ``{init_model}/verifier``. ``solver`` / ``verifier``
    are extra keyword arguments of the two builders (e.g. ``{"sft_steps": 300}``);
    ``source_kwargs``, ``seed``, ``progress`` and ``num_threads`` apply to both. A sub-folder that
    already holds a model (``config.json``) is kept, so re-running a prepare step after a crash
    builds only what is missing (each sub-folder is written atomically).
    """
    out = Path(out_dir)
    common = {"source_kwargs": source_kwargs, "seed": seed, "progress": progress,
              "num_threads": num_threads}
    roles = (("solver", build_toy_solver, solver), ("verifier", build_toy_verifier, verifier))
    for name, _, extra in roles:
        clash = set(extra or {}) & (set(common) | {"out_dir"})
        if clash:
            raise ValueError(f"{name}: pass {sorted(clash)} at the top level, not per role")
    out.mkdir(parents=True, exist_ok=True)
    for name, builder, extra in roles:
        sub = out / name
        if (sub / "config.json").exists():
            continue
        builder(sub, **common, **(extra or {}))
    return out


def _pair_vocab_size(solver: dict | None = None, verifier: dict | None = None,
                     **_: object) -> int | None:
    """One vocabulary size for both models of the pair, None if their specs differ."""
    sizes = {tiny_vocab_size((extra or {}).get("spec")) for extra in (solver, verifier)}
    return sizes.pop() if len(sizes) == 1 else None


build_toy_solver.vocab_size = tiny_vocab_size
build_toy_verifier.vocab_size = tiny_vocab_size
build_toy_solver_verifier.vocab_size = _pair_vocab_size
