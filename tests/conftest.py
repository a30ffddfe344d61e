"""Shared fixtures: a tiny locally built model folder, free loopback ports."""

from __future__ import annotations

import os
import socket

import pytest

# vLLM on CPU: a bounded KV cache (else start-up fails) and the in-process engine core (fast start).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A freshly built tiny Qwen3 model + char tokenizer folder (random weights, seed 0)."""
    from astralight.tinymodel import build_tiny_model_folder

    return build_tiny_model_folder(tmp_path_factory.mktemp("tiny_model") / "model")
