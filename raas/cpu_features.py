"""What the CPU can do for vLLM's kernels: AMX tiles made usable, and the compute dtype picked.

AMX. Linux hands out the AMX tile state (XTILEDATA) only to a process that asked for it with
``arch_prctl(ARCH_REQ_XCOMP_PERM)``; a process that executes an AMX instruction without asking is
killed with SIGILL. vLLM's CPU attention picks its AMX kernel whenever the CPU reports AMX
(``torch.cpu._is_amx_tile_supported()``, bf16 KV cache), but does not ask, so on Sapphire Rapids
and newer the first forward pass dies with "Illegal instruction" (seen on this project's
machines). oneDNN asks only for its own AMX kernels. :func:`request_amx` asks once; every process
that runs vLLM kernels calls it: :class:`~astralight.raas.vllm_engine.VLLMEngine` for the
in-process engine, and the worker extension at import, which covers engine-core processes that
vLLM spawns (a permission does not survive ``exec``).

The dtype. vLLM's CPU build takes bf16 as native on every x86 CPU, but without AVX512-BF16 or
AMX-BF16 its linear layers fall back to torch's bf16 GEMM, which is emulated: on an AVX2-only
AMD EPYC (one of this project's machines) a toy-sized ``F.linear`` took 13x as long in bf16 as
in float32, and the GEMMs were 40% of the RaaS's CPU. :func:`engine_dtype` resolves
``dtype: auto`` to bf16 where the hardware multiplies it and to float32 elsewhere. Published
weights are bf16 either way, and float32 holds them exactly.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import sys

_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86_64
_result: bool | None = None
#: x86 flags (``/proc/cpuinfo``) of a matrix unit that multiplies bf16 natively
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
log = logging.getLogger("astralight.raas")


def request_amx() -> bool:
    """Ask the kernel for the AMX tile state; True if granted (or already held).

    A no-op returning False off Linux x86_64 or where the kernel refuses (no AMX, old kernel):
    then vLLM must not use AMX either, which it decides by itself from the CPU flags.
    """
    global _result
    if _result is not None:
        return _result
    _result = False
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return _result
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _result = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        _result = False
    return _result


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware. On x86 that takes AVX512-BF16 or AMX-BF16;
    other architectures are left to vLLM (True)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return True
    return any(flag in cpu_flags() for flag in BF16_FLAGS)


def engine_dtype(dtype: str, cuda: bool, field: str = "dtype") -> str:
    """The compute dtype to give vLLM for the requested ``dtype``.

    ``"auto"``: ``"bfloat16"`` on CUDA and on a CPU that multiplies bf16 natively, else
    ``"float32"`` (both hold the published bf16 weights exactly). Any other value is passed on
    as it is; ``"bfloat16"`` on a CPU without native bf16 is logged as slow, naming ``field``.
    """
    if dtype == "auto":
        return "bfloat16" if cuda or native_bf16() else "float32"
    if dtype in ("bfloat16", "bf16") and not cuda and not native_bf16():
        log.warning("%s: bfloat16 on a CPU without AVX512-BF16 or AMX-BF16: its bf16 matrix "
                    "products are emulated (13x slower than float32 on an AVX2 EPYC); set "
                    "%s: auto (float32 here) unless bf16 itself is what you test", field, field)
    return dtype
