"""The policy's Hugging Face causal LM: loading, LoRA wrap, FSDP2 sharding, the KL reference, saving.

:func:`load_causal_lm` reads a model folder with float32 master weights and dropout off (the two
forward passes of micro-batching, and the ratio on fresh data, must agree);
:func:`empty_causal_lm` builds the same model on the meta device for the FSDP2 ranks that
receive their shards from rank zero. :func:`build_policy_models` is what
:meth:`astralight.policy.RLPolicy.configure_model` runs, :func:`save_model_folder` what
:meth:`astralight.policy.RLPolicy.save_pretrained` runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from astralight.trainer.hf_models import causal_lm_from_pretrained, causal_lm_on_meta
from astralight.trainer.lora import LoraSpec, wrap_model


def _disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _causal_lm_config(model_path: str, disable_dropout: bool):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    if disable_dropout:
        for name, value in list(vars(config).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, 0.0)
    return config


def load_causal_lm(model_path: str, disable_dropout: bool = True) -> torch.nn.Module:
    """Load a Hugging Face causal LM folder with float32 master weights (dropout off by default)."""
    config = _causal_lm_config(model_path, disable_dropout)
    model = causal_lm_from_pretrained(model_path, config=config, dtype=torch.float32)
    if disable_dropout:
        _disable_dropout(model)
    return model


def empty_causal_lm(model_path: str, disable_dropout: bool = True) -> torch.nn.Module:
    """The same model as :func:`load_causal_lm` built on the meta device: shapes, names and tied
    weights without memory or weights (no file read). FSDP2 ranks other than zero start from it
    and receive their shards from rank zero (:func:`astralight.trainer.fsdp2.shard_from_rank0`)."""
    model = causal_lm_on_meta(_causal_lm_config(model_path, disable_dropout),
                              dtype=torch.float32)
    if disable_dropout:
        _disable_dropout(model)
    return model


@dataclass
class PolicyModels:
    """What :func:`build_policy_models` returns: the trained model, the frozen KL reference
    (None without one), whether both are FSDP2-sharded, and where this rank's weights came
    from (``"file"``: read from the model folder; ``"rank0"``: built on the meta device, shards
    broadcast from rank zero)."""

    model: torch.nn.Module
    ref: torch.nn.Module | None
    sharded: bool
    weights_source: str


def build_policy_models(model_path: str, *, disable_dropout: bool, gradient_checkpointing: bool,
                        lora_spec: LoraSpec | None, seed: int, with_reference: bool,
                        trainer=None, module=None) -> PolicyModels:
    """Load the policy model (float32 masters) and, if ``with_reference``, the KL reference.

    With ``lora_spec`` the model is wrapped by peft (a ``PeftModel``: base weights frozen,
    adapters trainable, B = 0 so the wrapped model starts exactly as the base model); its
    adapters are drawn under ``seed``, so runs repeat and every rank starts from the same
    adapter. ``trainer`` (None outside a fit) decides the distribution: Lightning's
    ``FSDPStrategy`` (FSDP1) is refused (:func:`astralight.trainer.fsdp2.refuse_fsdp1`); under
    ``ModelParallelStrategy`` (FSDP2, the strategy gives ``module`` a device mesh) only global
    rank zero reads the weights (one full copy in host memory, not one per rank), and the model
    -- after the peft wrap -- and the reference are sharded with ``fully_shard`` per decoder
    layer and at the root (:func:`astralight.trainer.fsdp2.shard_from_rank0`; the trainer's
    ``precision`` maps onto FSDP2's mixed precision as documented there).
    """
    from astralight.trainer import fsdp2

    precision, mesh = None, None
    if trainer is not None:
        fsdp2.refuse_fsdp1(trainer.strategy)
        precision = trainer.precision
        mesh = fsdp2.data_parallel_mesh(module)
    reads = fsdp2.reads_weights(mesh)
    build = load_causal_lm if reads else empty_causal_lm
    model = build(model_path, disable_dropout)
    dtype = fsdp2.true_dtype(precision) if mesh is not None else None
    if dtype is not None:
        model.to(dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_spec is not None:
        # FSDP2, unlike DDP, broadcasts nothing: each rank keeps its own shard of the adapter
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = wrap_model(model, lora_spec)
    model.train()  # from_pretrained returns eval mode; dropout is already zeroed
    if mesh is not None:  # shard before loading the reference: one full copy at most
        fsdp2.shard_from_rank0(model, mesh, precision, trainer.strategy.root_device)
    ref = None
    if with_reference:
        ref = build(model_path, disable_dropout=True).eval()
        ref.requires_grad_(False)
        if dtype is not None:
            ref.to(dtype)
        if mesh is not None:
            # The reference is sharded like the policy: a full frozen copy per rank would cost
            # the memory FSDP saves (8B in fp32 is 32 GB); its forward all-gathers per layer
            # (no grad, resharded after each layer).
            fsdp2.shard_from_rank0(ref, mesh, precision, trainer.strategy.root_device)
    return PolicyModels(model, ref, sharded=mesh is not None,
                        weights_source="file" if reads else "rank0")


def save_model_folder(model: torch.nn.Module, model_path: str, path: str, sharded: bool) -> None:
    """Save ``model`` as a Hugging Face folder at ``path`` plus the tokenizer of ``model_path``
    (a peft model saves its adapter folder). ``sharded`` (FSDP2): every rank must call it, the
    shards are gathered tensor by tensor into rank zero's host memory and rank zero writes."""
    from transformers import AutoTokenizer

    if sharded:
        import torch.distributed as dist

        from astralight.trainer.fsdp2 import full_state_dict

        state = full_state_dict(model)
        if dist.get_rank() == 0:
            model.save_pretrained(path, state_dict=state, safe_serialization=True)
            with contextlib.suppress(Exception):
                AutoTokenizer.from_pretrained(model_path).save_pretrained(path)
        dist.barrier()
        return
    model.save_pretrained(path, safe_serialization=True)
    with contextlib.suppress(Exception):
        AutoTokenizer.from_pretrained(model_path).save_pretrained(path)
