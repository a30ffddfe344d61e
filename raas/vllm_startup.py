"""Process-wide settings that shorten a vLLM engine's start-up on CPU, applied by
:class:`~astralight.raas.vllm_engine.VLLMEngine` before it builds ``vllm.LLM``.

Each one removes work vLLM does at start-up that only a CUDA machine needs: the Dynamo trace of
its one compiled sampler helper, the child interpreter its model registry starts to inspect a
model class without initializing CUDA, and a KV cache of the legacy variable's size in place of
the engine's own.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def no_torch_compile() -> None:
    """On the calling thread, ``torch.compile``'d functions run eagerly (Dynamo's ``disable``
    is checked per call, and a thread sees its own setting)."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def inspect_models_in_process() -> None:
    """Where there is no CUDA, vLLM's model registry inspects a model class in this process
    instead of a fresh Python subprocess.

    vLLM inspects an architecture it has no cached ``modelinfos`` entry for (a fresh machine, or
    a new vLLM) in a child interpreter, only so that importing the model cannot initialize CUDA
    in the parent. The child imports torch and vLLM again: 18 s on this 2-core machine, most of a
    fresh machine's first RaaS start (36 s against 18 s once cached). Without CUDA there is
    nothing to initialize, so the inspection runs here; vLLM still writes its cache. A vLLM
    without this private hook is left as it is.
    """
    from vllm.model_executor.models import registry

    if getattr(registry, "_run_in_subprocess", None) is not None:
        registry._run_in_subprocess = _call_here


def _call_here(fn):
    """``fn()``: what vLLM's ``_run_in_subprocess(fn)`` returns, computed in this process."""
    return fn()


#: vLLM's CPU KV-cache size in GiB (a legacy variable): on CPU it *replaces* an engine's
#: ``kv_cache_memory_bytes``
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def explicit_kv_cache_env(kv_cache_memory_bytes: int | None) -> dict[str, str | None]:
    """The environment an engine with ``kv_cache_memory_bytes`` set is built under: without
    ``VLLM_CPU_KVCACHE_SPACE``, which vLLM's CPU platform would otherwise put in its place (so a
    recipe's 256 MiB became the launcher default's 1 GiB, and every RaaS start zeroed 1 GiB). The
    engine's own argument is the more specific setting; the override is logged."""
    value = os.environ.get(KV_CACHE_ENV)
    if kv_cache_memory_bytes is None or not value:
        return {}
    log.info("kv_cache_memory_bytes=%d is used; %s=%s (GiB) is ignored for this engine",
             kv_cache_memory_bytes, KV_CACHE_ENV, value)
    return {KV_CACHE_ENV: None}


def _set_env(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def with_env(changes: dict[str, str | None], build):
    """``build()`` with ``changes`` applied to ``os.environ`` (None: unset), restored after."""
    saved = {k: os.environ.get(k) for k in changes}
    _set_env(changes)
    try:
        return build()
    finally:
        _set_env(saved)
