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

Plain torch (:func:`astralight.tasks.sft_loop.sft`), ~25 s on two CPU cores with the defaults.
Everything random (model init, prompt stream, batch order) is seeded, so the same arguments give
the same weights on the same machine and thread count. The token helpers here
(:func:`encode_examples`, :func:`sample_completions`) serve every warm start of the character
tokenizer, the solver-verifier pair's too (:mod:`astralight.tasks.solver_verifier_warmstart`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from astralight.tasks.arithmetic import ArithmeticSource
from astralight.tasks.sft_loop import Progress, check_sft_args, pad_examples, sft
from astralight.tasks.warmstart_folder import as_spec, build_folder, tiny_vocab_size
from astralight.trainer.tinymodel import TinyModelSpec, build_model, build_tokenizer

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
    src = ArithmeticSource(split="eval", eval_size=eval_size, **toy_source_kwargs(source_kwargs))
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


def toy_source_kwargs(source_kwargs: dict | None) -> dict:
    """A copy of the run's ``ArithmeticSource`` arguments, the toy recipe's when None."""
    return dict(DEFAULT_SOURCE_KWARGS if source_kwargs is None else source_kwargs)


def check_toy_args(source_kwargs: dict, sft_steps: int, batch_size: int, lr: float,
                   label_smoothing: float) -> None:
    """Raise ValueError naming the first toy warm-start argument out of range."""
    for key in ("split", "seed"):
        if key in source_kwargs:
            raise ValueError(f"source_kwargs: do not pass {key!r}; the warm start uses the train "
                             "split and its own seed argument")
    check_sft_args(sft_steps, batch_size, lr, label_smoothing)


def answer_support(tokenizer) -> torch.Tensor:
    """The ids label smoothing spreads its mass over: :data:`ANSWER_ALPHABET` and ``<eos>``."""
    return torch.tensor(tokenizer(ANSWER_ALPHABET, add_special_tokens=False)["input_ids"] + [EOS_ID])


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
    spec = as_spec(spec)
    source_kwargs = toy_source_kwargs(source_kwargs)
    check_toy_args(source_kwargs, sft_steps, batch_size, lr, label_smoothing)
    tokenizer = build_tokenizer()
    model = build_model(spec)
    src = ArithmeticSource(split="train", seed=seed, **source_kwargs)
    pool = [src.get(i) for i in range(min(POOL_SIZE, max(sft_steps * batch_size, 1)))]
    ids, attn, loss_mask = encode_examples(tokenizer, [p.prompt for p in pool],
                                           [p.metadata["answer"] for p in pool])
    sft(model, ids, attn, loss_mask, torch.ones_like(loss_mask), answer_support(tokenizer),
        sft_steps, lr, batch_size, seed, label_smoothing, progress)
    model.eval()
    return model, tokenizer


def build_toy_policy(out_dir: str | Path, spec: TinyModelSpec | dict | None = None,
                     source_kwargs: dict | None = None, sft_steps: int = DEFAULT_SFT_STEPS,
                     lr: float = DEFAULT_LR, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
                     label_smoothing: float = DEFAULT_LABEL_SMOOTHING,
                     progress: Progress | bool = True, num_threads: int | None = 1) -> Path:
    """Warm-start the tiny model and save it as a transformers/vLLM model folder at ``out_dir``.

    ``source_kwargs`` are the ``ArithmeticSource`` arguments other than ``split`` and ``seed``;
    pass the run's own (the defaults match the toy recipe). ``spec`` may be a dict of
    ``TinyModelSpec`` fields (from YAML). ``progress``: True prints to stderr, False is silent,
    or a ``(step, loss)`` callback. The folder is written next to ``out_dir`` and renamed into
    place at the end, so a crash never leaves a half-written folder that looks complete; it also
    holds ``warmstart.json`` (the arguments, for provenance). ``out_dir`` must not exist or be
    empty. ``num_threads``: torch intra-op threads while training (None: leave as is; see
    :func:`astralight.tasks.warmstart_folder.build_folder` for why 1 on a loaded machine).
    """
    spec = as_spec(spec)
    kwargs = dict(spec=spec, source_kwargs=toy_source_kwargs(source_kwargs), sft_steps=sft_steps,
                  lr=lr, batch_size=batch_size, seed=seed, label_smoothing=label_smoothing)
    provenance = {**kwargs, "spec": asdict(spec)}
    return build_folder(out_dir, train_warmstart, kwargs, provenance, sft_steps, progress,
                        num_threads)


build_toy_policy.vocab_size = tiny_vocab_size
