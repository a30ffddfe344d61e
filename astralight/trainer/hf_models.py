"""Building and loading Hugging Face models safely from several threads.

Why: transformers' ``from_pretrained`` disables weight tying for the whole process while it
loads -- it replaces the *class* attribute ``PreTrainedModel.tie_weights`` with a no-op and puts
the saved function back at the end (``transformers.initialization.no_tie_weights``). Two loads
that overlap in two threads can restore each other's no-op, leaving tying off for the rest of the
process; a model built or loaded in another thread during a load is not tied either. An untied
Qwen3-0.6B/1.7B (``tie_word_embeddings: true``) then has a randomly initialised ``lm_head``
after ``from_pretrained`` (its checkpoint stores the embedding once), and a built model is saved
with two different matrices.

So every model astralight builds or loads goes through :data:`MODEL_LOCK` (no two of its own
loads overlap), and :func:`tie_if_configured` checks the result: when transformers meant to tie
the embeddings (the pair is still in the model's ``all_tied_weights_keys``: it removes a pair it
decided not to tie, e.g. for a checkpoint holding two different matrices) and they are not one
parameter, it ties them (the input embedding is the one a tied checkpoint stores) and says so in
the log.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

#: held while astralight builds or loads a transformers model (re-entrant)
MODEL_LOCK = threading.RLock()


def ties_embeddings(config: Any) -> bool:
    """Whether a transformers config asks for tied input/output embeddings."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))


def tie_if_configured(model: Any) -> bool:
    """Tie ``model``'s output embedding to its input embedding when its config asks for it and
    they are separate parameters; returns whether it had to. The output weight is replaced by
    the input one (what a tied checkpoint stores; a load that skipped tying initialised the
    output at random)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(base, "config", None)
    if config is None or not ties_embeddings(config):
        return False
    get_in = getattr(base, "get_input_embeddings", None)
    get_out = getattr(base, "get_output_embeddings", None)
    if not callable(get_in) or not callable(get_out):
        return False
    inp, out = get_in(), get_out()
    if inp is None or out is None or out.weight is inp.weight:
        return False
    if tuple(out.weight.shape) != tuple(inp.weight.shape):
        return False
    intended = getattr(base, "all_tied_weights_keys", None)
    if intended is not None:
        # transformers drops a pair from this mapping when it decides not to tie (a checkpoint
        # holding both matrices with different values): respect that decision
        names = [n for n, p in base.named_parameters(remove_duplicate=False) if p is out.weight]
        if not any(n in intended for n in names):
            return False
    log.warning("%s: the config ties the output embedding to the input embedding but they were "
                "separate (transformers' tying was off during construction: overlapping "
                "from_pretrained calls in two threads); tied them now", type(base).__name__)
    out.weight = inp.weight
    return True


def is_local_path(path: str) -> bool:
    """Whether a model path names a local folder, not a hub id: absolute, starting with
    ``./``, ``../`` or ``~``, or of more than two parts (``runs/toy/models/init``; a hub id is
    ``name`` or ``org/name``)."""
    return path.startswith(("/", "./", "../", "~")) or path.count("/") >= 2


def check_model_path(path: Any, key: str) -> None:
    """Refuse a local model folder that does not exist, naming the config ``key`` (without
    this, transformers takes it for a hub repo id and fails with "Repo id must be in the form
    'repo_name'", naming no key). Local: :func:`is_local_path`; a hub id (``org/name``) that
    is no folder here is left to transformers."""
    import os
    from pathlib import Path

    if isinstance(path, str) and is_local_path(path):
        if not Path(os.path.expanduser(path)).exists():
            raise ValueError(f"{key}: {path!r} does not exist; give the folder of a Hugging Face "
                             "model (config.json, weights, tokenizer) -- the same one the RaaS "
                             "and the trainer start from -- or build the toy one with "
                             "`astralight prepare-toy DIR`")


def causal_lm_from_pretrained(path: str, **kwargs: Any):
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` under :data:`MODEL_LOCK`, tied
    as its config says (:func:`tie_if_configured`)."""
    from transformers import AutoModelForCausalLM

    with MODEL_LOCK:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tie_if_configured(model)
    return model


def causal_lm_on_meta(config: Any, **kwargs: Any):
    """``AutoModelForCausalLM.from_config(config, **kwargs)`` on the meta device (names, shapes
    and ties, no memory), under :data:`MODEL_LOCK` and tied as the config says."""
    import torch
    from transformers import AutoModelForCausalLM

    with MODEL_LOCK, torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        tie_if_configured(model)
    return model


__all__ = ["MODEL_LOCK", "ties_embeddings", "tie_if_configured", "causal_lm_from_pretrained",
           "causal_lm_on_meta"]
