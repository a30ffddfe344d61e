"""``dtype: auto`` for vLLM engines: bf16 where the hardware multiplies it, float32 elsewhere.

vLLM's CPU build takes bf16 as native on every x86 CPU; on an AVX2-only one its linear layers
fall back to torch's emulated bf16 GEMM, 13x slower than float32 (raas/cpu_features.py).
"""

from __future__ import annotations

import logging

import pytest

from astralight.raas import cpu_features
from astralight.raas.cpu_features import engine_dtype


@pytest.fixture
def cpu(monkeypatch):
    """Set the machine and its flags: ``cpu("x86_64", {"avx2"})``."""
    def set_cpu(machine: str, flags: set[str]) -> None:
        monkeypatch.setattr(cpu_features.platform, "machine", lambda: machine)
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    return set_cpu


def test_auto_is_float32_on_an_x86_cpu_without_native_bf16(cpu):
    cpu("x86_64", {"avx2", "fma", "avx512f"})
    assert engine_dtype("auto", cuda=False) == "float32"


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_is_bf16_on_an_x86_cpu_that_multiplies_it(cpu, flag):
    cpu("x86_64", {"avx2", flag})
    assert engine_dtype("auto", cuda=False) == "bfloat16"


def test_auto_is_bf16_on_cuda_and_off_x86(cpu):
    cpu("x86_64", {"avx2"})
    assert engine_dtype("auto", cuda=True) == "bfloat16"
    cpu("aarch64", set())
    assert engine_dtype("auto", cuda=False) == "bfloat16"


def test_an_explicit_dtype_is_kept_and_slow_bf16_is_logged_naming_the_field(cpu, caplog):
    cpu("x86_64", {"avx2"})
    with caplog.at_level(logging.WARNING, logger="astralight.raas"):
        assert engine_dtype("bfloat16", cuda=False, field="engines.policy.dtype") == "bfloat16"
    assert "engines.policy.dtype: bfloat16 on a CPU without AVX512-BF16" in caplog.text
    assert "set engines.policy.dtype: auto" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="astralight.raas"):
        assert engine_dtype("float16", cuda=False) == "float16"
        assert engine_dtype("bfloat16", cuda=True) == "bfloat16"
    assert caplog.text == ""


def test_cpu_flags_are_read_from_proc_cpuinfo():
    cpu_features.cpu_flags.cache_clear()
    flags = cpu_features.cpu_flags()
    assert isinstance(flags, frozenset)
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    assert ("avx2" in flags) == (" avx2" in text)
