"""Which tensors a trainer publishes, under which names: the state the weight publisher encodes.

:func:`publish_state` is the whole choice. Sharded strategies (FSDP1, FSDP2 / DTensor) gather
the full state onto rank 0's CPU first (a collective every rank joins), under the same names an
unsharded module has. Tied aliases (the same storage under a second name, e.g. ``lm_head.weight``
tied to the embeddings) keep only their first name, as ``save_pretrained`` does; integer buffers
are not weights and are never published. A ``peft.PeftModel`` contributes only its adapter
tensors, named as its ``save_pretrained`` writes them, together with the adapter metadata
receivers need -- or, when the LightningModule's ``lora_publish`` is ``"merged"``, the merged
weights ``W + B @ A * scaling`` under the base model's names.
"""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from astralight.trainer.fsdp2 import tied_aliases


def is_sharded(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """True when no single rank holds the whole model (FSDP1, FSDP2/DTensor)."""
    name = type(trainer.strategy).__name__
    if "FSDP" in name or "ModelParallel" in name:
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        return False
    return any(isinstance(p, DTensor) for p in pl_module.parameters())


def gather_full_state_dict(root: torch.nn.Module, prefix: str) -> dict[str, Tensor]:
    """Collective: the full (unsharded) state dict of ``root`` on rank 0's CPU, names under
    ``prefix`` with the prefix removed. Every rank must call it; ranks > 0 get ``{}``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if not prefix:
        return dict(state)
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft not installed: cannot be a PeftModel
        return False
    return isinstance(model, PeftModel)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside FSDP1 / activation-checkpoint wrappers (FSDP2 does not wrap)."""
    for attr in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module"):
        while hasattr(model, attr):
            model = getattr(model, attr)
    return model


def _clean_fqn(name: str) -> str:
    for marker in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(marker, "")
    return name


def _jsonable(obj: Any) -> Any:
    """A peft config as plain JSON data (sets become sorted lists, enums and others strings)."""
    return json.loads(json.dumps(obj, default=lambda o: sorted(o) if isinstance(o, (set, frozenset))
                                 else getattr(o, "value", str(o))))


def module_prefix(pl_module: pl.LightningModule, model: torch.nn.Module) -> str:
    """The state-dict prefix of ``model`` inside ``pl_module`` (wrapper names removed)."""
    if model is pl_module:
        return ""
    for name, module in pl_module.named_modules():
        if module is model or unwrap(module) is unwrap(model):
            return _clean_fqn(name + ".")
    raise ValueError("hf_model(): the module is not a submodule of the LightningModule, so "
                     "its sharded state cannot be gathered; override hf_model()")


def adapter_metadata(model: torch.nn.Module) -> dict:
    """``manifest.metadata["adapter"]`` of a peft model: type, adapter name and its config."""
    adapter = model.active_adapter
    return {"type": "lora", "adapter_name": adapter,
            "peft_config": _jsonable(model.peft_config[adapter].to_dict())}


def publish_state(trainer: pl.Trainer, pl_module: pl.LightningModule,
                  model: torch.nn.Module) -> dict[str, Tensor] | None:
    """The tensors of ``model`` (the HF module inside ``pl_module``) to publish, without copies;
    None on ranks > 0. See the module docstring for what is chosen."""
    inner = unwrap(model)
    if is_sharded(trainer, pl_module):
        root = getattr(trainer.strategy, "model", None) or pl_module
        state = gather_full_state_dict(root, module_prefix(pl_module, model))
        if not trainer.is_global_zero:
            return None
        # the gathered copies no longer share storage: drop tied names by the module's ties
        aliases = tied_aliases(inner)
        state = {k: v for k, v in state.items() if k not in aliases}
    else:
        if not trainer.is_global_zero:
            return None
        state = inner.state_dict()
    if is_peft(inner) and getattr(pl_module, "lora_publish", None) == "merged":
        from astralight.trainer.lora import merged_state_dict

        state = merged_state_dict(inner, state)  # W + B @ A * scaling, under the base names
    elif is_peft(inner):
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(inner, state_dict=state,
                                          adapter_name=inner.active_adapter)
    out: dict[str, Tensor] = {}
    seen: set[tuple[int, int, tuple]] = set()
    for name, t in state.items():
        if not isinstance(t, Tensor):
            continue
        alias = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.device.type != "meta" and alias in seen:
            continue
        seen.add(alias)
        if t.is_floating_point():
            out[name] = t.detach()
    return out


__all__ = ["adapter_metadata", "gather_full_state_dict", "is_peft", "is_sharded",
           "module_prefix", "publish_state", "unwrap"]
