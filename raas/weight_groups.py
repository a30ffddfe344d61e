"""Which checkpoint tensors must travel together when only some weights change.

An inference engine does not hold checkpoint tensors one by one: vLLM fuses q/k/v into one
``qkv_proj`` and gate/up into one ``gate_up_proj``, and its in-place reload rebuilds a whole
module from what it receives (measured on vLLM 0.32, see ``worker_extension.py``: sending only
``q_proj`` leaves ``k_proj``/``v_proj`` of that layer as uninitialised memory). So a partial
update must send, for every module it touches, every checkpoint tensor of that module: all shards
of a fused module and all of its parameters (weight and bias). Qwen3's ``q_norm``/``k_norm`` are
modules of their own and travel alone.

Pure functions of names, no vLLM, so the RaaS computes the set to send without the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: vLLM's fusions for Llama/Qwen-style decoders (``Qwen3ForCausalLM.packed_modules_mapping``)
DEFAULT_PACKED_MODULES: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}


def engine_module(name: str, packed_modules: Mapping[str, Iterable[str]] | None = None) -> str:
    """The engine module a checkpoint tensor is loaded into.

    ``model.layers.0.self_attn.k_proj.weight`` -> ``model.layers.0.self_attn.qkv_proj``;
    ``model.norm.weight`` -> ``model.norm``.
    """
    packed = DEFAULT_PACKED_MODULES if packed_modules is None else packed_modules
    module = name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return f"{parent}.{fused}" if parent else fused
    return module


def expand_to_modules(changed: Iterable[str], all_names: Iterable[str],
                      packed_modules: Mapping[str, Iterable[str]] | None = None) -> list[str]:
    """``changed`` plus every tensor that shares an engine module with one of them.

    Returned in the order of ``all_names`` (a checkpoint's order keeps each module's tensors
    adjacent, which lets vLLM rebuild one module at a time). A changed name that is not in
    ``all_names`` raises ``KeyError`` naming it.
    """
    all_names = list(all_names)
    known = set(all_names)
    changed = list(changed)
    unknown = [n for n in changed if n not in known]
    if unknown:
        raise KeyError(f"changed: {unknown[:3]} are not tensors of this state")
    touched = {engine_module(n, packed_modules) for n in changed}
    return [n for n in all_names if engine_module(n, packed_modules) in touched]
