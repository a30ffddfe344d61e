"""A generic supervised warm start: prompt -> target pairs from a JSONL file, any causal LM.

Why: RL needs a policy that already produces the task's format sometimes (a model that never
earns a reward gets zero advantage everywhere and cannot learn). The shipped warm starts
(:mod:`astralight.tasks.warmstart` and its neighbours) each build their own task's examples;
this one takes the examples from a file, so a new task needs a JSONL file, not a new loop::

    {"prompt": "12+7=", "target": "19"}
    {"prompt": "3+30=", "target": "33"}

A recipe names it as its ``prepare`` step; ``{init_model}`` is the folder it writes::

    prepare:
      function: astralight.tasks.sft_warmstart.build_sft_policy
      kwargs: {data_path: data/my_task_sft.jsonl, sft_steps: 300, num_threads: 1}

Two kinds of model:

- ``model_path`` unset: the tiny Qwen3-architecture model with the character-level tokenizer
  (:mod:`astralight.trainer.tinymodel`), built fresh (``spec`` sets its shape). Every character of the
  prompts and targets must be in that tokenizer's alphabet (checked, naming the line);
- ``model_path``: any Hugging Face causal LM folder (or hub id): its own tokenizer and weights,
  fine-tuned in float32 and saved with ``save_pretrained`` (its generation config kept).

Each example is ``prompt + target + EOS``, tokenized without special tokens (as the RaaS's
single-turn workflow does unless told otherwise: no BOS), the loss on target and EOS tokens only.
The loop is the shipped warm starts' (:func:`astralight.tasks.sft_loop.sft`: AdamW, linear
warm-up then cosine decay to 10% of ``lr``, grad-norm clip 1.0, seeded batches); optional label
smoothing spreads ``label_smoothing`` over the tokens the targets use. The folder is written
next to ``out_dir`` and renamed into place (a crash never leaves a half-written model), with
``warmstart.json`` recording the arguments.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from astralight.tasks.sft_loop import Progress, check_sft_args, pad_examples, print_progress, sft
from astralight.trainer.tinymodel import CHARACTERS, TinyModelSpec

DEFAULT_SFT_STEPS = 300
DEFAULT_LR = 1e-2
DEFAULT_BATCH_SIZE = 32


def read_pairs(data_path: str | Path, prompt_key: str = "prompt",
               target_key: str = "target") -> list[tuple[str, str]]:
    """``(prompt, target)`` of every line of a JSONL file; blank lines are skipped. A line that
    is not a JSON object with both keys as strings raises ValueError naming the line."""
    path = Path(data_path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"data_path: cannot read {path}: {exc}") from None
    pairs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"data_path: {path} line {number} is not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str) \
                or not isinstance(row.get(target_key), str):
            raise ValueError(f"data_path: {path} line {number} needs string fields {prompt_key!r} "
                             f"and {target_key!r} (prompt_key / target_key name others)")
        pairs.append((row[prompt_key], row[target_key]))
    if not pairs:
        raise ValueError(f"data_path: {path} holds no examples")
    return pairs


def _tiny_model(spec: TinyModelSpec | dict | None, pairs: list[tuple[str, str]]):
    from astralight.tasks.warmstart_folder import as_spec
    from astralight.trainer.tinymodel import build_model, build_tokenizer

    alphabet = set(CHARACTERS)
    for number, (prompt, target) in enumerate(pairs, 1):
        unknown = sorted(set(prompt + target) - alphabet)
        if unknown:
            raise ValueError(f"data_path: example {number} has characters {unknown} that the tiny "
                             "tokenizer does not know (astralight.trainer.tinymodel.CHARACTERS); give "
                             "model_path of a model with its own tokenizer")
    return build_model(as_spec(spec)), build_tokenizer()


def _hf_model(model_path: str):
    from transformers import AutoTokenizer

    from astralight.trainer.hf_models import causal_lm_from_pretrained, check_model_path

    check_model_path(model_path, "model_path")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = causal_lm_from_pretrained(model_path, dtype=torch.float32)
    return model, tokenizer


def encode_pairs(tokenizer, pairs: list[tuple[str, str]], max_length: int | None = None):
    """Right-padded ``prompt + target + EOS`` ids, attention mask and loss mask (1 on target and
    EOS). Raises ValueError when the tokenizer has no EOS or an example exceeds ``max_length``."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("model_path: its tokenizer has no eos_token; the warm start must teach "
                         "the model where an answer ends")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    rows, masks = [], []
    for number, (prompt, target) in enumerate(pairs, 1):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        t = tokenizer(target, add_special_tokens=False)["input_ids"] + [eos]
        if max_length is not None and len(p) + len(t) > max_length:
            raise ValueError(f"data_path: example {number} is {len(p) + len(t)} tokens, more than "
                             f"the model's {max_length} positions; shorten it")
        rows.append(p + t)
        masks.append([0] * len(p) + [1] * len(t))
    return pad_examples(rows, masks, pad)


def train_sft(pairs: list[tuple[str, str]], model_path: str | None = None,
              spec: TinyModelSpec | dict | None = None, sft_steps: int = DEFAULT_SFT_STEPS,
              lr: float = DEFAULT_LR, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
              label_smoothing: float = 0.0, progress: Progress | None = None):
    """The model (``model_path``, or the tiny one of ``spec``) trained on ``pairs``; returns
    ``(model, tokenizer)``, the model in eval mode."""
    check_sft_args(sft_steps, batch_size, lr, label_smoothing)
    if model_path is None:  # seeded by spec.seed
        model, tokenizer = _tiny_model(spec, pairs)
    else:
        if spec is not None:
            raise ValueError("spec: shapes the tiny model only; leave it out with model_path")
        model, tokenizer = _hf_model(str(model_path))
    max_length = getattr(model.config, "max_position_embeddings", None)
    ids, attn, loss_mask = encode_pairs(tokenizer, pairs, max_length)
    support = torch.unique(ids[loss_mask > 0])  # the tokens targets use (smoothing's support)
    sft(model, ids, attn, loss_mask, torch.ones_like(loss_mask), support, sft_steps, lr,
         batch_size, seed, label_smoothing, progress)
    model.eval()
    return model, tokenizer


def build_sft_policy(out_dir: str | Path, data_path: str | Path, model_path: str | None = None,
                     spec: TinyModelSpec | dict | None = None, prompt_key: str = "prompt",
                     target_key: str = "target", sft_steps: int = DEFAULT_SFT_STEPS,
                     lr: float = DEFAULT_LR, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
                     label_smoothing: float = 0.0, progress: Progress | bool = True,
                     num_threads: int | None = 1) -> Path:
    """A recipe ``prepare`` function: warm-start a model on ``data_path``'s prompt -> target
    pairs and save it as a transformers/vLLM model folder at ``out_dir``.

    ``model_path``: a Hugging Face causal LM to start from (default: the tiny model, shaped by
    ``spec``, a dict of :class:`~astralight.trainer.tinymodel.TinyModelSpec` fields). ``prompt_key`` /
    ``target_key``: the JSONL fields. ``num_threads``: torch threads while training (None: as
    is; 1 is the safe choice on a loaded two-core machine). ``out_dir`` must not exist or be
    empty; the folder is written aside and renamed into place, with ``warmstart.json``.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"out_dir: {out} exists and is not an empty folder; remove it or "
                              "pick another")
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads: must be >= 1 or None, got {num_threads}")
    pairs = read_pairs(data_path, prompt_key, target_key)
    if progress is True:
        progress = print_progress(sft_steps)
    threads_before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        model, tokenizer = train_sft(pairs, model_path, spec, sft_steps, lr, batch_size, seed,
                                     label_smoothing, progress or None)
    finally:
        torch.set_num_threads(threads_before)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if model_path is None:
        from astralight.trainer.tinymodel import save_model_folder

        save_model_folder(model, tokenizer, tmp)
    else:
        tmp.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    record: dict[str, Any] = {"data_path": str(data_path), "examples": len(pairs),
                              "model_path": model_path, "spec": spec, "sft_steps": sft_steps,
                              "lr": lr, "batch_size": batch_size, "seed": seed,
                              "label_smoothing": label_smoothing}
    (tmp / "warmstart.json").write_text(json.dumps(record, indent=2, default=str))
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(tmp, out)
    return out


def _vocab_size(model_path: str | None = None, spec: TinyModelSpec | dict | None = None,
                **_: Any) -> int | None:
    """The vocabulary of the model :func:`build_sft_policy` builds with these arguments, before
    it is built (:func:`astralight.launch.prepared_vocab_size`): the tiny model's, or what a
    local ``model_path``'s ``config.json`` says (None for a hub id)."""
    if model_path is None:
        from astralight.tasks.warmstart_folder import as_spec

        return as_spec(spec).vocab_size
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else None


build_sft_policy.vocab_size = _vocab_size

__all__ = ["read_pairs", "encode_pairs", "train_sft", "build_sft_policy"]
