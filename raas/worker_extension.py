"""vLLM worker extension: in-place weight reload from safetensors bytes.

vLLM mixes this class into its worker when the engine is created with
``worker_extension_cls="astralight.raas.worker_extension.WeightReloadExtension"``; the engine then
calls it with ``llm.collective_rpc("load_safetensors", args=(data,))``, once per worker (every
tensor-parallel rank gets the full tensors and its weight loaders shard them).

Why this shape (measured on vLLM 0.32):
- ``model_runner.reload_weights(weights_iterator=...)`` goes through vLLM's layer-wise reload,
  which re-runs each layer's post-load processing (e.g. the CPU backend's packed weight layout).
  ``model.load_weights`` alone silently leaves such layers unchanged.
- Fused parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj) are filled shard by shard, so all
  shards of a fused parameter must arrive in the same call: send the whole state dict at once.
- Bytes, not tensors, cross the RPC: safetensors is a plain, pickle-free format and works the same
  for the in-process engine and for multiprocess executors.

This module imports nothing from vLLM, so it is safe to import anywhere.
"""

from __future__ import annotations


class WeightReloadExtension:
    """Methods added to each vLLM worker (``self`` is the worker)."""

    def load_safetensors(self, data: bytes) -> int:
        """Load every tensor in ``data`` (a safetensors blob) into the model; return the count."""
        from safetensors.torch import load

        tensors = load(bytes(data))
        if not tensors:
            raise ValueError("data: the safetensors blob holds no tensors")
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)
