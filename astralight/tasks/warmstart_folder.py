"""Writing a warm-started tiny model as a model folder, and the tiny model's spec.

Every shipped builder (``build_toy_policy``, ``build_toy_solver``, ``build_toy_verifier``,
``build_chat_policy``) trains through :func:`build_folder`: the folder is written next to
``out_dir`` and renamed into place at the end, so a crash never leaves a half-written folder
that looks complete, and it holds ``warmstart.json`` (the arguments, for provenance).
:func:`as_spec` reads a :class:`~astralight.trainer.tinymodel.TinyModelSpec` from a YAML recipe's dict.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Callable

import torch

from astralight.tasks.sft_loop import Progress, print_progress
from astralight.trainer.tinymodel import TinyModelSpec, save_model_folder


def as_spec(spec: TinyModelSpec | dict | None) -> TinyModelSpec:
    """``spec`` as a :class:`TinyModelSpec`: None is the default spec, a dict names its fields."""
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


def build_folder(out_dir: str | Path, train: Callable, kwargs: dict, provenance: dict,
                 sft_steps: int, progress: Progress | bool, num_threads: int | None) -> Path:
    """Train with ``train(**kwargs, progress=...)`` and save the ``(model, tokenizer)`` it
    returns as a transformers/vLLM model folder at ``out_dir``, with ``provenance`` as its
    ``warmstart.json``; returns ``out_dir``, which must not exist or be empty.

    ``progress``: True prints to stderr (:func:`print_progress` over ``sft_steps``), False is
    silent, or a ``(step, loss)`` callback. ``num_threads``: torch intra-op threads while
    training (None: leave as is). On a loaded two-core machine 1 is the safer choice: two OpenMP
    threads spin-wait for each other when one is descheduled, which can make a 25 s warm start
    take many minutes; 1 thread costs ~1.4x when the machine is idle.
    """
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


def tiny_vocab_size(spec: TinyModelSpec | dict | None = None, **_: object) -> int:
    """The vocabulary of the tiny model a builder makes with these keyword arguments (a
    builder's ``vocab_size``: the launcher reads it before the model exists,
    :func:`astralight.launch.prepared_vocab_size`)."""
    return as_spec(spec).vocab_size
