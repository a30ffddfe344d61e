"""The warm-started tiny models of the shipped toy tasks, under one import path, and their CLI.

Recipes name these builders as their ``prepare`` step (``function:
astralight.tasks.warmstart.build_toy_policy``); each saves a transformers/vLLM model folder and
has a ``vocab_size`` (the launcher reads it before the model exists). They live by task:

- :mod:`astralight.tasks.arithmetic_warmstart`: the toy arithmetic policy
  (:func:`build_toy_policy`, :func:`train_warmstart`, :func:`heldout_accuracy`) and the
  character-tokenizer helpers (:func:`encode_examples`, :func:`sample_completions`);
- :mod:`astralight.tasks.solver_verifier_warmstart`: the solver-verifier pair
  (:func:`build_toy_solver_verifier`, :func:`build_toy_solver`, :func:`build_toy_verifier`);
- :mod:`astralight.tasks.sft_loop`: the supervised loop they all run;
- :mod:`astralight.tasks.warmstart_folder`: the atomic model-folder write and ``warmstart.json``.

CLI (also ``astralight prepare-toy``)::

    python -m astralight.tasks.warmstart OUT_DIR [--sft-steps N] [--lr LR] [--batch-size B]
        [--label-smoothing EPS] [--seed S] [--max-operand M] [--eval]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from astralight.tasks.arithmetic_warmstart import (
    ANSWER_ALPHABET, DEFAULT_BATCH_SIZE, DEFAULT_LABEL_SMOOTHING, DEFAULT_LR, DEFAULT_SFT_STEPS,
    DEFAULT_SOURCE_KWARGS, EOS_ID, PAD_ID, POOL_SIZE, build_toy_policy, encode_examples,
    heldout_accuracy, sample_completions, train_warmstart,
)
from astralight.tasks.sft_loop import Progress, check_sft_args, pad_examples, print_progress
from astralight.tasks.solver_verifier_warmstart import (
    APPROVE_TOKEN, DEFAULT_MAX_OFFSET, DEFAULT_NEAR_SHARE, DEFAULT_RETRY_SHARE, DEFAULT_SHOW_WORK,
    DEFAULT_VERIFIER_LABEL_SMOOTHING, DEFAULT_VERIFIER_LR, DEFAULT_VERIFIER_STEPS, REJECT_TOKEN,
    build_toy_solver, build_toy_solver_verifier, build_toy_verifier, retry_examples,
    train_solver_warmstart, train_verifier_warmstart, verdict_accuracy, verifier_examples,
)
from astralight.tasks.warmstart_folder import as_spec as _as_spec
from astralight.trainer.tinymodel import build_tokenizer


def main(argv: list[str] | None = None, prog: str = "python -m astralight.tasks.warmstart") -> int:
    parser = argparse.ArgumentParser(prog=prog,
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


__all__ = [
    "ANSWER_ALPHABET", "APPROVE_TOKEN", "DEFAULT_BATCH_SIZE", "DEFAULT_LABEL_SMOOTHING",
    "DEFAULT_LR", "DEFAULT_MAX_OFFSET", "DEFAULT_NEAR_SHARE", "DEFAULT_RETRY_SHARE",
    "DEFAULT_SFT_STEPS", "DEFAULT_SHOW_WORK", "DEFAULT_SOURCE_KWARGS",
    "DEFAULT_VERIFIER_LABEL_SMOOTHING", "DEFAULT_VERIFIER_LR", "DEFAULT_VERIFIER_STEPS", "EOS_ID",
    "PAD_ID", "POOL_SIZE", "REJECT_TOKEN", "Progress", "build_toy_policy", "build_toy_solver",
    "build_toy_solver_verifier", "build_toy_verifier", "check_sft_args", "encode_examples",
    "heldout_accuracy", "main", "pad_examples", "print_progress", "retry_examples",
    "sample_completions", "train_solver_warmstart", "train_verifier_warmstart", "train_warmstart",
    "verdict_accuracy", "verifier_examples",
]


if __name__ == "__main__":
    raise SystemExit(main())
