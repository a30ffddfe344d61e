"""The inference-engine contract the RaaS and its workflows code against.

Workflows never touch vLLM directly: they see an :class:`Engine` (token ids in, token ids and the
behaviour log-prob of every generated token out), so the same workflow runs on the real vLLM
engine in production and on a small transformers engine in unit tests.

The contract is asynchronous and per request: ``await engine.generate(prompt_ids, params)`` is
one completion, and any number of them may be in flight at once from any number of episodes. The
engine batches whatever is in flight (vLLM: continuous batching, a request joins the next engine
step); nothing serializes callers. Weight updates land between two engine steps while requests
are running, so a completion may span versions: :attr:`Completion.versions` holds the version of
every generated token.

Three ways in, all over one primitive, :meth:`EngineBase.submit` (thread-safe, returns a
``concurrent.futures.Future``):

- ``await generate(ids, params)`` and ``await generate_many(prompts, params)`` for async workflows;
- ``generate_batch(prompts, params)`` (blocking) for scripts, tests and sync workflows running in
  an executor thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

log = logging.getLogger(__name__)


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
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    def for_request(self, i: int, key: str = "") -> "SamplingSpec":
        """The spec of request ``i`` of a many-request call: its own seed, if seeded,
        ``seed + i``, offset by a stable hash of ``key`` (a task id) when one is given."""
        if self.seed is None or (i == 0 and not key):
            return self
        offset = zlib.crc32(key.encode()) if key else 0
        return dataclasses.replace(self, seed=(self.seed + offset + i) % (1 << 31))


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
    optional only for engines that cannot know them (None or absent: nothing is checked)."""

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


class EngineBase:
    """The async / many / blocking entry points over one primitive, :meth:`submit`.

    Subclasses implement ``submit(prompt_token_ids, params) -> Future[Completion]`` (thread-safe;
    the future may complete on any thread) and may implement ``cancel(future)`` to stop a
    request whose caller went away (a cancelled episode).
    """

    version: int = 0

    def submit(self, prompt_token_ids: list[int], params: SamplingSpec) -> Future:
        raise NotImplementedError(f"{type(self).__name__} must implement submit(prompt, params)")

    def cancel(self, future: Future) -> None:  # noqa: B027 - optional hook
        """Stop the request behind ``future`` (default: let it finish unobserved)."""

    async def generate(self, prompt_token_ids: list[int], params: SamplingSpec) -> Completion:
        future = self.submit(list(prompt_token_ids), params)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.cancel(future)
            raise

    async def generate_many(self, prompts: list[list[int]], params: SamplingSpec) -> list[Completion]:
        futures = [self.submit(list(p), params.for_request(i)) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except BaseException:  # cancelled, or one request failed: stop the others
            for f in futures:
                if not f.done():
                    self.cancel(f)
            raise

    def generate_batch(self, prompts: list[list[int]], params: SamplingSpec) -> list[Completion]:
        futures = [self.submit(list(p), params.for_request(i)) for i, p in enumerate(prompts)]
        return [f.result() for f in futures]


@dataclass
class _Job:
    prompt: list[int]
    params: SamplingSpec
    future: Future = field(default_factory=Future)


class BatchedEngine(EngineBase):
    """An engine whose model computes a batch at a time (transformers, test fakes).

    One worker thread takes what has been submitted, groups consecutive requests with equal,
    unseeded sampling (up to ``max_batch``) into one ``_generate(prompts, params)`` call (a
    seeded request is a call of its own, so ``_generate`` seeds its prompt ``i`` with
    ``seed + i`` as the synchronous contract did), and runs control calls
    (:meth:`call`: weight updates) between batches, never in the middle of one. Subclasses
    implement ``_generate`` (the old synchronous batch contract) and stamp nothing: every
    completion gets the version the engine had when its batch started.
    """

    max_batch: int = 64

    def _generate(self, prompts: list[list[int]], params: SamplingSpec) -> list[Completion]:
        raise NotImplementedError(f"{type(self).__name__} must implement _generate")

    def _worker_queue(self) -> "queue.SimpleQueue":
        q = self.__dict__.get("_jobs")
        if q is None:
            with _WORKER_START:
                q = self.__dict__.get("_jobs")
                if q is None:
                    q = self.__dict__["_jobs"] = queue.SimpleQueue()
                    threading.Thread(target=self._work, args=(q,), daemon=True,
                                     name=f"{type(self).__name__}-worker").start()
        return q

    def submit(self, prompt_token_ids: list[int], params: SamplingSpec) -> Future:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids: empty prompt")
        job = _Job(list(prompt_token_ids), params)
        self._worker_queue().put(job)
        return job.future

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread between batches; blocking; returns its result."""
        future: Future = Future()
        self._worker_queue().put((fn, future))
        return future.result()

    def _work(self, q: "queue.SimpleQueue") -> None:
        pending: list = []
        while True:
            item = pending.pop(0) if pending else q.get()
            if item is None:
                return
            if isinstance(item, tuple):
                fn, future = item
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
                continue
            batch = [item]
            while True:  # what else is waiting now, in order: same sampling joins the batch
                try:
                    pending.append(q.get_nowait())
                except queue.Empty:
                    break
            rest = []
            for other in pending:  # a seeded request runs alone: its seed is its own
                if (isinstance(other, _Job) and other.params == item.params
                        and item.params.seed is None and len(batch) < self.max_batch
                        and not rest):
                    batch.append(other)
                else:
                    rest.append(other)
            pending = rest
            live = [j for j in batch if j.future.set_running_or_notify_cancel()]
            if not live:
                continue
            version = int(self.version)
            try:
                out = self._generate([j.prompt for j in live], item.params)
                if len(out) != len(live):
                    raise RuntimeError(f"{type(self).__name__} returned {len(out)} completions "
                                       f"for {len(live)} prompts")
            except BaseException as exc:  # noqa: BLE001 - every caller gets the error
                for j in live:
                    j.future.set_exception(exc)
                continue
            for j, c in zip(live, out):
                if c.version is None and c.versions is None:
                    c.version = version
                    c.versions = [version] * len(c.token_ids)
                j.future.set_result(c)

    def close(self) -> None:
        q = self.__dict__.pop("_jobs", None)
        if q is not None:
            q.put(None)


_WORKER_START = threading.Lock()


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
