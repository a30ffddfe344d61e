"""``WeightPublisher``: publishes the policy's weights as bf16 bit-diff deltas, off the step.

After every ``every_n_steps`` training steps (Lightning's ``global_step``: one per batch, also
for a policy that takes several optimizer updates per batch, ``RLPolicy(minibatches=...,
batch_passes=...)``) the callback publishes version ``v = global_step // every_n_steps`` of its
policy (version 0 is the initial model). That is
also the trainer's own version of its current weights (:meth:`WeightPublisher.weights_version`),
which the datamodule stamps on every batch as ``trainer_version`` and ``train/staleness_*`` is
measured against.

As Lightning's ``ModelCheckpoint`` decides *when* to save and leaves *how* to
``trainer.save_checkpoint``, this callback keeps the cadence, the skip on resume and the logging;
:mod:`astralight.weights.state` chooses *what* is published and :mod:`astralight.weights.publisher`
does the publishing (one publish routine, run by a thread or an encoder-process worker).

What the training thread does, and what it does not
---------------------------------------------------
The training thread only takes a *snapshot*: a bf16 copy of every floating tensor (half the
bytes of the fp32 masters; the bf16 cast is exactly what receivers must hold). Everything else
-- encoding with :class:`astralight.weights.ArtifactBuilder`, uploading the files, publishing
the manifest -- happens in a *worker*:

* ``worker="process"`` (default, :class:`~astralight.weights.publish_worker.ProcessPublisher`): an
  encoder process (:mod:`astralight.weights.publish_worker`,
  started at fit start, JSON lines over pipes, no pickle). The snapshot is copied straight into
  one of two shared-memory *slots* (anonymous ``memfd`` files the process maps), and a thread of
  the trainer only hands the slot over and waits for the answer without holding the GIL. Why:
  encoding and HTTP are partly Python-level work; in a thread of the trainer they share the GIL
  with the training loop, which cost the toy step ~5-7 % on 2 cores against ~2-3.5 % this way
  (``tests/benchmarks/bench_publish_overhead.py``). The process is stopped at fit end, and a
  process that dies is replaced (its successor starts with a full version).
* ``worker="thread"`` (:class:`~astralight.weights.publisher.ThreadPublisher`): the same work
  in a thread of the trainer (what tests with an in-process
  fake :attr:`client` use).

The hand-off is a bounded slot of size one: if the worker is still busy with an older version
when a newer snapshot arrives, the newer one **replaces** the pending one (counted in
``replaced``), so the step never waits for encoding or the network, memory holds at most two
snapshots plus the worker's copy of the last published state, and published versions only ever
increase. The worker runs at a lower CPU priority (``worker_nice``), so on a saturated CPU
publication is delayed rather than the step slowed.

That delay is unbounded by default. ``max_lag_versions=N`` bounds it: after the step that makes
version ``V`` the trainer waits until version ``V - N`` or a later one is published before it
takes its next step. Without the bound a trainer that keeps its core busy can starve its own
publication: measured with SmolLM2-135M on a 2-core CPU (a 270 MB bf16 snapshot, the worker at
nice 19 on the trainer's core), the trainer ran 3 versions ahead of the last published one, and
since staleness is measured against the trainer's version, 43% of the rollouts were dropped
stale. The wait yields the core to the worker; it is logged as ``publish/lag_wait_s``.

Precision
---------
``precision="fp32"`` publishes the float32 weights exactly, each tensor as its two 16-bit halves
under two names (:mod:`astralight.weights.exact`), through the same bf16 pipeline; receivers
(:class:`astralight.raas.weight_sync.WeightSync`) join them before the engine sees them.

Full or delta
-------------
A version is a **delta** (``delta.bin``: changed bf16 bit patterns, gap-encoded indices, zstd)
onto the *last published* version, except that it is **full** (bf16 safetensors) on the first
publication of this callback's life (so also the first one after a resume: the in-memory base is
not checkpointed), every ``full_every`` versions (counted in version numbers since the last full
one; 0 = never again), when tensor names or shapes change, and after any failed publication.

* *Why the last published, not the last snapshot:* a receiver applies a delta only onto exactly
  ``base_version``; only published versions exist for it. The builder advances its base only
  when it builds, and a build whose upload or publish then fails forces the next version to be
  full (the builder's base is no longer a published version). A new encoder process (each fit,
  or after one died) has no base, so its first version is full too.
* *When the writer falls behind* the replaced snapshots are simply never built; the next
  publication is a delta from the last published version to the newest snapshot. That is
  correct (its ``base_version`` is a version every up-to-date receiver holds) and the simplest:
  no special case, and it keeps the cheap path exactly when the writer is the bottleneck (a full
  is ~1.5-3x the bytes of a delta at the toy recipe's lr 5e-4 and ~30-60x at RL-typical 98-99%
  sparsity,
  so it would fall further behind). It spans several optimizer steps, so it is less sparse
  than a one-step delta.

Each manifest is sent to the dataflow after its files (``upload_weight_file`` then
``publish``); the dataflow re-checks every file's sha256 and keeps the chain (see its GC).

Metrics
-------
Per published version, logged to every Lightning logger at the step the snapshot was taken
(so TensorBoard plots them against the training step even though they complete later):
``publish/sparsity`` (fraction of bit-identical bf16 elements vs the previous published version;
on full versions too, when a previous one is held), ``publish/delta_bytes`` (deltas only),
``publish/full_bytes`` (bf16 bytes of the published tensors: what a full sync moves, without the
few-KiB safetensors header), ``publish/bytes`` (uploaded), ``publish/compression_ratio``
(``full_bytes / bytes``; ~1 on full versions), ``publish/latency_s`` (snapshot taken ->
manifest accepted by the dataflow, queueing included), ``publish/encode_s``,
``publish/upload_s``, ``publish/snapshot_s`` (training-thread time) and ``publish/kind``
(1 = full, 0 = delta), with the running counters ``publish/published_version``,
``publish/replaced``, ``publish/skipped`` and ``publish/errors`` (a failed publication logs the
counters alone). They are written by the training thread at the next step end (and at fit end)
straight to ``trainer.loggers``, not through ``LightningModule.log_dict``, so the callback adds
nothing to the per-step logging. :attr:`history` keeps the records.

Checkpoint / resume
-------------------
``state_dict`` holds the last published version and enqueued step; the builder's base (one bf16
copy of the model) is deliberately not checkpointed, so the first publication after a resume is
full. If the dataflow already holds a version at or above the one this trainer would publish next
(a trainer that published beyond its last checkpoint, then crashed), the versions up to the
dataflow's are skipped (counted in ``skipped``, warned once) instead of being refused one by one.

Distributed
-----------
Only global rank 0 encodes and publishes. Under DDP (and DeepSpeed ZeRO 1/2) rank 0's module holds
the full weights, other ranks do nothing. Under ``ModelParallelStrategy`` (FSDP2 / DTensor: the
policies shard themselves there; ``FSDPStrategy``, FSDP1, is refused by them but still gathered
here for other modules) every rank joins the collective
``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True,
cpu_offload=True)`` on the strategy's root module at each publication step, and rank 0 gets the
whole state on CPU; names are taken relative to the HF module (FSDP wrapper prefixes are removed
by DCP), so the names, the peft adapter names and the tied-embedding de-duplication are exactly
those of an unsharded publication (tests/integration/test_fsdp2_fit.py compares them). DeepSpeed
ZeRO-3 is refused at setup (its partitions are not gathered here).

LoRA (peft)
-----------
If the HF module is a ``peft.PeftModel`` (e.g. ``M2POPolicy(lora={...})``), only the adapter
tensors are published, named exactly as ``PeftModel.save_pretrained`` writes them
(``peft.get_peft_model_state_dict``, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``),
with ``metadata["adapter"] = {"type": "lora", "adapter_name", "peft_config"}`` in every manifest
(full or bf16 delta, exactly as for full weights). The base weights never change, so receivers
keep the base model from its folder (version 0). The RaaS weight sync hands such versions to the
engine's ``update_adapter`` (``VLLMEngine(enable_lora=True)`` writes a PEFT folder and serves it
under a new LoRA id, no restart). If the module's ``lora_publish`` is ``"merged"``
(``lora: {publish: merged}``), the merged weights ``W + B @ A * scaling`` are published instead,
under the base model's names and without adapter metadata: any engine loads them as usual.

Extension points: :meth:`publish_state` (which tensors, under which names, on the training
thread); with ``worker="thread"`` also :meth:`encode` (``version, tensors -> Artifact``) and
:meth:`after_publish`. Tests may set :attr:`client` to any object with ``upload_weight_file``,
``publish`` and ``current_version`` (with ``worker="thread"``; the process worker has its own
``DataflowClient``, the parent uses :attr:`client` only to read the current version).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from astralight.dataflow.client import LazyDataflowClient
from astralight.weights import ArtifactBuilder
from astralight.weights.exact import PRECISIONS, split_fp32
from astralight.weights.publish_worker import ProcessPublisher
from astralight.weights.publisher import Publisher, PublishBuilder, ThreadPublisher
from astralight.weights.state import (
    adapter_metadata,
    is_peft,
    is_sharded,
    publish_state,
    unwrap,
)

log = logging.getLogger(__name__)

WEIGHT_FILE = "model.safetensors"
#: per-version metrics written to the loggers (as ``publish/<key>``) when present in a record
METRIC_KEYS = ("kind", "sparsity", "delta_bytes", "full_bytes", "bytes", "compression_ratio",
               "latency_s", "encode_s", "upload_s", "snapshot_s", "published_version", "replaced",
               "skipped", "errors")


def tensor_sha256(t: Tensor) -> str:
    """sha256 of a tensor's raw little-endian bytes in its own dtype (as stored in safetensors).

    For bf16 tensors this equals ``astralight.weights.tensor_checksum``, the manifest checksum.
    """
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def _counter(name: str) -> property:
    """A read-only attribute of the worker, seen through the callback."""
    return property(lambda self: getattr(self._worker, name))


class WeightPublisher(LazyDataflowClient, pl.Callback):
    """Publish version ``optimizer_steps // every_n_steps`` every ``every_n_steps`` steps.

    Args:
        dataflow_url: the dataflow service (default: the datamodule's ``dataflow_url``).
        model_id: the policy (default: the module's ``model_id``, else the datamodule's).
        every_n_steps: training steps (batches) per published version.
        full_every: a full version every this many versions (and on the first publication);
            deltas onto the last published version in between; 0 = only the first is full.
        worker: ``"process"`` (default): encode, upload and publish in a child process
            (:mod:`astralight.weights.publish_worker`) fed through two shared-memory snapshot
            slots, so the training loop never shares the GIL with that work; ``"thread"``: do it
            in a thread of this process (needed when a test assigns :attr:`client`; otherwise
            only worth it where starting a process is not possible).
        zstd_level: compression level of deltas (default: the codec's measured default).
        encode_threads: tensors encoded concurrently by the worker (0: one at a time, leaving
            the cores to training).
        worker_nice: niceness added to the worker (the process, or the thread on Linux and the
            threads it starts). The default 19 makes publication use idle CPU: on a saturated
            CPU it is delayed (and the falls-behind path replaces snapshots) instead of slowing
            the step; 0 shares the CPU equally.
        token: bearer token (default: env ``ASTRALIGHT_TOKEN``, read by the client).
        flush_timeout_s: how long ``fit`` end waits for the last publication (and the longest
            one ``max_lag_versions`` wait lasts).
        max_lag_versions: after the step that makes version ``V``, wait until ``V - N`` (or a
            later version) is published before the next step; ``None`` (default): never wait.
            ``1`` keeps at most one version in flight behind the newest (module docstring).
        precision: ``"bf16"`` (default): the weights rounded to bf16, what an engine in bf16
            holds anyway; ``"fp32"``: the float32 weights exactly, each tensor as its two 16-bit
            halves (:mod:`astralight.weights.exact`; twice the bytes), for a float32 engine
            that must sample from exactly the trainer's weights: bf16 rounds away an update
            smaller than about 2^-8 of a weight's magnitude.

    Runs on global rank 0 only (under FSDP every rank joins the full-state gather).
    """

    def __init__(
        self,
        dataflow_url: str | None = None,
        model_id: str | None = None,
        every_n_steps: int = 1,
        full_every: int = 10,
        worker: str = "process",
        zstd_level: int | None = None,
        encode_threads: int = 0,
        worker_nice: int = 19,
        token: str | None = None,
        flush_timeout_s: float = 600.0,
        precision: str = "bf16",
        max_lag_versions: int | None = None,
    ):
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"precision: must be one of {PRECISIONS}, got {precision!r}")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps: must be >= 1, got {every_n_steps}")
        if full_every < 0:
            raise ValueError(f"full_every: must be >= 0 (0: only the first version is full), "
                             f"got {full_every}")
        if worker not in ("process", "thread"):
            raise ValueError(f"worker: must be 'process' or 'thread', got {worker!r}")
        if encode_threads < 0:
            raise ValueError(f"encode_threads: must be >= 0, got {encode_threads}")
        if max_lag_versions is not None and max_lag_versions < 1:
            raise ValueError(f"max_lag_versions: must be >= 1 or null (never wait), got "
                             f"{max_lag_versions}")
        self.max_lag_versions = max_lag_versions
        self.lag_waits = 0  # steps that waited for a publication
        self.lag_wait_s = 0.0  # their total wait
        self.dataflow_url = dataflow_url
        self.model_id = model_id
        self.every_n_steps = every_n_steps
        self.full_every = full_every
        self.worker = worker
        self.zstd_level = zstd_level
        self.encode_threads = encode_threads
        self.worker_nice = worker_nice
        self.token = token
        self.flush_timeout_s = flush_timeout_s
        self.precision = precision
        self._client = None
        self._adapter_meta: dict | None = None
        self._last_enqueued_step = -1
        self._skip_through = -1  # versions <= this are already held by the dataflow
        if worker == "thread":
            self._worker: Publisher = ThreadPublisher(
                lambda: self.client, self.make_builder, encode=self.encode,
                after_publish=self.after_publish, nice=worker_nice, model_id=model_id,
                flush_timeout_s=flush_timeout_s)
        else:
            self._worker = ProcessPublisher(
                dataflow_url, full_every=full_every, zstd_level=zstd_level,
                encode_threads=encode_threads, nice=worker_nice, token=token, model_id=model_id,
                flush_timeout_s=flush_timeout_s)

    # the worker's counters (written by it under its lock, read anywhere)
    last_published_version = _counter("last_published_version")
    published_versions = _counter("published_versions")
    history = _counter("history")
    replaced = _counter("replaced")
    skipped = _counter("skipped")
    errors = _counter("errors")
    last_error = _counter("last_error")
    last_latency_s = _counter("last_latency_s")
    last_bytes = _counter("last_bytes")
    enqueued = _counter("enqueued")

    # ---------------------------------------------------------------- versions

    def weights_version(self, global_step: int) -> int:
        """The policy version of the weights after ``global_step`` optimizer steps: the version
        this callback publishes them as (``global_step // every_n_steps``), whether or not that
        publication has reached the dataflow yet.

        The trainer's own version, which staleness is measured against
        (:meth:`astralight.datamodules.RolloutDataModule.trainer_version`): the dataflow's version
        lags it while a publication is in flight. After a resume ``global_step`` is the
        checkpoint's, so this is the version of the restored weights. A trainer resumed behind
        the dataflow (versions up to the dataflow's are skipped, see :meth:`on_train_start`)
        trains weights numbered below versions the RaaS still sample from, so staleness reads
        negative until its steps pass them: those samples came from weights the crash lost.
        """
        return int(global_step) // self.every_n_steps

    # ---------------------------------------------------------------- extension points

    def hf_model(self, pl_module: pl.LightningModule) -> torch.nn.Module:
        """The module whose ``state_dict`` names are the HF names (``pl_module.model``)."""
        model = getattr(pl_module, "model", None)
        return model if isinstance(model, torch.nn.Module) else pl_module

    def publish_state(self, trainer: pl.Trainer,
                      pl_module: pl.LightningModule) -> dict[str, Tensor] | None:
        """The tensors to publish (no copies), on the training thread; None on ranks > 0.

        Chosen by :func:`astralight.weights.state.publish_state`: the full state (gathered
        under sharded strategies), tied aliases and integer buffers dropped, a peft model's
        adapter tensors only (or its merged weights when the module's ``lora_publish`` is
        ``"merged"``). With ``precision="fp32"`` each tensor is split into its two 16-bit halves
        (:func:`astralight.weights.exact.split_fp32`; copies).
        """
        model = self.hf_model(pl_module)
        state = publish_state(trainer, pl_module, model)
        if state is not None and self.precision == "fp32":
            state = split_fp32(state)
        inner = unwrap(model)
        if (state is not None and self._adapter_meta is None and is_peft(inner)
                and getattr(pl_module, "lora_publish", None) != "merged"):
            self._adapter_meta = adapter_metadata(inner)
        return state

    def snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Tensor] | None:
        """bf16 CPU copies of :meth:`publish_state` (what the thread worker encodes)."""
        state = self.publish_state(trainer, pl_module)
        if state is None:
            return None
        return {n: t.to(device="cpu", dtype=torch.bfloat16, copy=True) for n, t in state.items()}

    def make_builder(self) -> ArtifactBuilder:
        kw = {} if self.zstd_level is None else {"level": self.zstd_level}
        return PublishBuilder(self.model_id, full_every=self.full_every,
                              threads=self.encode_threads, **kw)

    def encode(self, version: int, tensors: dict[str, Tensor]):
        """(thread worker) Version ``version`` as an ``astralight.weights.Artifact``: full or
        delta onto the last published version (see the module docstring for when it is full)."""
        return self._worker.encode(version, tensors)

    def after_publish(self, version: int, tensors: dict[str, Tensor] | None, artifact: Any) -> None:
        """(thread worker) Called after ``version`` is published (default: nothing)."""

    # ---------------------------------------------------------------- hand-off

    def _take_snapshot(self, trainer, pl_module, version: int, step: int) -> None:
        t = time.perf_counter()
        if self.worker == "thread":
            state = self.snapshot(trainer, pl_module)
        else:  # copied straight into a shared slot by the worker
            state = self.publish_state(trainer, pl_module)
        if state is not None:
            metadata = {"adapter": self._adapter_meta} if self._adapter_meta is not None else None
            self._worker.submit(version, step, state, t, metadata)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending or in flight; False if ``timeout`` passed first."""
        return self._worker.flush(timeout)

    def log_published(self, trainer: pl.Trainer) -> int:
        """Write the per-version metrics of versions published since the last call to every
        logger, at the step each snapshot was taken; returns how many versions were written."""
        records = self._worker.drain_records()
        if not records or not trainer.is_global_zero:
            return 0
        for rec in records:
            metrics = {f"publish/{k}": float(rec[k]) for k in METRIC_KEYS if k in rec}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=rec["step"])
        return len(records)

    # ---------------------------------------------------------------- Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        dm = getattr(trainer, "datamodule", None)
        if self.dataflow_url is None:
            self.dataflow_url = getattr(dm, "dataflow_url", None)
        if self.model_id is None:
            self.model_id = getattr(pl_module, "model_id", None) or getattr(dm, "model_id", None)
        if self.model_id is None:
            raise ValueError("model_id: not set and neither the module nor the datamodule has one")
        if getattr(trainer.strategy, "zero_stage_3", False):
            raise ValueError("trainer.strategy: WeightPublisher does not gather DeepSpeed ZeRO-3 "
                             "partitions; use ModelParallelStrategy (FSDP2) or ZeRO 1/2")
        if self.worker == "process" and not self.dataflow_url:
            raise ValueError("dataflow_url: not set and the datamodule has none; set "
                             "callbacks[WeightPublisher].init_args.dataflow_url")
        self._worker.model_id = self.model_id
        if isinstance(self._worker, ProcessPublisher):
            self._worker.url = self.dataflow_url
        if trainer.is_global_zero:
            self._worker.start()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.worker == "process" and trainer.is_global_zero and not is_sharded(trainer, pl_module):
            # the slots' layout and the encoder's start-up overlap the first steps (sharded
            # models skip this: their layout needs the collective gather)
            try:
                state = self.publish_state(trainer, pl_module)
                if state is not None:
                    self._worker.prestart(state)
            except Exception as exc:  # the first publication retries (and reports) it
                log.warning("could not start the weight encoder process early: %s", exc)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Skip the versions the dataflow already holds (a resumed trainer behind it).

        Here and not in ``on_fit_start``: Lightning restores the loops (``global_step``) from a
        checkpoint after ``on_fit_start``, so only now is the resumed step known.
        """
        expected = trainer.global_step // self.every_n_steps
        current = -1
        if trainer.is_global_zero:
            try:
                current = int(self.client.current_version(self.model_id))
            except Exception as exc:  # the service may be starting; publication retries anyway
                log.warning("could not read the current version of %r: %s", self.model_id, exc)
        # every rank must take the same skip decisions: under FSDP the snapshot is a collective
        current = trainer.strategy.broadcast(current, src=0)
        self._skip_through = max(self._skip_through, current)
        if current > expected and trainer.is_global_zero:
            log.warning(
                "the dataflow already holds version %d of %r but this trainer is at version "
                "%d (step %d), e.g. resumed from an older checkpoint: versions up to %d are "
                "not published again; the next publication is version %d (full)", current,
                self.model_id, expected, trainer.global_step, current, current + 1)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step > self._last_enqueued_step and step > 0 and step % self.every_n_steps == 0:
            self._last_enqueued_step = step
            version = step // self.every_n_steps
            if version <= self._skip_through:
                self._worker.count_skipped()
            else:
                self._take_snapshot(trainer, pl_module, version, step)
                if trainer.is_global_zero:
                    self._wait_for_lag(trainer, version, step)
        if trainer.is_global_zero:
            self.log_published(trainer)

    def _wait_for_lag(self, trainer: pl.Trainer, version: int, step: int) -> None:
        """``max_lag_versions``: wait until ``version - max_lag_versions`` is published (at most
        ``flush_timeout_s``; a failed publication ends the wait, and later versions retry it)."""
        if self.max_lag_versions is None:
            return
        need = version - self.max_lag_versions
        if need <= max(self.last_published_version, self._skip_through):
            return
        t0 = time.perf_counter()
        published = self._worker.wait_published(need, self.flush_timeout_s)
        waited = time.perf_counter() - t0
        self.lag_waits += 1
        self.lag_wait_s += waited
        for logger in trainer.loggers:
            logger.log_metrics({"publish/lag_wait_s": waited}, step=step)
        if not published:
            log.warning("version %d of %r was not published within %.0f s of version %d's "
                        "snapshot (max_lag_versions=%d; last published %d, errors %d: %s); "
                        "training goes on", need, self.model_id, waited, version,
                        self.max_lag_versions, self.last_published_version, self.errors,
                        self.last_error)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._worker.running:
            self._worker.retry_last()
            self._worker.close(wait=True)
        self.log_published(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        if self._worker.running:
            self._worker.close(wait=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._worker.running:
            self._worker.close(wait=True)
        self.close_client()

    def state_dict(self) -> dict[str, Any]:
        return {"last_published_version": self.last_published_version,
                "last_enqueued_step": self._last_enqueued_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters; the delta base is not in the checkpoint, so the next version is full."""
        self._worker.restore(int(state_dict.get("last_published_version", 0)))
        self._last_enqueued_step = int(state_dict.get("last_enqueued_step", -1))


__all__ = ["WeightPublisher", "tensor_sha256", "WEIGHT_FILE", "METRIC_KEYS"]
