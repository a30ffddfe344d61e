"""The inference-engine contract that workflows and the RaaS code against.

Workflows never touch vLLM directly: they see an :class:`Engine` (token ids in, token ids and the
behaviour log-prob of every generated token out), so the same workflow runs on the real vLLM
engine in production and on a small transformers engine in unit tests. This module holds what a
workflow needs of an engine (:class:`SamplingSpec`, :class:`Completion`, the :class:`Engine`
protocol, :class:`ConstraintError` and the helpers :func:`gather_all`, :func:`clamp_max_tokens`,
:func:`engine_limits`); the engines themselves, and their shared request machinery
(``EngineBase``, ``BatchedEngine``), live in the RaaS (``astralight.raas.engine``), which depends
on this module and not the reverse.

The contract is asynchronous and per request: ``await engine.generate(prompt_ids, params)`` is
one completion, and any number of them may be in flight at once from any number of episodes. The
engine batches whatever is in flight (vLLM: continuous batching, a request joins the next engine
step); nothing serializes callers. Weight updates land between two engine steps while requests
are running, so a completion may span versions: :attr:`Completion.versions` holds the version of
every generated token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
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
        seed: if set, this request samples with its own generator seeded ``seed``;
            ``generate_many`` / ``generate_batch`` give request ``i`` the seed ``seed + i`` (the
            same prompt repeated ``n`` times still gets ``n`` different samples), and workflows
            derive each request's seed from the task id too (:meth:`for_request` with ``key``),
            so two tasks with the same prompt get different samples. If None the engine's own
            seeded generator is used.
        constraint: constrained decoding (None: off), one of ``{"json_schema": SCHEMA}`` (the
            completion is a JSON document matching the JSON schema ``SCHEMA``, a dict),
            ``{"json_object": True}`` (any JSON object) or ``{"structural_tag": TAG}`` (xgrammar's
            structural tag format, ``{"type": "structural_tag", "format": {...}}``: constant
            strings, tags, JSON schemas, alternatives and repeats in sequence; the OpenAI endpoint
            forces tool calls with it). Tokens the constraint rules out at a step get probability
            0 and the rest are renormalised: the behaviour log-probs are those of this
            constrained distribution (with temperature and top-p), the one each token was sampled
            from. Only an engine with ``constrained_decoding = True`` honours it (vLLM); the
            others refuse such a spec (:class:`ConstraintError`), never ignore it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    constraint: dict | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.constraint is not None:
            check_constraint(self.constraint)

    def for_request(self, i: int, key: str = "") -> "SamplingSpec":
        """The spec of request ``i`` of a many-request call: its own seed, if seeded,
        ``seed + i``, offset by a stable hash of ``key`` (a task id) when one is given."""
        if self.seed is None or (i == 0 and not key):
            return self
        offset = zlib.crc32(key.encode()) if key else 0
        return dataclasses.replace(self, seed=(self.seed + offset + i) % (1 << 31))


#: the kinds of :attr:`SamplingSpec.constraint` (one key each)
CONSTRAINT_KINDS = ("json_schema", "json_object", "structural_tag")


def check_constraint(constraint: Any) -> None:
    """ValueError naming what is wrong unless ``constraint`` is one of the forms
    :attr:`SamplingSpec.constraint` documents (the shape only: whether a schema or tag compiles
    is the engine's to say, with :class:`ConstraintError`)."""
    if not isinstance(constraint, dict) or len(constraint) != 1 or next(
            iter(constraint)) not in CONSTRAINT_KINDS:
        raise ValueError(f"constraint: expected one of {{'json_schema': schema}}, "
                         f"{{'json_object': True}}, {{'structural_tag': tag}}, got "
                         f"{str(constraint)[:80]}")
    kind, value = next(iter(constraint.items()))
    if kind == "json_schema" and not isinstance(value, dict):
        raise ValueError("constraint.json_schema: must be a JSON schema object (a dict)")
    if kind == "json_object" and value is not True:
        raise ValueError("constraint.json_object: must be True")
    if kind == "structural_tag" and not (isinstance(value, dict)
                                         and value.get("type") == "structural_tag"
                                         and isinstance(value.get("format"), dict)):
        raise ValueError('constraint.structural_tag: expected {"type": "structural_tag", '
                         '"format": {...}}')


class ConstraintError(ValueError):
    """The engine cannot apply a :attr:`SamplingSpec.constraint`: it cannot constrain decoding
    at all, or this schema / tag uses what its grammar backend does not support or does not
    compile. The request is refused; nothing was sampled."""


@dataclass
class Completion:
    """One generated continuation: its tokens, the behaviour log-prob and version of each.

    ``token_ids`` includes the EOS / stop token when generation ended on one.
    ``finish_reason`` is ``"stop"`` (EOS or a stop token), ``"length"`` (hit max_tokens) or
    ``"abort"`` (cancelled). ``versions[i]`` is the policy version whose weights sampled token
    ``i``: a weight update that lands while the request runs splits it into spans (a partial
    rollout). ``version`` is the version of the first token (or, with no tokens, the engine's
    version when the request started); engines may give only ``version`` and ``versions`` is
    then filled with it.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int | None = None
    versions: list[int] | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"logprobs: {len(self.logprobs)} values for {len(self.token_ids)} tokens"
            )
        if self.versions is None:
            if self.version is not None:
                self.versions = [int(self.version)] * len(self.token_ids)
        elif len(self.versions) != len(self.token_ids):
            raise ValueError(f"versions: {len(self.versions)} values for "
                             f"{len(self.token_ids)} tokens")
        elif self.version is None and self.versions:
            self.version = int(self.versions[0])

    def token_versions(self, default: int) -> list[int]:
        """Per-token versions, ``default`` for an engine that stamped none."""
        return list(self.versions) if self.versions is not None else [int(default)] * len(
            self.token_ids)

    @property
    def spans_versions(self) -> bool:
        """True when a weight update landed while this completion was generated."""
        return bool(self.versions) and min(self.versions) != max(self.versions)


def engine_limits(engine: Any) -> dict[str, int]:
    """What ``engine`` can produce, as the RaaS registers it with the dataflow (``limits``):
    ``vocab_size`` (rows of the model's embedding: no token id at or above it exists) and
    ``max_model_len`` (prompt + completion tokens); each only when the engine has it as a
    positive int attribute. The dataflow refuses pushed samples outside them."""
    out: dict[str, int] = {}
    for key in ("vocab_size", "max_model_len"):
        value = getattr(engine, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = value
    return out


@runtime_checkable
class Engine(Protocol):
    """What a workflow may use. ``version`` is the policy version of the loaded weights;
    ``tokenizer`` the model's (Hugging Face) tokenizer, for prompts and chat templates.

    ``max_model_len``: the context length, prompt + completion tokens (vLLM's
    ``max_model_len``). A workflow keeps every episode within it: a prompt that leaves no room is
    skipped (:func:`astralight.workflows.base.encode_text_prompt`), each request's
    ``max_tokens`` is clamped to the room left (:func:`clamp_max_tokens`), and a multi-turn
    episode ends when its context is full. The RaaS registers it with the dataflow, which
    refuses a pushed sample longer than it (:func:`engine_limits`). ``vocab_size``: the rows of
    the model's embedding (no token id at or above it exists), registered the same way. Both are
    optional only for engines that cannot know them (None or absent: nothing is checked).

    ``constrained_decoding``: True for an engine that honours :attr:`SamplingSpec.constraint`
    with exact behaviour log-probs (those of the constrained distribution); absent or False: it
    cannot, and the OpenAI endpoint refuses a request that needs it (a 400 naming the field)."""

    version: int
    tokenizer: Any

    async def generate(self, prompt_token_ids: list[int], params: SamplingSpec) -> Completion:
        """One completion of one prompt; many may be awaited at once."""
        ...

    async def generate_many(self, prompts: list[list[int]], params: SamplingSpec) -> list[Completion]:
        """One completion per prompt, in order, all in flight at once."""
        ...

    def generate_batch(self, prompts: list[list[int]], params: SamplingSpec) -> list[Completion]:
        """Blocking :meth:`generate_many`, for threads other than an event loop's."""
        ...

    def update_weights(self, named_tensors: dict[str, Any], version: int) -> None:
        """Replace the weights (checkpoint names, full tensors) and set ``version``; blocking,
        thread-safe, applied between two engine steps while requests keep running.

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


async def gather_all(*aws: Any) -> list:
    """``asyncio.gather`` that, when one awaitable fails, cancels the others (aborting their
    engine requests) and waits for them before raising: an episode that failed leaves nothing
    generating behind it."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise



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
