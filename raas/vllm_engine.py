"""The production engine: an in-process ``vllm.LLM`` (CPU build here, CUDA build on GPUs).

vLLM is imported only when a :class:`VLLMEngine` is constructed, so importing ``astralight.raas``
(the service, the config, the workflows) never pulls in vLLM; a machine without vLLM can still
run the service with another engine class, and the test suite can import everything.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from astralight.engine import Completion, ConstraintError, SamplingSpec, clamp_max_tokens
from astralight.raas import vllm_driver
from astralight.raas.cpu_features import engine_dtype, request_amx
from astralight.raas.engine import EngineBase
from astralight.raas.vllm_constraints import constraint_error, structured_outputs
from astralight.raas.vllm_startup import (explicit_kv_cache_env, inspect_models_in_process,
                                          no_torch_compile, with_env)
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


INFLIGHT_UPDATES = ("keep", "abort")
"""What a weight update does to requests in flight: continue under the new weights (partial
rollouts, per-token versions) or restart from the prompt."""

_ENGINE_IDS = itertools.count()


class _Request:
    """One request in flight (driver thread)."""

    __slots__ = ("rid", "prompt", "params", "future", "start_version")

    def __init__(self, rid: str, prompt: list[int], params: Any):
        self.rid, self.prompt, self.params = rid, prompt, params
        self.future: Future = Future()
        self.start_version = 0

    def finish(self, tokens: list[int], logprobs: list[float], reason: str,
               versions: list[int]) -> None:
        if not self.future.done():
            self.future.set_result(Completion(tokens, logprobs, reason,
                                              version=versions[0] if versions else
                                              self.start_version, versions=versions))


def _token_versions(spans: Any, n: int, default: int) -> list[int]:
    """Per-token versions from vLLM's ``CompletionOutput.weight_versions`` spans (labels are the
    versions the engine set with ``set_weight_version``); ``default`` where none is given."""
    out = [int(default)] * n
    for span in spans or ():
        try:
            version = int(span.version)
        except (TypeError, ValueError):  # "default": before the engine labelled its weights
            continue
        out[max(0, span.start):min(n, span.end)] = [version] * max(0, min(n, span.end)
                                                                   - max(0, span.start))
    return out


class VLLMEngine(EngineBase):
    """One policy served by vLLM; implements :class:`astralight.engine.Engine`.

    Continuous batching: :meth:`submit` (and so ``await generate``) queues one request on the
    process's :class:`~astralight.raas.vllm_driver.StepDriver`, which adds it to the running
    batch before its next step; each request finishes on its own. Weight updates, LoRA loads and
    read-backs run on the same thread between two steps.

    Args:
        model_path: a Hugging Face model folder (the same initial folder the trainer starts from;
            its weights are policy version ``version``).
        dtype: compute dtype of the engine; weights sent to :meth:`update_weights` are cast to it.
            ``"auto"`` (default): bf16 on CUDA and on CPUs that multiply bf16 natively, float32
            on other CPUs, where bf16 is emulated and ~13x slower
            (:func:`~astralight.raas.cpu_features.engine_dtype`).
        max_model_len: context length (prompt + completion); None takes the model's.
        seed: seeds vLLM's sampler, so a run is reproducible given the same requests.
        gpu_memory_utilization: share of GPU memory vLLM may use (GPU only).
        kv_cache_memory_bytes: KV-cache size; needed on CPU (or set VLLM_CPU_KVCACHE_SPACE, in
            GiB, which this replaces: vLLM alone would let the variable win).
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
        inflight_updates: ``"keep"`` (default): requests in flight when a weight version lands
            continue under it, their KV cache recomputed by the new weights, each token stamped
            with the version that sampled it (partial rollouts, as prime-rl and SkyRL do);
            ``"abort"``: they restart from their prompts under the new weights (a completion
            never spans versions; the tokens already generated are lost). LoRA adapter versions
            always restart them (a running request cannot change adapter).
        torch_compile: let vLLM ``torch.compile`` what it compiles besides the model (the
            sampler's count of log-prob ranks, every step). None: off on CPU with
            ``enforce_eager``, on elsewhere. On CPU that compile cost every engine start ~3 s of
            Dynamo tracing (2.4-3.0 s of a 2-token warm-up, against 0.03 s without), and on a
            fresh machine about a minute of inductor compilation, and the RaaS benchmark (a
            96-token vocabulary) was no slower eagerly. Off sets ``torch._dynamo.config.disable``
            on the step driver's thread, where every vLLM call runs (torch keeps that setting per
            thread); the engines of one RaaS share that thread, so one engine's off is all of
            theirs.
        engine_kwargs: anything else for ``vllm.LLM`` (tensor_parallel_size, tokenizer, ...).

    Behaviour log-probs are vLLM's ``processed_logprobs``: log-probs of the distribution actually
    sampled from (temperature and top-p applied), which is what an off-policy correction needs.

    Constrained decoding (``SamplingSpec.constraint``) is vLLM's structured outputs, with exact
    log-probs of the constrained distribution: :mod:`astralight.raas.vllm_constraints`.
    """

    #: honours ``SamplingSpec.constraint`` (see the class docstring)
    constrained_decoding = True

    def __init__(self, model_path: str, dtype: str = "auto", max_model_len: int | None = None,
                 seed: int = 0, gpu_memory_utilization: float | None = None,
                 kv_cache_memory_bytes: int | None = None, enforce_eager: bool | None = None,
                 warmup: bool = True, version: int = 0, enable_lora: bool = False,
                 max_lora_rank: int = 16, max_loras: int = 1, adapter_dir: str | None = None,
                 inflight_updates: str = "keep", torch_compile: bool | None = None,
                 engine_kwargs: dict | None = None):
        import torch
        from vllm import LLM  # lazy: see module docstring

        if inflight_updates not in INFLIGHT_UPDATES:
            raise ValueError(f"inflight_updates: expected one of {list(INFLIGHT_UPDATES)}, got "
                             f"{inflight_updates!r}")

        request_amx()  # before any vLLM kernel runs in this process (see cpu_features)
        dtype = engine_dtype(dtype, torch.cuda.is_available())

        if enforce_eager is None:
            enforce_eager = not torch.cuda.is_available()
        if torch_compile is None:
            torch_compile = torch.cuda.is_available() or not enforce_eager
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
        if not torch.cuda.is_available() and "enable_chunked_prefill" not in (engine_kwargs or {}):
            # vLLM 0.32 on CPU: a seeded request whose prompt is split across steps (chunked
            # prefill; e.g. 256 prompts beyond the 4,096-token step budget) fails with
            # "RuntimeError: CPU Generator does not use offset" (the runner rewinds the
            # request's generator, which CPU generators cannot). Whole prefills avoid it.
            kwargs["enable_chunked_prefill"] = False
        clash = set(kwargs) & set(engine_kwargs or {})
        if clash:
            raise ValueError(f"engine_kwargs: {sorted(clash)} are set by VLLMEngine's own arguments")
        kwargs.update(engine_kwargs or {})

        start = time.perf_counter()
        self.llm = None
        self._driver = vllm_driver.shared()
        # built on the driver thread: its profiling forward pass must not overlap another
        # engine's step (every vLLM call of this engine runs there from now on)
        # the engine core must run in this process: the driver's guarantees (an update lands
        # between two steps; every token is stamped with the weights that sampled it) hold only
        # when step() runs the core synchronously (vLLM's InprocClient). vLLM's multiprocess core
        # steps on its own and queues outputs, so queued old-weight tokens would be stamped new.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not torch_compile:
            self._driver.call(no_torch_compile)
        if not torch.cuda.is_available():
            inspect_models_in_process()
        kv_env = explicit_kv_cache_env(kv_cache_memory_bytes)
        self.llm = self._driver.call(lambda: with_env(kv_env, lambda: LLM(**kwargs)))
        self.start_s = time.perf_counter() - start
        core = type(getattr(self.llm.llm_engine, "engine_core", None)).__name__
        if core != "InprocClient":
            raise RuntimeError(f"VLLMEngine: vLLM started a {core} engine core; the step driver "
                               "needs the in-process core (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        self.inflight_updates = inflight_updates
        self._id = f"e{next(_ENGINE_IDS)}"
        self._request_ids = itertools.count()
        self._live: dict[str, _Request] = {}  # driver thread only
        self._closed = False
        self.requests_started = 0
        self.tokens_generated = 0  # tokens of finished requests
        self.steps_run = 0  # engine steps this engine took
        self.requests_spanning_update = 0  # in flight across a weight update ("keep")
        self.requests_restarted = 0  # restarted from their prompt by an update ("abort", LoRA)
        self.weight_updates = 0
        self.weight_pause_s_total = 0.0
        self.weight_pause_s_last = 0.0
        self.model_path = str(model_path)
        self.dtype = dtype
        self.version = version
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        #: the model's vocabulary (embedding rows), registered with the dataflow (engine_limits)
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
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
        self._driver.attach(self)
        if warmup:
            start = time.perf_counter()
            self.generate_batch([[self._warmup_token()] * 4], SamplingSpec(max_tokens=2))
            self.warmup_s = time.perf_counter() - start
        log.info("vLLM engine for %s up in %.2f s (warm-up %.2f s, %s)", model_path, self.start_s,
                 self.warmup_s, dtype)

    def _warmup_token(self) -> int:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tid = getattr(self.tokenizer, name, None)
            if tid is not None:
                return int(tid)
        return 0

    @property
    def version(self) -> int:
        """The policy version of the weights the engine computes with now."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        """Also labels vLLM's weights (``set_weight_version``): every token a later step samples
        carries it in its ``weight_versions`` span. Set from another thread (the weight sync
        moving a bit-identical version), the label follows before the next step."""
        self._version = int(value)
        llm = self.__dict__.get("llm")
        if llm is None:
            return
        label = str(self._version)
        if self._driver.on_driver_thread:
            llm.llm_engine.set_weight_version(label)
        else:
            self._driver.post(lambda: llm.llm_engine.set_weight_version(label))

    # ------------------------------------------------------------------ generation

    def submit(self, prompt_token_ids: list[int], params: SamplingSpec) -> Future:
        """Queue one request; it joins the next engine step (continuous batching)."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids: empty prompt")
        if self.llm is None or self._closed:
            raise RuntimeError("VLLMEngine: closed")
        request = _Request(f"{self._id}-{next(self._request_ids)}", list(prompt_token_ids),
                           self._sampling_params(prompt_token_ids, params))
        self._driver.post(lambda: self._add(request))
        return request.future

    def cancel(self, future: Future) -> None:
        """Abort the request behind ``future`` (its episode was cancelled)."""
        def abort():
            for rid, request in list(self._live.items()):
                if request.future is future:
                    self.llm.llm_engine.abort_request([rid])
                    del self._live[rid]
                    request.finish([], [], "abort", [])  # (nobody awaits it any more)
        if self.llm is not None:
            self._driver.post(abort)

    def _sampling_params(self, ids: list[int], params: SamplingSpec):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            structured_outputs=structured_outputs(params.constraint),
            temperature=params.temperature, top_p=params.top_p,
            max_tokens=clamp_max_tokens(len(ids), params.max_tokens, self.max_model_len),
            stop_token_ids=list(params.stop_token_ids), seed=params.seed,
            logprobs=0,  # only the sampled token's log-prob
            detokenize=False,  # the workflow decodes what it needs
            output_kind=RequestOutputKind.FINAL_ONLY,  # per-token versions: weight_versions spans
            # a fresh object per request, never reused: vLLM's defensive deep copy of it in
            # add_request was ~6% of the RaaS's Python time on the toy (py-spy); a shallow one does
            skip_clone=True,
        )

    # --- on the driver thread

    def _add(self, request: "_Request") -> None:
        if not request.future.set_running_or_notify_cancel():
            return
        if self._closed:
            request.future.set_exception(RuntimeError("VLLMEngine: closed"))
            return
        try:
            self.llm.llm_engine.add_request(request.rid, {"prompt_token_ids": request.prompt},
                                            request.params, lora_request=self._lora)
        except BaseException as exc:  # noqa: BLE001 - e.g. a prompt vLLM refuses
            if request.params.structured_outputs is not None and isinstance(exc, Exception):
                exc = constraint_error(exc)
            request.future.set_exception(exc)
            return
        request.start_version = int(self.version)
        self._live[request.rid] = request
        self.requests_started += 1

    def busy(self) -> bool:
        return bool(self._live)

    def step_once(self) -> None:
        self.steps_run += 1
        for out in self.llm.llm_engine.step():  # (FINAL_ONLY: finished requests only)
            request = self._live.pop(out.request_id, None)
            if request is None:  # aborted meanwhile
                continue
            o = out.outputs[0]
            tokens = list(o.token_ids)
            reason = str(o.finish_reason)
            self.tokens_generated += len(tokens)
            if reason == "error" and not tokens and request.params.structured_outputs is not None:
                # vLLM 0.32 fails a request this way when its grammar did not compile (the
                # scheduler's grammar_compile_error_reqs)
                request.future.set_exception(ConstraintError(
                    "vLLM could not compile the grammar of this constraint (its log says why)"))
                continue
            if reason in ("abort", "error"):  # vLLM gave up on it (our own cancel removes the
                # request first): never hand a truncated rollout to a workflow
                request.future.set_exception(RuntimeError(
                    f"vLLM finished request {out.request_id} with {reason!r} after "
                    f"{len(tokens)} tokens"))
                continue
            if tokens and (o.logprobs is None or len(o.logprobs) != len(tokens)):
                request.future.set_exception(RuntimeError(
                    "vLLM returned no per-token logprobs; is logprobs=0 honoured?"))
                continue
            logprobs = [float(step[t].logprob) for t, step in zip(tokens, o.logprobs or ())]
            request.finish(tokens, logprobs, reason,
                           _token_versions(o.weight_versions, len(tokens), request.start_version))

    def fail_all(self, exc: BaseException) -> None:
        live, self._live = self._live, {}
        for request in live.values():
            if not request.future.done():
                request.future.set_exception(exc)
        try:
            self.llm.llm_engine.abort_request(list(live))
        except Exception:  # noqa: BLE001 - the engine is already failing
            pass

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: dict[str, Any], version: int, partial: bool = False) -> None:
        """Load checkpoint-named tensors in place and set ``version``, between two engine steps.

        ``named_tensors`` is the full state, or with ``partial=True`` whole engine modules only
        (:meth:`weight_update_names` computes them; unsent modules keep their weights). All
        tensors go in ONE collective_rpc call as safetensors bytes (fused q/k/v and gate/up
        parameters need all their shards together); floating tensors are cast to the engine's
        dtype first (half the bytes for fp32 masters; vLLM would cast them anyway); the bytes are
        made on the calling thread, so generation pauses only for the load itself.

        Requests in flight (see ``inflight_updates``): ``"keep"`` -- they continue under the new
        weights; vLLM preempts them and recomputes their KV cache with the new weights (the
        prefix cache is reset with ``reset_running_requests``), so every later token and its
        behaviour log-prob are exactly the new version's and each token carries the version that
        sampled it. ``"abort"`` -- they are restarted from their prompts, so a completion never
        spans two versions (costs the tokens already generated).
        """
        if not named_tensors:
            raise ValueError("named_tensors: nothing to load")
        blob = safetensors_blob(named_tensors, self.dtype)
        count = len(named_tensors)

        def load():
            start = time.perf_counter()
            counts = self.llm.collective_rpc("load_safetensors", args=(blob, bool(partial)))
            if any(c != count for c in counts):
                raise RuntimeError(f"update_weights: workers loaded {counts} of {count} tensors")
            if self._lora is not None:  # a full-weight version is the whole policy: no adapter
                log.info("full-weight version %s replaces adapter %s", version, self._lora.lora_name)
                self._drop_adapter()
                self._restart_live()  # (their requests named the adapter that just went)
            self._after_weights_changed(int(version))
            self._note_pause(time.perf_counter() - start)

        self._driver.call(load)

    def _after_weights_changed(self, version: int) -> None:
        """On the driver thread: the cache and the requests in flight follow the new weights."""
        running = len(self._live)
        if running and self.inflight_updates == "abort":
            self._restart_live()
        # preempts what runs (its KV is recomputed by the new weights) so the reset cannot be
        # refused; vLLM raises if it still fails, and the update fails with it
        if not self.llm.llm_engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("update_weights: vLLM refused to reset its prefix cache")
        self.requests_spanning_update += running if self.inflight_updates == "keep" else 0
        self.version = int(version)  # (labels the next steps' tokens: see the version setter)

    def _restart_live(self) -> None:
        """Restart every request in flight from its prompt (new id; what it had is dropped)."""
        live = list(self._live.values())
        if not live:
            return
        self.llm.llm_engine.abort_request([r.rid for r in live])
        self._live = {}
        for request in live:
            request.rid = f"{request.rid}r"
            try:
                self.llm.llm_engine.add_request(request.rid, {"prompt_token_ids": request.prompt},
                                                request.params, lora_request=self._lora)
            except BaseException as exc:  # noqa: BLE001 - this request fails, the rest go on
                request.future.set_exception(exc)
                continue
            self._live[request.rid] = request
        self.requests_restarted += len(live)

    def _note_pause(self, seconds: float) -> None:
        self.weight_pause_s_total += seconds
        self.weight_pause_s_last = seconds
        self.weight_updates += 1

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
            from astralight.raas.weight_sync import EngineConfigError

            raise EngineConfigError(
                "update_adapter: this engine was started without LoRA support; set enable_lora: "
                "true (and max_lora_rank >= the adapter's r) in its engine config, or publish "
                "merged weights (lora.publish: merged)")
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

        def load():
            start = time.perf_counter()
            try:
                if not self.llm.llm_engine.add_lora(request):
                    raise RuntimeError(f"vLLM did not load adapter {name}")
            except Exception:
                shutil.rmtree(path, ignore_errors=True)
                raise
            old, self._lora = self._lora, request
            # a running request cannot change adapter: restart those in flight on the new one
            # (before the old adapter goes), so no completion mixes two adapter versions
            if self._live:
                self._restart_live()
            if old is not None:
                self._remove_adapter(old)
            self.llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
            self.adapter_loads += 1
            self.version = int(version)
            self._note_pause(time.perf_counter() - start)

        self._driver.call(load)

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
        blobs = self._driver.call(lambda: self.llm.collective_rpc("held_weights", args=(names,)))
        held = load(bytes(blobs[0]))
        if shapes is not None:
            held = {n: held[n][tuple(slice(0, int(s)) for s in shapes[n])].contiguous()
                    for n in names if n in held}
        return held

    def _packed_modules(self) -> dict[str, list[str]]:
        try:
            mapping = self._driver.call(lambda: self.llm.collective_rpc("packed_modules_mapping"))
            return mapping[0] or dict(DEFAULT_PACKED_MODULES)
        except Exception as exc:  # an older worker extension: assume the Llama/Qwen fusions
            log.warning("packed_modules_mapping unavailable (%s); assuming %s", exc,
                        DEFAULT_PACKED_MODULES)
            return dict(DEFAULT_PACKED_MODULES)

    def close(self) -> None:
        """Shut the engine core down and free its memory."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return

        def shutdown():
            self._closed = True  # requests posted after this fail in _add
            self._driver.detach(self)
            self.fail_all(RuntimeError("VLLMEngine: closed with the request in flight"))
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()

        self._driver.call(shutdown)
        if self._lora is not None:
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
            self._lora = None
        if self._own_adapter_dir and self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        self.llm = llm = None  # (drop the last references before collecting)
        gc.collect()
