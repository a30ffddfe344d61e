"""The production engine: an in-process ``vllm.LLM`` (CPU build here, CUDA build on GPUs).

vLLM is imported only when a :class:`VLLMEngine` is constructed, so importing ``astralight.raas``
(the service, the config, the workflows) never pulls in vLLM; a machine without vLLM can still
run the service with another engine class, and the test suite can import everything.
"""

from __future__ import annotations

import gc
import json
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from astralight.raas.engine import Completion, SamplingSpec, clamp_max_tokens
from astralight.raas.weight_groups import DEFAULT_PACKED_MODULES, expand_to_modules

log = logging.getLogger(__name__)

#: import path vLLM uses to mix the weight-reload methods into its workers
WORKER_EXTENSION = "astralight.raas.worker_extension.WeightReloadExtension"


def safetensors_blob(named_tensors: dict[str, Any], dtype: Any = None) -> bytes:
    """``named_tensors`` as safetensors bytes: on CPU, contiguous, floating ones cast to ``dtype``.

    Tensors that share storage (tied embeddings, views of one buffer) are copied, because
    safetensors refuses shared storage.
    """
    import torch
    from safetensors.torch import save

    target = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype  # "auto": keep
    if not isinstance(target, torch.dtype):
        target = None
    prepared, seen = {}, set()
    for name, t in named_tensors.items():
        t = t.detach().to("cpu")
        if target is not None and t.is_floating_point() and t.dtype != target:
            t = t.to(target)
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        prepared[name] = t.contiguous()
    return save(prepared)


#: adapter tensor names as ``PeftModel.save_pretrained`` writes them (what vLLM's loader reads)
_PEFT_TENSOR = re.compile(r"^base_model\.model\..+\.lora_[AB]\.weight$")


def adapter_peft_config(adapter: Mapping[str, Any]) -> dict:
    """The peft config (``adapter_config.json`` content) in a manifest's ``metadata["adapter"]``
    (``{"type": "lora", "adapter_name", "peft_config": {...}}``) or given bare."""
    if not isinstance(adapter, Mapping):
        raise TypeError(f"adapter: expected a mapping, got {type(adapter).__name__}")
    kind = adapter.get("type", "lora")
    if str(kind).lower() != "lora":
        raise ValueError(f"adapter.type: only 'lora' adapters can be served, got {kind!r}")
    config = adapter.get("peft_config", adapter)
    if not isinstance(config, Mapping) or "r" not in config or "target_modules" not in config:
        raise ValueError("adapter.peft_config: needs at least r, lora_alpha and target_modules "
                         "(a peft LoraConfig.to_dict())")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"adapter.peft_config.peft_type: only LORA is supported, got {peft_type!r}")
    config = {k: v for k, v in config.items() if k != "type"}
    config["inference_mode"] = True
    return config


def write_peft_folder(path: str | Path, named_tensors: Mapping[str, Any], config: Mapping) -> Path:
    """Write a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``),
    atomically: a half-written folder never appears under ``path``."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {n: (t if isinstance(t, torch.Tensor) else torch.as_tensor(t)).detach().to("cpu")
               .contiguous().clone() for n, t in named_tensors.items()}
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


class VLLMEngine:
    """One policy served by vLLM; implements :class:`astralight.raas.engine.Engine`.

    Args:
        model_path: a Hugging Face model folder (the same initial folder the trainer starts from;
            its weights are policy version ``version``).
        dtype: compute dtype of the engine; weights sent to :meth:`update_weights` are cast to it.
        max_model_len: context length (prompt + completion); None takes the model's.
        seed: seeds vLLM's sampler, so a run is reproducible given the same requests.
        gpu_memory_utilization: share of GPU memory vLLM may use (GPU only).
        kv_cache_memory_bytes: KV-cache size; needed on CPU (or set VLLM_CPU_KVCACHE_SPACE).
        enforce_eager: disable CUDA graphs / compilation; None = eager on CPU, graphs on GPU.
        warmup: run one tiny generation now, so the first real call does not pay vLLM's
            one-time warm-up (seconds on CPU) in the middle of a lease.
        version: policy version of the weights in ``model_path`` (0 = the initial model).
        enable_lora: serve LoRA adapter versions (:meth:`update_adapter`; policies trained with
            ``lora: {publish: adapter}``). Full-weight updates keep working.
        max_lora_rank: largest adapter rank the engine accepts (vLLM sizes its LoRA buffers
            by it; keep it at the policy's ``lora.r``).
        max_loras: adapters resident at once (one is served; a new version is loaded next to
            the old one, which is then removed).
        adapter_dir: where adapter versions are written as PEFT folders for vLLM to load
            (default: a temporary folder removed by :meth:`close`).
        engine_kwargs: anything else for ``vllm.LLM`` (tensor_parallel_size, tokenizer, ...).

    Behaviour log-probs are vLLM's ``processed_logprobs``: log-probs of the distribution actually
    sampled from (temperature and top-p applied), which is what an off-policy correction needs.
    """

    def __init__(self, model_path: str, dtype: str = "bfloat16", max_model_len: int | None = None,
                 seed: int = 0, gpu_memory_utilization: float | None = None,
                 kv_cache_memory_bytes: int | None = None, enforce_eager: bool | None = None,
                 warmup: bool = True, version: int = 0, enable_lora: bool = False,
                 max_lora_rank: int = 16, max_loras: int = 1, adapter_dir: str | None = None,
                 engine_kwargs: dict | None = None):
        import torch
        from vllm import LLM  # lazy: see module docstring

        if enforce_eager is None:
            enforce_eager = not torch.cuda.is_available()
        kwargs: dict[str, Any] = dict(
            model=str(model_path), dtype=dtype, seed=seed, enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
        )
        for key, value in (("max_model_len", max_model_len),
                           ("gpu_memory_utilization", gpu_memory_utilization),
                           ("kv_cache_memory_bytes", kv_cache_memory_bytes)):
            if value is not None:
                kwargs[key] = value
        if enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=int(max_lora_rank),
                          max_loras=int(max_loras))
        clash = set(kwargs) & set(engine_kwargs or {})
        if clash:
            raise ValueError(f"engine_kwargs: {sorted(clash)} are set by VLLMEngine's own arguments")
        kwargs.update(engine_kwargs or {})

        start = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.start_s = time.perf_counter() - start
        self.model_path = str(model_path)
        self.dtype = dtype
        self.version = version
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.packed_modules = self._packed_modules()
        lora_config = getattr(self.llm.llm_engine.vllm_config, "lora_config", None)
        self.enable_lora = lora_config is not None
        self.max_lora_rank = int(lora_config.max_lora_rank) if lora_config is not None else 0
        self.adapter_dir = Path(adapter_dir) if adapter_dir is not None else None
        self._own_adapter_dir = False
        self._lora = None  # the LoRARequest every generation uses (None: the plain weights)
        self._lora_seq = 0  # vLLM caches adapters by int id: a new id for every loaded version
        self.adapter_loads = 0
        self.warmup_s = 0.0
        if warmup:
            start = time.perf_counter()
            self.generate([[self._warmup_token()] * 4], SamplingSpec(max_tokens=2))
            self.warmup_s = time.perf_counter() - start
        log.info("vLLM engine for %s up in %.2f s (warm-up %.2f s)", model_path, self.start_s,
                 self.warmup_s)

    def _warmup_token(self) -> int:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tid = getattr(self.tokenizer, name, None)
            if tid is not None:
                return int(tid)
        return 0

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingSpec) -> list[Completion]:
        """One completion per prompt, all in one vLLM call (vLLM batches them)."""
        from vllm import SamplingParams

        if not prompt_token_ids:
            return []
        per_request = []
        for i, ids in enumerate(prompt_token_ids):
            if not ids:
                raise ValueError(f"prompt_token_ids[{i}]: empty prompt")
            per_request.append(SamplingParams(
                temperature=params.temperature, top_p=params.top_p,
                max_tokens=clamp_max_tokens(len(ids), params.max_tokens, self.max_model_len),
                stop_token_ids=list(params.stop_token_ids),
                seed=None if params.seed is None else params.seed + i,
                logprobs=0,  # only the sampled token's log-prob
                detokenize=False,  # the workflow decodes what it needs
            ))
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_token_ids],
                                    per_request, use_tqdm=False, lora_request=self._lora)
        completions = []
        for out in outputs:
            o = out.outputs[0]
            tokens = list(o.token_ids)
            if o.logprobs is None or len(o.logprobs) != len(tokens):
                raise RuntimeError("vLLM returned no per-token logprobs; is logprobs=0 honoured?")
            logprobs = [float(step[tok].logprob) for tok, step in zip(tokens, o.logprobs)]
            completions.append(Completion(tokens, logprobs, str(o.finish_reason)))
        return completions

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: dict[str, Any], version: int, partial: bool = False) -> None:
        """Load checkpoint-named tensors in place and set ``version``.

        ``named_tensors`` is the full state, or with ``partial=True`` whole engine modules only
        (:meth:`weight_update_names` computes them; unsent modules keep their weights). All
        tensors go in ONE collective_rpc call as safetensors bytes (fused q/k/v and gate/up
        parameters need all their shards together); floating tensors are cast to the engine's
        dtype first (half the bytes for fp32 masters; vLLM would cast them anyway). The prefix
        cache is reset because cached KV blocks were computed by the old weights.
        """
        if not named_tensors:
            raise ValueError("named_tensors: nothing to load")
        blob = safetensors_blob(named_tensors, self.dtype)
        counts = self.llm.collective_rpc("load_safetensors", args=(blob, bool(partial)))
        if any(c != len(named_tensors) for c in counts):
            raise RuntimeError(f"update_weights: workers loaded {counts} of {len(named_tensors)} tensors")
        if self._lora is not None:  # a full-weight version is the whole policy: no adapter on top
            log.info("full-weight version %s replaces adapter %s", version, self._lora.lora_name)
            self._drop_adapter()
        self.llm.reset_prefix_cache()
        self.version = int(version)

    # ------------------------------------------------------------------ LoRA adapters

    @property
    def adapter(self) -> str | None:
        """The folder of the adapter generations use now (None: plain weights)."""
        return None if self._lora is None else self._lora.lora_path

    def update_adapter(self, named_tensors: dict[str, Any], version: int,
                       adapter: Mapping[str, Any]) -> None:
        """Serve LoRA adapter ``version`` from now on, without restarting the engine.

        ``named_tensors`` are the adapter tensors under PEFT names (``base_model.model.<module>
        .lora_A.weight`` / ``.lora_B.weight``), ``adapter`` the manifest's ``metadata["adapter"]``
        (or a bare peft config). They are written as a PEFT folder under :attr:`adapter_dir`,
        vLLM loads it now under a new adapter id (so a failure -- a rank above
        ``max_lora_rank``, an unsupported feature -- raises here and the engine keeps serving
        its current adapter and version), generations switch to it, and the previous adapter is
        removed. The adapter applies to the base weights the engine holds (the model folder's).
        """
        from vllm.lora.request import LoRARequest

        if not self.enable_lora:
            raise RuntimeError("update_adapter: this engine was started without LoRA support; "
                               "set enable_lora: true (and max_lora_rank >= the adapter's r) in "
                               "its engine config, or publish merged weights (lora.publish: merged)")
        if not named_tensors:
            raise ValueError("named_tensors: no adapter tensors")
        bad = [n for n in named_tensors if not _PEFT_TENSOR.match(n)]
        if bad:
            raise ValueError(f"named_tensors: {bad[:3]} are not PEFT LoRA tensor names "
                             "(base_model.model.<module>.lora_A.weight / .lora_B.weight)")
        config = adapter_peft_config(adapter)
        ranks = [int(config["r"]), *[int(r) for r in (config.get("rank_pattern") or {}).values()]]
        if max(ranks) > self.max_lora_rank:
            raise ValueError(f"adapter.peft_config.r: rank {max(ranks)} exceeds this engine's "
                             f"max_lora_rank={self.max_lora_rank}; raise max_lora_rank in the "
                             "engine config")
        self._lora_seq += 1
        seq = self._lora_seq
        name = f"adapter-v{int(version)}-{seq}"
        path = write_peft_folder(self._adapters_root() / name, named_tensors, config)
        request = LoRARequest(lora_name=name, lora_int_id=seq, lora_path=str(path))
        try:
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load adapter {name}")
        except Exception:
            shutil.rmtree(path, ignore_errors=True)
            raise
        old, self._lora = self._lora, request
        if old is not None:
            self._remove_adapter(old)
        self.llm.reset_prefix_cache()
        self.adapter_loads += 1
        self.version = int(version)

    def clear_adapter(self, version: int | None = None) -> None:
        """Generate with the plain weights again (optionally setting ``version``)."""
        self._drop_adapter()
        self.llm.reset_prefix_cache()
        if version is not None:
            self.version = int(version)

    def _drop_adapter(self) -> None:
        old, self._lora = self._lora, None
        if old is not None:
            self._remove_adapter(old)

    def _remove_adapter(self, request: Any) -> None:
        try:
            self.llm.llm_engine.remove_lora(request.lora_int_id)  # False if vLLM evicted it
        except Exception as exc:  # the folder still goes; vLLM evicts unused adapters anyway
            log.warning("could not unload adapter %s: %s", request.lora_name, exc)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def _adapters_root(self) -> Path:
        if self.adapter_dir is None:
            self.adapter_dir = Path(tempfile.mkdtemp(prefix="astralight-adapters-"))
            self._own_adapter_dir = True
        self.adapter_dir.mkdir(parents=True, exist_ok=True)
        return self.adapter_dir

    def weight_update_names(self, changed: Iterable[str], all_names: Iterable[str]) -> list[str]:
        """Names to send so that ``changed`` reaches the engine: whole fused modules."""
        return expand_to_modules(changed, all_names, self.packed_modules)

    def held_weights(self, shapes: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The bf16 weights the engine computes with, under checkpoint names (tensor parallel 1).

        ``shapes`` (``{name: shape}``, e.g. a manifest's tensor table) crops padded rows (vLLM
        pads the vocabulary) and restricts the result to those names. For tests and audits: it
        probes every linear kernel, so it costs about one forward pass per hidden size.
        """
        from safetensors.torch import load

        names = None if shapes is None else list(shapes)
        blobs = self.llm.collective_rpc("held_weights", args=(names,))
        held = load(bytes(blobs[0]))
        if shapes is not None:
            held = {n: held[n][tuple(slice(0, int(s)) for s in shapes[n])].contiguous()
                    for n in names if n in held}
        return held

    def _packed_modules(self) -> dict[str, list[str]]:
        try:
            return self.llm.collective_rpc("packed_modules_mapping")[0] or dict(DEFAULT_PACKED_MODULES)
        except Exception as exc:  # an older worker extension: assume the Llama/Qwen fusions
            log.warning("packed_modules_mapping unavailable (%s); assuming %s", exc,
                        DEFAULT_PACKED_MODULES)
            return dict(DEFAULT_PACKED_MODULES)

    def close(self) -> None:
        """Shut the engine core down and free its memory."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        if self._lora is not None:
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
            self._lora = None
        if self._own_adapter_dir and self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        self.llm = None
        del llm
        gc.collect()
