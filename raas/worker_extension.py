"""vLLM worker extension: in-place weight reload from safetensors bytes, and a read-back.

vLLM mixes this class into its worker when the engine is created with
``worker_extension_cls="astralight.raas.worker_extension.WeightReloadExtension"``; the engine then
calls it with ``llm.collective_rpc("load_safetensors", args=(data,))``, once per worker (every
tensor-parallel rank gets the full tensors and its weight loaders shard them).

Why this shape (measured on vLLM 0.32):
- ``model_runner.reload_weights(weights_iterator=...)`` goes through vLLM's layer-wise reload,
  which re-runs each layer's post-load processing (e.g. the CPU backend's packed weight layout).
  ``model.load_weights`` alone silently leaves such layers unchanged.
- The unit of that reload is one vLLM *module*: a module that receives some tensors is rebuilt
  from an empty buffer filled with exactly what was sent (unsent parts of it are garbage), and a
  module that receives nothing keeps its current weights. So a partial update is correct if and
  only if it sends every tensor of each module it touches: all shards of a fused parameter
  (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and every parameter of that module (weight and
  bias). :func:`astralight.raas.weight_groups.expand_to_modules` computes that set from
  :meth:`packed_modules_mapping`; tests/integration/test_weight_sync_vllm.py checks it.
- Bytes, not tensors, cross the RPC: safetensors is a plain, pickle-free format and works the same
  for the in-process engine and for multiprocess executors.

:meth:`held_weights` reads back what the engine *computes with*, mapped to checkpoint (Hugging
Face) names, so tests can check vLLM's weights bit for bit against the trainer's published bf16
cast. On CPU, vLLM moves linear weights into a packed kernel layout and empties the parameter; the
read-back then probes the layer's own kernel with identity rows (``x @ W^T`` with ``x = I`` is
exact in bf16: every output is one product by 1.0 plus zeros; only the sign of a zero weight can be
lost). With LoRA enabled the base weights sit in each wrapped layer's ``base_layer`` and are read
back under the wrapper's (checkpoint) name; adapters are not part of the read-back.

This module imports nothing from vLLM at import time, so it is safe to import anywhere.
"""

from __future__ import annotations

import logging

from astralight.raas.cpu_features import request_amx

request_amx()  # vLLM imports this module in every worker process, before its first forward pass

#: messages vLLM's layer-wise reload logs for every module a *partial* update leaves alone
_PARTIAL_RELOAD_NOISE = ("Failed to load weights", "Following weights were not loaded")
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


class _DropPartialReloadNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(m in message for m in _PARTIAL_RELOAD_NOISE)


class WeightReloadExtension:
    """Methods added to each vLLM worker (``self`` is the worker)."""

    def load_safetensors(self, data: bytes, partial: bool = False) -> int:
        """Load every tensor in ``data`` (a safetensors blob) into the model; return the count.

        ``partial=True`` says the blob deliberately holds only some modules (whole modules, see
        the module docstring); vLLM's per-module "not loaded" warnings are then silenced.
        """
        from safetensors.torch import load

        tensors = load(bytes(data))
        if not tensors:
            raise ValueError("data: the safetensors blob holds no tensors")
        quiet = _DropPartialReloadNoise() if partial else None
        loggers = [logging.getLogger(n) for n in _RELOAD_LOGGERS]
        if quiet is not None:
            for lg in loggers:
                lg.addFilter(quiet)
        try:
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        finally:
            if quiet is not None:
                for lg in loggers:
                    lg.removeFilter(quiet)
        return len(tensors)

    def packed_modules_mapping(self) -> dict[str, list[str]]:
        """The model's fused modules, e.g. ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``."""
        model = self.model_runner.get_model()
        mapping = getattr(model, "packed_modules_mapping", None) or {}
        return {str(k): [str(p) for p in v] for k, v in dict(mapping).items()}

    def held_weights(self, names: list[str] | None = None) -> bytes:
        """What the engine holds, as a safetensors blob of bf16 tensors under checkpoint names.

        Fused parameters are split by their ``output_sizes`` (q/k/v, gate/up); padded vocabulary
        rows are not returned (the caller crops to the checkpoint shape). ``names`` restricts the
        result. Tensor parallelism is not supported (each rank holds only a shard).
        """
        import torch
        from safetensors.torch import save

        tp = getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1) or 1
        if tp != 1:
            raise NotImplementedError(
                f"held_weights: tensor_parallel_size={tp}: each rank holds a shard and reading "
                "sharded weights back is not built; audit with tensor_parallel_size=1")
        model = self.model_runner.get_model()
        mapping = getattr(model, "packed_modules_mapping", None) or {}
        wanted = None if names is None else set(names)
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for module_name, module in model.named_modules():
                params = dict(module.named_parameters(recurse=False))
                if not params:
                    continue
                # with enable_lora, vLLM wraps each adapted layer and keeps the weights in its
                # ``base_layer``: the checkpoint name is the wrapper's
                module_name = _strip_lora_wrapper(module_name)
                leaf = module_name.rpartition(".")[2]
                parent = module_name.rpartition(".")[0]
                for pname, param in params.items():
                    value = _effective(module, pname, param)
                    if value is None:
                        continue
                    parts = mapping.get(leaf)
                    sizes = getattr(module, "output_sizes", None)
                    if parts and sizes and len(parts) == len(sizes):
                        pieces = torch.split(value, list(sizes), dim=0)
                        for part, piece in zip(parts, pieces):
                            hf = f"{parent}.{part}.{pname}" if parent else f"{part}.{pname}"
                            if wanted is None or hf in wanted:
                                out[hf] = piece.to(torch.bfloat16).contiguous().clone()
                    else:
                        hf = f"{module_name}.{pname}"
                        if wanted is None or hf in wanted:
                            out[hf] = value.to(torch.bfloat16).contiguous().clone()
        return save(out)


def _strip_lora_wrapper(module_name: str) -> str:
    """``model.layers.0.self_attn.qkv_proj.base_layer`` -> ``model.layers.0.self_attn.qkv_proj``."""
    parts = [p for p in module_name.split(".") if p != "base_layer"]
    return ".".join(parts)


def _effective(module, pname: str, param):
    """The tensor a module computes with for parameter ``pname`` (None if it has none)."""
    import torch

    lookup = type(module).__name__ == "VocabParallelEmbedding"  # reads its parameter, no GEMM
    if pname == "weight" and not lookup and callable(getattr(module, "cpu_linear", None)):
        # CPU linear (and lm_head): the GEMM uses a packed copy of the weight (the parameter may
        # be emptied); probe that kernel with identity rows.
        k = _in_features(module)
        if k is None:
            return None
        dtype = getattr(module, "params_dtype", None) or torch.bfloat16
        cols = []
        for start in range(0, k, 1024):
            stop = min(k, start + 1024)
            eye = torch.zeros(stop - start, k, dtype=dtype)
            eye[torch.arange(stop - start), torch.arange(start, stop)] = 1
            cols.append(module.cpu_linear(eye, param, None))  # [chunk, N] = W[:, chunk]^T
        return torch.cat(cols, 0).t()
    if param.numel() == 0:
        return None
    return param.detach()


def _in_features(module):
    for attr in ("input_size_per_partition", "input_size", "embedding_dim"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
