"""The inference-engine contract the RaaS and its workflows code against.

Workflows never touch vLLM directly: they see an :class:`Engine` (token ids in, token ids and the
behaviour log-prob of every generated token out), so the same workflow runs on the real vLLM
engine in production and on a small transformers engine in unit tests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class SamplingSpec:
    """How to sample, independent of any engine's own parameter class.

    Args:
        temperature: softmax temperature; 0 means greedy. Behaviour log-probs are those of the
            distribution actually sampled from (temperature applied).
        top_p: nucleus sampling mass (1.0 = off).
        max_tokens: most tokens to generate per completion (the engine also clamps it so that
            prompt + completion fit its context).
        stop_token_ids: extra token ids that end a completion (the model's EOS always does).
            The stop token is part of the completion and is trained on.
        seed: if set, completion ``i`` of a ``generate`` call uses seed ``seed + i`` (the same
            prompt repeated ``n`` times still gets ``n`` different samples); if None the engine's
            own seeded generator is used, which advances from call to call.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")


@dataclass
class Completion:
    """One generated continuation: its tokens and the behaviour log-prob of each.

    ``token_ids`` includes the EOS / stop token when generation ended on one.
    ``finish_reason`` is ``"stop"`` (EOS or a stop token) or ``"length"`` (hit max_tokens).
    ``version`` is the policy version that generated it, when the engine knows (a
    :class:`SerializedEngine` stamps it); workflows fall back to ``engine.version``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"logprobs: {len(self.logprobs)} values for {len(self.token_ids)} tokens"
            )


@runtime_checkable
class Engine(Protocol):
    """What a workflow may use. ``version`` is the policy version of the loaded weights."""

    version: int
    tokenizer: Any

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingSpec) -> list[Completion]:
        """One completion per prompt, in order; batch everything into one call."""
        ...

    def update_weights(self, named_tensors: dict[str, Any], version: int) -> None:
        """Replace the weights (checkpoint names, full tensors) and set ``version``.

        Optional partial updates: an engine that also has
        ``weight_update_names(changed, all_names) -> list[str]`` (the names that must travel with
        ``changed``, e.g. whole fused modules) accepts ``update_weights(subset, version,
        partial=True)`` with exactly such a subset; the weight sync then sends only what changed.
        An engine without it always receives the whole state.

        Optional LoRA adapters: an engine that also has
        ``update_adapter(named_tensors, version, adapter)`` serves adapter versions (a policy
        trained with ``lora: {publish: adapter}``): ``named_tensors`` are the adapter tensors
        under PEFT names, ``adapter`` the manifest's ``metadata["adapter"]`` (its
        ``peft_config``); generation then uses base weights + that adapter. The weight sync
        hands adapter versions only to that method, never to ``update_weights``.
        """
        ...

    def close(self) -> None:
        ...


_PROCESS_ENGINE_LOCK = threading.RLock()


class SerializedEngine:
    """An engine shared by concurrent lease cycles: one ``generate`` or weight update at a time.

    vLLM's offline engine is not re-entrant, and a weight update must not land in the middle of
    a generation. With several lease cycles in flight (``RaaSConfig.concurrent_cycles``), one
    cycle may wait on a slow tool call while another generates; each completion is stamped with
    the version that produced it, because the weights may change between two calls of the same
    cycle. Every other attribute is the wrapped engine's.

    By default all engines of the process share one lock: vLLM's in-process engines keep global
    state (the forward context), so two of them must not run a forward pass at the same time
    either (measured: a solver and a verifier engine generating from two threads crash vLLM).
    """

    def __init__(self, engine: Any, lock: Any = None):
        self.inner = engine
        self.lock = lock if lock is not None else _PROCESS_ENGINE_LOCK

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:  # the weight sync moves a version with no change
        with self.lock:
            self.inner.version = value

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingSpec) -> list[Completion]:
        with self.lock:
            version = int(self.inner.version)
            out = self.inner.generate(prompt_token_ids, params)
        for c in out:
            c.version = version
        return out

    def update_weights(self, named_tensors: dict[str, Any], version: int, **kw: Any) -> None:
        with self.lock:
            self.inner.update_weights(named_tensors, version, **kw)

    @property
    def update_adapter(self):
        """The wrapped engine's ``update_adapter`` under the lock; absent (AttributeError, so
        ``hasattr`` tells) when the wrapped engine has none."""
        load = self.inner.update_adapter

        def locked(named_tensors: dict[str, Any], version: int, adapter: Any) -> None:
            with self.lock:  # never in the middle of a generation, like update_weights
                load(named_tensors, version, adapter)

        return locked

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def clamp_max_tokens(prompt_len: int, max_tokens: int, max_model_len: int | None) -> int:
    """``max_tokens`` reduced so prompt + completion fit ``max_model_len``.

    Raises ValueError naming the prompt length when the prompt alone leaves no room, so a
    too-long prompt fails with the fix in the message instead of inside the engine.
    """
    if max_model_len is None:
        return max_tokens
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(
            f"prompt_token_ids: a prompt of {prompt_len} tokens leaves no room in "
            f"max_model_len={max_model_len}; raise max_model_len or shorten the prompt"
        )
    return min(max_tokens, room)
