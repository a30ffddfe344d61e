"""Make the CPU's AMX tiles usable before vLLM's CPU kernels run.

Linux hands out the AMX tile state (XTILEDATA) only to a process that asked for it with
``arch_prctl(ARCH_REQ_XCOMP_PERM)``; a process that executes an AMX instruction without asking is
killed with SIGILL. vLLM's CPU attention picks its AMX kernel whenever the CPU reports AMX
(``torch.cpu._is_amx_tile_supported()``, bf16 KV cache), but does not ask, so on Sapphire Rapids
and newer the first forward pass dies with "Illegal instruction" (seen on this project's
machines). oneDNN asks only for its own AMX kernels. :func:`request_amx` asks once; every process
that runs vLLM kernels calls it: :class:`~astralight.raas.vllm_engine.VLLMEngine` for the
in-process engine, and the worker extension at import, which covers engine-core processes that
vLLM spawns (a permission does not survive ``exec``).
"""

from __future__ import annotations

import ctypes
import platform
import sys

_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86_64
_result: bool | None = None


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
