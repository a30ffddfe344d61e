"""LoRA for a policy: the peft config from plain arguments, wrapping, naming and merging.

A policy trained with LoRA (``RLPolicy(lora={...})``) keeps its base weights frozen and trains
only the low-rank adapters, so what changes from version to version is a few MiB, not the model.
This module is everything about LoRA that is not Lightning and not the wire:

* :class:`LoraSpec` -- the config keys (``r``, ``alpha``, ``dropout``, ``target_modules``,
  ``use_rslora``, ``publish``), checked with errors that name the key and the fix;
* :func:`wrap_model` -- a Hugging Face model wrapped by peft (only adapter parameters train);
* :func:`adapter_state_dict` / :func:`adapter_config` -- the adapter tensors under the names
  ``PeftModel.save_pretrained`` writes (``base_model.model.<module>.lora_A.weight``) and its
  ``adapter_config.json`` as plain JSON data: the PEFT on-disk format vLLM's LoRA support loads;
* :func:`merged_state_dict` -- the merged weights ``W + (B @ A) * scaling`` under the base
  model's own names, for ``publish: merged`` (receivers need no LoRA support at all).

Why two publication modes. ``adapter`` moves only the adapter (full or bf16 delta, like any
version) and needs an engine with LoRA enabled (``VLLMEngine(enable_lora=True)``); generation
then pays the LoRA kernels' extra cost. ``merged`` moves the full merged weights (the existing
full/delta path, every merged tensor changes each version, so deltas are dense) and serves at
base-model speed on any engine.

peft is imported lazily, so importing this module costs nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

#: every linear layer of a Llama/Qwen decoder block (attention and MLP)
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj")
PUBLISH_MODES = ("adapter", "merged")
#: the prefix ``PeftModel.save_pretrained`` (and vLLM's loader) puts before module names
PEFT_PREFIX = "base_model.model."


@dataclass
class LoraSpec:
    """The ``lora:`` block of a policy config.

    Args:
        r: adapter rank (the RaaS's ``max_lora_rank`` must be at least this).
        alpha: LoRA alpha; the update is ``B @ A * alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).
        dropout: dropout on the adapter input. Must be 0 while the policy disables dropout
            (its default), because the two forward passes of micro-batching and the importance
            ratio on fresh data need a deterministic forward.
        target_modules: module names (suffixes) to adapt, or ``"all-linear"`` (peft's: every
            linear layer but the output head).
        use_rslora: rank-stabilised scaling ``alpha / sqrt(r)`` (vLLM supports it).
        publish: ``"adapter"`` (only the adapter tensors travel; the RaaS engine needs LoRA
            enabled) or ``"merged"`` (full merged weights under the base names).
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    use_rslora: bool = False
    publish: str = "adapter"

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r: must be an integer >= 1, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ValueError(f"lora.alpha: must be a number > 0, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout: must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.target_modules, str):
            if self.target_modules != "all-linear":
                raise ValueError("lora.target_modules: a list of module names (e.g. [q_proj, "
                                 f"v_proj]) or 'all-linear', got {self.target_modules!r}")
        else:
            mods = list(self.target_modules or [])
            if not mods or not all(isinstance(m, str) and m for m in mods):
                raise ValueError("lora.target_modules: must be a non-empty list of module names, "
                                 f"e.g. {list(DEFAULT_TARGET_MODULES)}; got {self.target_modules!r}")
            self.target_modules = mods
        if self.publish not in PUBLISH_MODES:
            raise ValueError(f"lora.publish: must be one of {PUBLISH_MODES}, got {self.publish!r}")

    @classmethod
    def from_config(cls, config: "LoraSpec | Mapping[str, Any] | None") -> "LoraSpec | None":
        """A spec from a config mapping (unknown keys are refused by name); None stays None."""
        if config is None or isinstance(config, LoraSpec):
            return config
        if not isinstance(config, Mapping):
            raise TypeError(f"lora: expected a mapping such as {{r: 8, alpha: 16}}, got "
                            f"{type(config).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"lora: unknown keys {unknown}; the keys are {sorted(known)}")
        return cls(**dict(config))

    @property
    def scaling(self) -> float:
        return self.alpha / (self.r ** 0.5) if self.use_rslora else self.alpha / self.r

    def to_dict(self) -> dict:
        return asdict(self)


def peft_config(spec: LoraSpec):
    """The ``peft.LoraConfig`` of ``spec`` (causal LM, no bias, standard init: B = 0, so the
    wrapped model starts exactly as the base model -- version 0 stays what the RaaS serves)."""
    from peft import LoraConfig

    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=float(spec.dropout),
                      target_modules=spec.target_modules, use_rslora=spec.use_rslora,
                      bias="none", task_type="CAUSAL_LM")


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft not installed: cannot be a PeftModel
        return False
    return isinstance(model, PeftModel)


def wrap_model(model, spec: LoraSpec):
    """``model`` wrapped by peft per ``spec``: base weights frozen, adapters trainable.

    Raises ValueError naming ``lora.target_modules`` when none of them is in the model.
    """
    from peft import get_peft_model

    try:
        return get_peft_model(model, peft_config(spec))
    except ValueError as exc:
        if "target" in str(exc).lower():
            raise ValueError(f"lora.target_modules: {spec.target_modules!r} do not match the "
                             f"model's modules ({exc})") from exc
        raise


def _adapter_name(model, adapter_name: str | None) -> str:
    return adapter_name or model.active_adapter


def adapter_state_dict(model, state: Mapping[str, Any] | None = None,
                       adapter_name: str | None = None) -> dict:
    """The adapter tensors named exactly as ``PeftModel.save_pretrained`` writes them, e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.

    ``state`` is the PeftModel's ``state_dict`` if given (e.g. gathered from FSDP shards).
    """
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model, state_dict=state,
                                          adapter_name=_adapter_name(model, adapter_name)))


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: sorted(o) if isinstance(o, (set, frozenset))
                                 else getattr(o, "value", str(o))))


def adapter_config(model, adapter_name: str | None = None) -> dict:
    """The adapter's ``adapter_config.json`` content as plain JSON data (sets become sorted
    lists, enums their values; ``inference_mode`` true, as ``save_pretrained`` writes it)."""
    cfg = _jsonable(model.peft_config[_adapter_name(model, adapter_name)].to_dict())
    cfg["inference_mode"] = True
    return cfg


def lora_scalings(model, adapter_name: str | None = None) -> dict[str, float]:
    """``{peft module name: scaling}`` of every LoRA layer (names as in the PeftModel's
    ``state_dict``, e.g. ``base_model.model.model.layers.0.self_attn.q_proj``)."""
    from peft.tuners.lora import LoraLayer

    name = _adapter_name(model, adapter_name)
    return {_clean_fqn(n): float(m.scaling[name]) for n, m in model.named_modules()
            if isinstance(m, LoraLayer) and name in getattr(m, "scaling", {})}


def _clean_fqn(name: str) -> str:
    """A module name without FSDP1 / activation-checkpoint / compile wrapper segments, as in a
    full state dict gathered with ``torch.distributed.checkpoint``."""
    for marker in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(marker, "")
    return name


def base_name(peft_name: str) -> str:
    """A PeftModel ``state_dict`` name as the base model's: the ``base_model.model.`` prefix and
    ``.base_layer`` segments removed."""
    name = peft_name[len(PEFT_PREFIX):] if peft_name.startswith(PEFT_PREFIX) else peft_name
    return name.replace(".base_layer.", ".")


def merged_state_dict(model, state: Mapping[str, Any] | None = None,
                      adapter_name: str | None = None) -> dict:
    """The merged weights ``W + (B @ A) * scaling`` under the base model's names.

    The model is not modified (unlike peft's ``merge_and_unload``): the merge is computed in
    float32 from ``state`` (the PeftModel's ``state_dict``; default: the current one, or e.g. a
    full state gathered from FSDP shards), so training continues on the unmerged adapters.
    Adapter tensors are left out; every other tensor is returned under its base name.
    """

    name = _adapter_name(model, adapter_name)
    state = dict(model.state_dict() if state is None else state)
    fan_in_fan_out = bool(getattr(model.peft_config[name], "fan_in_fan_out", False))
    merged: dict[str, Any] = {}  # by the base layer's state key
    for module, scaling in lora_scalings(model, name).items():
        a_key, b_key = f"{module}.lora_A.{name}.weight", f"{module}.lora_B.{name}.weight"
        w_key = f"{module}.base_layer.weight"
        if a_key not in state or b_key not in state or w_key not in state:
            raise ValueError(f"state: LoRA layer {module!r} lacks {a_key}, {b_key} or {w_key} "
                             "(only LoRA on linear layers can be merged here)")
        w, a, b = state[w_key], state[a_key], state[b_key]
        delta = (b.detach().float() @ a.detach().float()) * scaling
        if fan_in_fan_out:
            delta = delta.t()
        merged[w_key] = (w.detach().float() + delta.to(w.device)).to(w.dtype)
    out = {}
    for key, value in state.items():  # the state's order: each module's tensors stay adjacent
        if key in merged:
            out[base_name(key)] = merged[key]
        elif ".lora_" not in key:
            out[base_name(key)] = value
    return out


__all__ = ["LoraSpec", "DEFAULT_TARGET_MODULES", "PUBLISH_MODES", "PEFT_PREFIX", "peft_config",
           "is_peft_model", "wrap_model", "adapter_state_dict", "adapter_config", "lora_scalings",
           "base_name", "merged_state_dict"]
