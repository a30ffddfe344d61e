"""A deterministic, seeded supervised warm start for the toy arithmetic policy.

Why a warm start: a randomly initialised tiny model never emits a correct answer, so every
reward is 0, every group-normalised advantage is 0, and RL cannot start. A short supervised run on
*train-split* prompts teaches the model the task's format and most of its skill.

Why label smoothing: the toy recipe must show RL *visibly* raising held-out accuracy measured at
temperature 1.0. The warm start therefore trains toward soft targets, ``1 - eps`` on the right
token and ``eps`` spread over the answer alphabet (digits, ``-``, ``<eos>``). The model learns the
skill (greedy held-out accuracy ~97% with the defaults) but stays deliberately under-confident:
each answer token is right with probability ~0.63 at temperature 1.0, so a whole answer is right
~25% of the time. RL with an exact-match reward then sharpens the distribution toward the right
answers (held-out avg@4 ~25% -> ~95% in 200 RL steps, see
``tests/benchmarks/bench_toy_rl_feasibility.py``). With rewards shuffled the same loss *lowers*
accuracy, so the rise shows that rewards reach the policy, not mere self-sharpening.

Plain torch, no Lightning: this runs once before a run (the recipe's ``prepare`` step) and takes
~25 s on two CPU cores with the defaults. Everything random (model init, prompt stream, batch
order) is seeded, so the same arguments give the same weights on the same machine and thread count.

CLI::

    python -m astralight.tasks.warmstart OUT_DIR [--sft-steps N] [--lr LR] [--batch-size B]
        [--label-smoothing EPS] [--seed S] [--max-operand M] [--eval]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable

import torch

from astralight.tasks.arithmetic import ArithmeticSource
from astralight.tinymodel import TinyModelSpec, build_model, build_tokenizer, save_model_folder

PAD_ID, EOS_ID = 0, 1

# The toy recipe's defaults, chosen by measurement (tests/benchmarks/bench_toy_rl_feasibility.py).
#: ArithmeticSource arguments (besides split/seed): two-operand addition, operands 0..49
DEFAULT_SOURCE_KWARGS: dict = {"min_operand": 0, "max_operand": 49, "ops": "+"}
DEFAULT_SFT_STEPS = 1500
DEFAULT_LR = 1e-2
DEFAULT_BATCH_SIZE = 64
DEFAULT_LABEL_SMOOTHING = 0.4
#: characters an answer can contain; label smoothing spreads its mass over these and <eos>
ANSWER_ALPHABET = "0123456789-"
#: the warm start draws this many train prompts once, then samples its batches from them
POOL_SIZE = 20000

Progress = Callable[[int, float], None]


# ----------------------------------------------------------------------------------------------
# token helpers (also used by the feasibility benchmark)


def encode_examples(tokenizer, prompts: list[str], answers: list[str]):
    """Right-padded ``prompt + answer + <eos>`` ids, attention mask, and a loss mask on answer+eos.

    No BOS: the engine tokenizes the prompt text exactly like this (the char tokenizer adds no
    special tokens), so the warm start sees the same token sequences as RL.
    """
    rows, masks = [], []
    for prompt, answer in zip(prompts, answers):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [EOS_ID]
        rows.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    return pad_examples(rows, masks, PAD_ID)


def pad_examples(rows: list[list[int]], masks: list[list[int]], pad_id: int):
    """Token rows and their loss masks as right-padded ``ids`` / ``attention`` long and
    ``loss_mask`` float tensors ``[n, longest]`` (the warm starts' batch layout)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, attn, loss_mask


@torch.no_grad()
def sample_completions(model, tokenizer, prompts: list[str], max_new_tokens: int = 4,
                       temperature: float = 1.0, generator: torch.Generator | None = None):
    """Sample completions like the engine does: full softmax at ``temperature``, no top-k/top-p.

    Returns ``(texts, token_lists)``. A completion stops at ``<eos>``, which is kept in its token
    list (as the engine reports it) and left out of its text. ``temperature == 0`` is greedy.
    """
    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width, b = max(len(e) for e in enc), len(enc)
    ids = torch.full((b, width), PAD_ID, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    for i, e in enumerate(enc):  # left padding: every row's next token is predicted at the end
        ids[i, width - len(e):] = torch.tensor(e)
        attn[i, width - len(e):] = 1
    done = torch.zeros(b, dtype=torch.bool)
    out = torch.full((b, max_new_tokens), PAD_ID, dtype=torch.long)
    for t in range(max_new_tokens):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1].float()
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1,
                                    generator=generator).squeeze(-1)
        nxt = torch.where(done, torch.full_like(nxt, PAD_ID), nxt)
        out[:, t] = nxt
        attn = torch.cat([attn, (~done).long()[:, None]], dim=1)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        done |= nxt == EOS_ID
        if bool(done.all()):
            break
    token_lists, texts = [], []
    for row in out.tolist():
        toks = []
        for tok in row:
            if tok == PAD_ID:
                break
            toks.append(tok)
            if tok == EOS_ID:
                break
        token_lists.append(toks)
        texts.append(tokenizer.decode([t for t in toks if t != EOS_ID]))
    return texts, token_lists


def heldout_accuracy(model, tokenizer, source_kwargs: dict | None = None, k: int = 4,
                     temperature: float = 1.0, seed: int = 0, max_new_tokens: int = 4,
                     eval_size: int = 200) -> float:
    """avg@k exact-match accuracy on the held-out (eval split) prompts, sampled at ``temperature``."""
    kwargs = DEFAULT_SOURCE_KWARGS if source_kwargs is None else source_kwargs
    src = ArithmeticSource(split="eval", eval_size=eval_size, **kwargs)
    prompts = [src.get(i) for i in range(len(src))]
    was_training = model.training
    model.eval()
    texts, _ = sample_completions(model, tokenizer, [p.prompt for p in prompts for _ in range(k)],
                                  max_new_tokens=max_new_tokens, temperature=temperature,
                                  generator=torch.Generator().manual_seed(seed))
    model.train(was_training)
    answers = [p.metadata["answer"] for p in prompts for _ in range(k)]
    return sum(t.strip() == a for t, a in zip(texts, answers)) / len(answers)


# ----------------------------------------------------------------------------------------------
# the warm start


def _as_spec(spec: TinyModelSpec | dict | None) -> TinyModelSpec:
    if spec is None:
        return TinyModelSpec()
    if isinstance(spec, TinyModelSpec):
        return spec
    if isinstance(spec, dict):  # from a YAML recipe
        unknown = set(spec) - {f.name for f in fields(TinyModelSpec)}
        if unknown:
            raise ValueError(f"spec: unknown TinyModelSpec fields {sorted(unknown)}")
        return TinyModelSpec(**spec)
    raise TypeError(f"spec: expected a TinyModelSpec, a dict of its fields or None, got {type(spec).__name__}")


def train_warmstart(spec: TinyModelSpec | dict | None = None, source_kwargs: dict | None = None,
                    sft_steps: int = DEFAULT_SFT_STEPS, lr: float = DEFAULT_LR,
                    batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
                    progress: Progress | None = None,
                    label_smoothing: float = DEFAULT_LABEL_SMOOTHING):
    """Build the tiny model (``spec.seed`` seeds its init) and train it on train-split examples.

    Returns ``(model, tokenizer)``, the model in eval mode. ``seed`` seeds the prompt stream and
    the batch order. AdamW (no weight decay), linear warm-up over the first 10% of steps, then a
    cosine decay to 10% of ``lr`` (a settled end point); grad-norm clip 1.0. The loss is the
    cross-entropy over answer and ``<eos>`` tokens only, against targets smoothed by
    ``label_smoothing`` over :data:`ANSWER_ALPHABET` and ``<eos>``. ``progress(step, loss)`` is
    called after every step.
    """
    spec = _as_spec(spec)
    source_kwargs = dict(DEFAULT_SOURCE_KWARGS if source_kwargs is None else source_kwargs)
    _check_args(source_kwargs, sft_steps, batch_size, lr, label_smoothing)
    tokenizer = build_tokenizer()
    support = torch.tensor(tokenizer(ANSWER_ALPHABET, add_special_tokens=False)["input_ids"] + [EOS_ID])
    model = build_model(spec)
    src = ArithmeticSource(split="train", seed=seed, **source_kwargs)
    pool = [src.get(i) for i in range(min(POOL_SIZE, max(sft_steps * batch_size, 1)))]
    ids, attn, loss_mask = encode_examples(tokenizer, [p.prompt for p in pool],
                                           [p.metadata["answer"] for p in pool])
    _sft(model, ids, attn, loss_mask, torch.ones_like(loss_mask), support, sft_steps, lr,
         batch_size, seed, label_smoothing, progress)
    model.eval()
    return model, tokenizer


def print_progress(total: int, every: int | None = None, stream=sys.stderr) -> Progress:
    """A ``progress`` callback that prints step, loss and elapsed time ~20 times per run."""
    start = time.monotonic()
    every = every or max(1, total // 20)

    def report(step: int, loss: float) -> None:
        if step % every == 0 or step == total:
            print(f"[warmstart] step {step}/{total} loss {loss:.4f} "
                  f"({time.monotonic() - start:.1f} s)", file=stream, flush=True)

    return report


def build_toy_policy(out_dir: str | Path, spec: TinyModelSpec | dict | None = None,
                     source_kwargs: dict | None = None, sft_steps: int = DEFAULT_SFT_STEPS,
                     lr: float = DEFAULT_LR, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
                     label_smoothing: float = DEFAULT_LABEL_SMOOTHING,
                     progress: Progress | bool = True, num_threads: int | None = None) -> Path:
    """Warm-start the tiny model and save it as a transformers/vLLM model folder at ``out_dir``.

    ``source_kwargs`` are the ``ArithmeticSource`` arguments other than ``split`` and ``seed``;
    pass the run's own (the defaults match the toy recipe). ``spec`` may be a dict of
    ``TinyModelSpec`` fields (from YAML). ``progress``: True prints to stderr, False is silent,
    or a ``(step, loss)`` callback. The folder is written next to ``out_dir`` and renamed into
    place at the end, so a crash never leaves a half-written folder that looks complete; it also
    holds ``warmstart.json`` (the arguments, for provenance). ``out_dir`` must not exist or be empty.
    ``num_threads``: torch intra-op threads while training (None: leave as is). On a loaded
    two-core machine 1 is the safer choice: two OpenMP threads spin-wait for each other when one
    is descheduled (a 25 s warm start was once measured at 450 s that way); 1 thread costs ~1.4x
    when the machine is idle.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"out_dir: {out} exists and is not an empty folder; remove it or pick another")
    spec = _as_spec(spec)
    source_kwargs = dict(DEFAULT_SOURCE_KWARGS if source_kwargs is None else source_kwargs)
    if progress is True:
        progress = print_progress(sft_steps)
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads: must be >= 1 or None, got {num_threads}")
    threads_before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        model, tokenizer = train_warmstart(spec, source_kwargs, sft_steps, lr, batch_size, seed,
                                           progress or None, label_smoothing)
    finally:
        torch.set_num_threads(threads_before)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    save_model_folder(model, tokenizer, tmp)
    (tmp / "warmstart.json").write_text(json.dumps({
        "spec": asdict(spec), "source_kwargs": source_kwargs, "sft_steps": sft_steps, "lr": lr,
        "batch_size": batch_size, "seed": seed, "label_smoothing": label_smoothing}, indent=2))
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(tmp, out)
    return out


# ----------------------------------------------------------------------------------------------
# the solver-verifier pair (issue 5's toy recipe): a verifier that judges "a+b=c?", and a solver
# that also knows the retry format
#
# Why a verifier warm start: a random verifier never emits a parseable verdict, so every verdict
# is invalid, every verifier reward 0 and RL has nothing to work with.
#
# Why the verifier "shows its work" ("37+45=81?" -> "82N": its own sum, then Y/N): measured with
# the default 2-layer spec, a verifier trained to answer a bare "Y"/"N" learns only to spot
# answers of the wrong length; on same-length near misses it stays at chance (0% of them rejected
# greedily after 3000 steps, 14-21% even with 4 layers), so RL could not lift it either. Writing
# the sum first turns the check into a comparison of adjacent digits, which it learns (greedy
# verdict accuracy ~82% after 1000 steps, ~92% after 1500).
#
# Why label smoothing: the recipe must show verdict accuracy *rising* under RL, so the verifier
# is made right clearly above chance but far from perfect at temperature 1.0. The smoothing mass
# of the verdict letter goes to the other letter only (target 1 - eps/2 on the right one); the sum
# digits and <eos> are not smoothed, so outputs stay parseable. With the defaults: held-out
# verdict accuracy 64.5% at temperature 1.0 (82% greedy), ~61% on the warm-started solver's own
# answers; ~25 s on two idle cores.
#
# Why a separate solver warm start for this recipe: the toy policy (build_toy_policy) has only
# ever seen prompts that start with the problem; a retry prompt that carries the first answer and
# the verifier's text in front of the problem drops its accuracy from ~25% to <1%, and RL cannot
# climb from there. build_toy_solver therefore mixes retry-format prompts (``retry_share``) into
# the same warm start (same smoothing, so first-attempt accuracy matches build_toy_policy's).

#: verifier defaults, chosen by measurement (see above)
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
    kwargs = dict(DEFAULT_SOURCE_KWARGS if source_kwargs is None else source_kwargs)
    src = ArithmeticSource(split=split, seed=seed, **kwargs)
    n_src = len(src) if split == "eval" else count
    rng = np.random.default_rng([seed, 7])
    prompts, targets, problems, candidates = [], [], [], []
    for i in range(count):
        p = src.get(i % n_src)
        answer = str(p.metadata["answer"])
        right = bool(rng.random() < 0.5)
        cand = answer if right else _wrong_answer(answer, rng, max_offset, near_share)
        verdict = APPROVE_TOKEN if right else REJECT_TOKEN
        prompts.append(fill_template(template, problem=p.prompt, answer=cand))
        targets.append(answer + verdict if show_work else verdict)
        problems.append(p.prompt)
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
    kwargs = dict(DEFAULT_SOURCE_KWARGS if source_kwargs is None else source_kwargs)
    src = ArithmeticSource(split=split, seed=seed, **kwargs)
    n_src = len(src) if split == "eval" else count
    rng = np.random.default_rng([seed, 11])
    prompts, answers = [], []
    for i in range(count):
        p = src.get(i % n_src)
        answer = str(p.metadata["answer"])
        first = answer if rng.random() < 0.25 else _wrong_answer(answer, rng, max_offset, near_share)
        shown = answer if rng.random() < 0.5 else _wrong_answer(answer, rng, max_offset, near_share)
        prompts.append(fill_template(template, problem=p.prompt, answer=first,
                                     feedback=shown + REJECT_TOKEN))
        answers.append(answer)
    return prompts, answers


def _check_args(source_kwargs: dict, sft_steps: int, batch_size: int, lr: float,
                label_smoothing: float) -> None:
    for key in ("split", "seed"):
        if key in source_kwargs:
            raise ValueError(f"source_kwargs: do not pass {key!r}; the warm start uses the train "
                             "split and its own seed argument")
    check_sft_args(sft_steps, batch_size, lr, label_smoothing)


def check_sft_args(sft_steps: int, batch_size: int, lr: float, label_smoothing: float) -> None:
    """Raise ValueError naming the first supervised warm-start argument out of range."""
    if sft_steps < 0:
        raise ValueError(f"sft_steps: must be >= 0, got {sft_steps}")
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    if not lr > 0:
        raise ValueError(f"lr: must be > 0, got {lr}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing: must be in [0, 1), got {label_smoothing}")


def _sft(model, ids, attn, loss_mask, smooth_mask, support, sft_steps: int, lr: float,
         batch_size: int, seed: int, label_smoothing: float, progress: Progress | None):
    """The warm-start loop of :func:`train_warmstart` (same optimiser, schedule and clipping),
    with the smoothing applied only where ``smooth_mask`` is set, over the ``support`` ids."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, sft_steps // 10)

    def lr_factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, sft_steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    for step in range(sft_steps):
        idx = torch.randint(len(ids), (batch_size,), generator=gen)
        b_ids, b_attn = ids[idx], attn[idx]
        width = int(b_attn.sum(-1).max())
        b_ids, b_attn = b_ids[:, :width], b_attn[:, :width]
        b_mask = loss_mask[idx][:, 1:width]
        b_smooth = smooth_mask[idx][:, 1:width].float()
        logits = model(input_ids=b_ids, attention_mask=b_attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        nll = -logp.gather(-1, b_ids[:, 1:, None]).squeeze(-1)
        if label_smoothing > 0:
            smooth = (1 - label_smoothing) * nll - label_smoothing * logp[..., support].mean(-1)
            nll = b_smooth * smooth + (1 - b_smooth) * nll
        loss = (nll * b_mask).sum() / b_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress is not None:
            progress(step + 1, float(loss.detach()))
    model.eval()
    return model


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

    Same optimiser and schedule as :func:`train_warmstart`; the loss covers the target and
    ``<eos>``, the verdict letter's target smoothed by ``label_smoothing`` over ``{Y, N}``.
    """
    spec = _as_spec(spec)
    source_kwargs = dict(DEFAULT_SOURCE_KWARGS if source_kwargs is None else source_kwargs)
    _check_args(source_kwargs, sft_steps, batch_size, lr, label_smoothing)
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
    _sft(model, ids, attn, loss_mask, smooth_mask, letters, sft_steps, lr, batch_size, seed,
         label_smoothing, progress)
    return model, tokenizer


def train_solver_warmstart(spec: TinyModelSpec | dict | None = None,
                           source_kwargs: dict | None = None, sft_steps: int = DEFAULT_SFT_STEPS,
                           lr: float = DEFAULT_LR, batch_size: int = DEFAULT_BATCH_SIZE,
                           seed: int = 0, progress: Progress | None = None,
                           label_smoothing: float = DEFAULT_LABEL_SMOOTHING,
                           retry_share: float = DEFAULT_RETRY_SHARE):
    """:func:`train_warmstart`'s recipe on a pool where ``retry_share`` of the examples are in
    the toy retry format (:func:`retry_examples`); smoothing over the answer alphabet as there."""
    spec = _as_spec(spec)
    source_kwargs = dict(DEFAULT_SOURCE_KWARGS if source_kwargs is None else source_kwargs)
    _check_args(source_kwargs, sft_steps, batch_size, lr, label_smoothing)
    if not 0.0 <= retry_share < 1.0:
        raise ValueError(f"retry_share: must be in [0, 1), got {retry_share}")
    tokenizer = build_tokenizer()
    support = torch.tensor(tokenizer(ANSWER_ALPHABET, add_special_tokens=False)["input_ids"] + [EOS_ID])
    model = build_model(spec)
    pool = min(POOL_SIZE, max(sft_steps * batch_size, 1))
    n_retry = int(round(pool * retry_share))
    src = ArithmeticSource(split="train", seed=seed, **source_kwargs)
    plain = [src.get(i) for i in range(pool - n_retry)]
    prompts, answers = retry_examples(n_retry, source_kwargs, "train", seed + 1)
    ids, attn, loss_mask = encode_examples(tokenizer, [p.prompt for p in plain] + prompts,
                                           [p.metadata["answer"] for p in plain] + answers)
    _sft(model, ids, attn, loss_mask, loss_mask.bool(), support, sft_steps, lr, batch_size, seed,
         label_smoothing, progress)
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


def _build_folder(out_dir: str | Path, train: Callable, kwargs: dict, provenance: dict,
                  sft_steps: int, progress: Progress | bool, num_threads: int | None) -> Path:
    """Train with ``train(**kwargs, progress=...)`` and save like :func:`build_toy_policy`:
    written next to ``out_dir`` and renamed into place, with ``warmstart.json``."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"out_dir: {out} exists and is not an empty folder; remove it or pick another")
    if progress is True:
        progress = print_progress(sft_steps)
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads: must be >= 1 or None, got {num_threads}")
    threads_before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        model, tokenizer = train(**kwargs, progress=progress or None)
    finally:
        torch.set_num_threads(threads_before)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    save_model_folder(model, tokenizer, tmp)
    (tmp / "warmstart.json").write_text(json.dumps(provenance, indent=2))
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(tmp, out)
    return out


def build_toy_verifier(out_dir: str | Path, spec: TinyModelSpec | dict | None = None,
                       source_kwargs: dict | None = None, sft_steps: int = DEFAULT_VERIFIER_STEPS,
                       lr: float = DEFAULT_VERIFIER_LR, batch_size: int = DEFAULT_BATCH_SIZE,
                       seed: int = 0, label_smoothing: float = DEFAULT_VERIFIER_LABEL_SMOOTHING,
                       max_offset: int = DEFAULT_MAX_OFFSET, near_share: float = DEFAULT_NEAR_SHARE,
                       show_work: bool = DEFAULT_SHOW_WORK, progress: Progress | bool = True,
                       num_threads: int | None = None) -> Path:
    """Warm-start the toy verifier and save it as a transformers/vLLM model folder at ``out_dir``.

    Folder format, atomic rename, ``warmstart.json`` and ``num_threads`` as in
    :func:`build_toy_policy`; ``out_dir`` must not exist or be empty. The verifier reads
    ``"37+45=81?"`` and answers ``"82N"`` (``show_work``) or ``"N"``.
    """
    spec = _as_spec(spec)
    source_kwargs = dict(DEFAULT_SOURCE_KWARGS if source_kwargs is None else source_kwargs)
    kwargs = dict(spec=spec, source_kwargs=source_kwargs, sft_steps=sft_steps, lr=lr,
                  batch_size=batch_size, seed=seed, label_smoothing=label_smoothing,
                  max_offset=max_offset, near_share=near_share, show_work=show_work)
    provenance = {"role": "verifier", **kwargs, "spec": asdict(spec)}
    return _build_folder(out_dir, train_verifier_warmstart, kwargs, provenance, sft_steps,
                         progress, num_threads)


def build_toy_solver(out_dir: str | Path, spec: TinyModelSpec | dict | None = None,
                     source_kwargs: dict | None = None, sft_steps: int = DEFAULT_SFT_STEPS,
                     lr: float = DEFAULT_LR, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
                     label_smoothing: float = DEFAULT_LABEL_SMOOTHING,
                     retry_share: float = DEFAULT_RETRY_SHARE, progress: Progress | bool = True,
                     num_threads: int | None = None) -> Path:
    """The toy solver of the solver-verifier recipe: :func:`build_toy_policy` plus retry-format
    examples (``retry_share``); ``retry_share=0`` trains on plain prompts only."""
    spec = _as_spec(spec)
    source_kwargs = dict(DEFAULT_SOURCE_KWARGS if source_kwargs is None else source_kwargs)
    kwargs = dict(spec=spec, source_kwargs=source_kwargs, sft_steps=sft_steps, lr=lr,
                  batch_size=batch_size, seed=seed, label_smoothing=label_smoothing,
                  retry_share=retry_share)
    provenance = {"role": "solver", **kwargs, "spec": asdict(spec)}
    return _build_folder(out_dir, train_solver_warmstart, kwargs, provenance, sft_steps,
                         progress, num_threads)


def build_toy_solver_verifier(out_dir: str | Path, source_kwargs: dict | None = None,
                              solver: dict | None = None, verifier: dict | None = None,
                              seed: int = 0, progress: Progress | bool = True,
                              num_threads: int | None = None) -> Path:
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


# ----------------------------------------------------------------------------------------------
# vocabulary sizes before a build: a prepare function's ``vocab_size(**kwargs)`` tells the
# launcher the vocabulary of the model it will build, so `astralight run --export-configs` can
# write the dataflow's ``vocab_sizes`` before the model exists (astralight.launch.prepared_vocab_size)


def _tiny_vocab_size(spec: TinyModelSpec | dict | None = None, **_: object) -> int:
    """The vocabulary of the tiny model a builder makes with these keyword arguments."""
    return _as_spec(spec).vocab_size


def _pair_vocab_size(solver: dict | None = None, verifier: dict | None = None,
                     **_: object) -> int | None:
    """One vocabulary size for both models of the pair, None if their specs differ."""
    sizes = {_tiny_vocab_size((extra or {}).get("spec")) for extra in (solver, verifier)}
    return sizes.pop() if len(sizes) == 1 else None


build_toy_policy.vocab_size = _tiny_vocab_size
build_toy_solver.vocab_size = _tiny_vocab_size
build_toy_verifier.vocab_size = _tiny_vocab_size
build_toy_solver_verifier.vocab_size = _pair_vocab_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m astralight.tasks.warmstart",
                                     description="Build the warm-started toy policy folder.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--sft-steps", type=int, default=DEFAULT_SFT_STEPS)
    parser.add_argument("--lr", type=float, default=DEFAULT_LR)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--label-smoothing", type=float, default=DEFAULT_LABEL_SMOOTHING)
    parser.add_argument("--seed", type=int, default=0, help="prompt stream and batch order")
    parser.add_argument("--min-operand", type=int, default=DEFAULT_SOURCE_KWARGS["min_operand"])
    parser.add_argument("--max-operand", type=int, default=DEFAULT_SOURCE_KWARGS["max_operand"])
    parser.add_argument("--ops", default=DEFAULT_SOURCE_KWARGS["ops"])
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads while training")
    parser.add_argument("--spec", default="{}",
                        help='JSON of TinyModelSpec fields to override, e.g. \'{"seed": 1}\'')
    parser.add_argument("--eval", action="store_true",
                        help="then print held-out avg@4 at temperature 1.0 and greedy accuracy")
    args = parser.parse_args(argv)
    try:
        spec = _as_spec(json.loads(args.spec))
    except (ValueError, TypeError) as exc:
        parser.error(f"--spec: {exc}")
    source_kwargs = {"min_operand": args.min_operand, "max_operand": args.max_operand, "ops": args.ops}
    start = time.monotonic()
    path = build_toy_policy(args.out_dir, spec, source_kwargs, args.sft_steps, args.lr,
                            args.batch_size, args.seed, args.label_smoothing,
                            num_threads=args.num_threads)
    result = {"out_dir": str(path), "seconds": round(time.monotonic() - start, 1)}
    if args.eval:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = build_tokenizer()
        result["heldout_avg@4_t1"] = heldout_accuracy(model, tokenizer, source_kwargs)
        result["heldout_greedy"] = heldout_accuracy(model, tokenizer, source_kwargs, k=1, temperature=0)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
