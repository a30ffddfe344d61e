"""Shared fixtures: a tiny locally built model folder, free loopback ports."""

from __future__ import annotations

import os
import socket

import pytest

# vLLM on CPU: a bounded KV cache (else start-up fails) and the in-process engine core (fast start).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _process_stop_state_is_per_test():
    """Tests that run ``astralight fit`` in this process install its SIGTERM handler (the
    client's ``wake_on_sigterm``), and a test that then raises SIGTERM sets the process-wide
    ``STOP_WAITING`` flag: each test starts with SIGTERM's handler and that flag as they were."""
    import signal

    from astralight.dataflow.client import STOP_WAITING

    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)
    STOP_WAITING.clear()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A freshly built tiny Qwen3 model + char tokenizer folder (random weights, seed 0)."""
    from astralight.trainer.tinymodel import build_tiny_model_folder

    return build_tiny_model_folder(tmp_path_factory.mktemp("tiny_model") / "model")


@pytest.fixture(scope="session")
def tool_policy_dir(tmp_path_factory):
    """A tiny chat model warm-started on the tool-use toy's first 16 train prompts (half of
    them solved with the ``add`` tool, half answered directly), memorised in ~150 steps: on
    those prompts it calls the tool in about half of its episodes and is often right."""
    from astralight.tasks.chat_warmstart import build_chat_policy
    from astralight.tasks.tool_warmstart import tool_conversations
    from astralight.agents.tools import Tool
    from astralight.agents.toy_tools import add

    return build_chat_policy(tmp_path_factory.mktemp("tool_policy") / "model",
                             lambda: tool_conversations(16, tool_share=0.5, result_noise=0.0),
                             [Tool(add).schema], sft_steps=150, lr=1e-2, progress=False,
                             num_threads=1)


@pytest.fixture
def stand_in_search_corpora(monkeypatch):
    """Search tools read their corpus when a workflow is built; the shipped configs name corpora
    that live on GPU clusters, so while a config is checked a missing corpus reads as a stand-in."""
    from pathlib import Path

    import astralight.agents.search as search

    real = search.read_corpus

    def read(path):
        if Path(path).expanduser().exists():
            return real(path)
        return [{"id": "0", "title": "stand-in", "text": "a stand-in passage"}]

    monkeypatch.setattr(search, "read_corpus", read)


@pytest.fixture
def stand_in_model_config(tmp_path):
    """``f(path) -> path``: a copy of a shipped RaaS config whose local model folders that nobody
    prepared here (``runs/toy/models/init``, built by ``astralight prepare-toy``) are an empty
    stand-in, since the RaaS parser refuses a missing local folder."""
    from pathlib import Path

    import yaml

    from astralight.trainer.hf_models import is_local_path

    def copy(path):
        config = yaml.safe_load(Path(path).read_text())
        for engine in (config.get("engines") or {}).values():
            model = engine.get("model_path") if isinstance(engine, dict) else None
            if isinstance(model, str) and is_local_path(model) and not Path(model).exists():
                engine["model_path"] = str(tmp_path)
        out = tmp_path / Path(path).name
        out.write_text(yaml.safe_dump(config, sort_keys=False))
        return out

    return copy
