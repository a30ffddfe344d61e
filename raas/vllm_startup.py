"""Process-wide settings that shorten a vLLM engine's start-up on CPU, applied by
:class:`~astralight.raas.vllm_engine.VLLMEngine` before it builds ``vllm.LLM``.

Each one removes work vLLM does at start-up that only a CUDA machine needs: the Dynamo trace of
its one compiled sampler helper, and the child interpreter its model registry starts to inspect
a model class without initializing CUDA.
"""

from __future__ import annotations


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
