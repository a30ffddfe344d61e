"""``WeightPublisher``: publishes the policy's weights as bf16 bit-diff deltas, off the step.

After every ``every_n_steps`` optimizer steps the callback publishes version
``v = optimizer_steps // every_n_steps`` of its policy (version 0 is the initial model). That is
also the trainer's own version of its current weights (:meth:`WeightPublisher.weights_version`),
which the datamodule stamps on every batch as ``trainer_version`` and ``train/staleness_*`` is
measured against.

What the training thread does, and what it does not
---------------------------------------------------
The training thread only takes a *snapshot*: a bf16 copy of every floating tensor (half the
bytes of the fp32 masters; the bf16 cast is exactly what receivers must hold). Everything else
-- encoding with :class:`astralight.weights.ArtifactBuilder`, uploading the files, publishing
the manifest -- happens in a *worker*:

* ``worker="process"`` (default): an encoder process (:mod:`astralight.weights.publish_worker`,
  started at fit start, JSON lines over pipes, no pickle). The snapshot is copied straight into
  one of two shared-memory *slots* (anonymous ``memfd`` files the process maps), and a thread of
  the trainer only hands the slot over and waits for the answer without holding the GIL. Why:
  encoding and HTTP are partly Python-level work; in a thread of the trainer they share the GIL
  with the training loop, which cost the toy step ~5-7 % on 2 cores against ~2-3.5 % this way
  (``tests/benchmarks/bench_publish_overhead.py``). The process is stopped at fit end, and a
  process that dies is replaced (its successor starts with a full version).
* ``worker="thread"``: the same work in a thread of the trainer (what tests with an in-process
  fake :attr:`client` use).

The hand-off is a bounded slot of size one: if the worker is still busy with an older version
when a newer snapshot arrives, the newer one **replaces** the pending one (counted in
``replaced``), so the step never waits for encoding or the network, memory holds at most two
snapshots plus the worker's copy of the last published state, and published versions only ever
increase. The worker runs at a lower CPU priority (``worker_nice``), so on a saturated CPU
publication is delayed rather than the step slowed.

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

import collections
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from astralight.dataflow.client import LazyDataflowClient
from astralight.fsdp2 import tied_aliases
from astralight.weights import ArtifactBuilder
from astralight.weights.publish_worker import (
    PublishBuilder,
    artifact_record,
    layout_of,
    map_slot,
    new_slot_fd,
    slot_views,
)

log = logging.getLogger(__name__)

WEIGHT_FILE = "model.safetensors"
#: per-version metrics written to the loggers (as ``publish/<key>``) when present in a record
METRIC_KEYS = ("kind", "sparsity", "delta_bytes", "full_bytes", "bytes", "compression_ratio",
               "latency_s", "encode_s", "upload_s", "snapshot_s", "published_version", "replaced",
               "skipped", "errors")
HISTORY = 10_000


def tensor_sha256(t: Tensor) -> str:
    """sha256 of a tensor's raw little-endian bytes in its own dtype (as stored in safetensors).

    For bf16 tensors this equals ``astralight.weights.tensor_checksum``, the manifest checksum.
    """
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


@dataclass
class _Job:
    version: int
    step: int
    created: float  # wall clock, recorded in the manifest
    t_snap: float  # perf_counter when the snapshot was complete
    snapshot_s: float
    tensors: dict[str, Tensor] | None = None  # thread worker: the bf16 copies
    slot: int | None = None  # process worker: the shared slot holding the snapshot
    metadata: dict | None = None  # merged into the manifest's metadata


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft not installed: cannot be a PeftModel
        return False
    return isinstance(model, PeftModel)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside FSDP1 / activation-checkpoint wrappers (FSDP2 does not wrap)."""
    for attr in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module"):
        while hasattr(model, attr):
            model = getattr(model, attr)
    return model


def _clean_fqn(name: str) -> str:
    for marker in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(marker, "")
    return name


def _jsonable(obj: Any) -> Any:
    """A peft config as plain JSON data (sets become sorted lists, enums and others strings)."""
    return json.loads(json.dumps(obj, default=lambda o: sorted(o) if isinstance(o, (set, frozenset))
                                 else getattr(o, "value", str(o))))


def is_sharded(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """True when no single rank holds the whole model (FSDP1, FSDP2/DTensor)."""
    name = type(trainer.strategy).__name__
    if "FSDP" in name or "ModelParallel" in name:
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        return False
    return any(isinstance(p, DTensor) for p in pl_module.parameters())


def gather_full_state_dict(root: torch.nn.Module, prefix: str) -> dict[str, Tensor]:
    """Collective: the full (unsharded) state dict of ``root`` on rank 0's CPU, names under
    ``prefix`` with the prefix removed. Every rank must call it; ranks > 0 get ``{}``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if not prefix:
        return dict(state)
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


class _Encoder:
    """The encoder process (:mod:`astralight.weights.publish_worker`): JSON lines over pipes."""

    def __init__(self, args: list[str], slot_fds: list[int], token: str | None):
        env = dict(os.environ)
        # the child imports astralight the way this process does (installed or from a checkout)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p]
                                            + [env.get("PYTHONPATH", "")]).strip(os.pathsep)
        if token:
            env["ASTRALIGHT_TOKEN"] = token
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "astralight.weights.publish_worker", *args,
             "--slot-fds", *[str(fd) for fd in slot_fds]],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env,
            pass_fds=slot_fds)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict:
        line = self.proc.stdout.readline()  # blocks without the GIL
        if not line:
            raise RuntimeError(f"the encoder process exited (rc={self.proc.wait()}); see its "
                               "stderr in this log")
        return json.loads(line)

    def close(self, timeout: float) -> None:
        if self.alive():
            try:
                self.send({"op": "stop"})
                self.proc.wait(timeout=timeout)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class WeightPublisher(LazyDataflowClient, pl.Callback):
    """Publish version ``optimizer_steps // every_n_steps`` every ``every_n_steps`` steps.

    Args:
        dataflow_url: the dataflow service (default: the datamodule's ``dataflow_url``).
        model_id: the policy (default: the module's ``model_id``, else the datamodule's).
        every_n_steps: optimizer steps per published version.
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
        flush_timeout_s: how long ``fit`` end waits for the last publication.

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
    ):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps: must be >= 1, got {every_n_steps}")
        if full_every < 0:
            raise ValueError(f"full_every: must be >= 0 (0: only the first version is full), "
                             f"got {full_every}")
        if worker not in ("process", "thread"):
            raise ValueError(f"worker: must be 'process' or 'thread', got {worker!r}")
        if encode_threads < 0:
            raise ValueError(f"encode_threads: must be >= 0, got {encode_threads}")
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
        self._client = None
        self._builder: ArtifactBuilder | None = None  # thread worker
        self._force_full = False
        self._adapter_meta: dict | None = None
        self._cv = threading.Condition()
        self._pending: _Job | None = None
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None
        # process worker: the encoder, the snapshot slots and their layout
        self._encoder: _Encoder | None = None
        self._slot_fds: list[int] = []
        self._slots: list[dict[str, Tensor]] = []  # per slot: bf16 torch views by name
        self._layout: list[list] = []
        self._layout_key: tuple | None = None
        self._inflight_slot: int | None = None
        self._last_enqueued_step = -1
        self._skip_through = -1  # versions <= this are already held by the dataflow
        self._unlogged: list[dict] = []
        # counters (written by the worker under the lock, read anywhere)
        self.last_published_version = 0
        self.published_versions: list[int] = []
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY)
        self.replaced = 0
        self.skipped = 0
        self.errors = 0
        self._refused: _Job | None = None  # the newest job whose publication failed
        self.last_error: str | None = None
        self.last_latency_s = 0.0
        self.last_bytes = 0
        self.enqueued = 0

    # ---------------------------------------------------------------- client

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

    def _module_prefix(self, pl_module: pl.LightningModule, model: torch.nn.Module) -> str:
        if model is pl_module:
            return ""
        for name, module in pl_module.named_modules():
            if module is model or _unwrap(module) is _unwrap(model):
                return _clean_fqn(name + ".")
        raise ValueError("hf_model(): the module is not a submodule of the LightningModule, so "
                         "its sharded state cannot be gathered; override hf_model()")

    def publish_state(self, trainer: pl.Trainer,
                      pl_module: pl.LightningModule) -> dict[str, Tensor] | None:
        """The tensors to publish (no copies), on the training thread; None on ranks > 0.

        Sharded strategies gather the full state first (a collective every rank joins). Tied
        aliases (the same storage under a second name, e.g. ``lm_head.weight`` tied to the
        embeddings) are dropped after the first name, as ``save_pretrained`` does; integer
        buffers are not weights and are never published. A peft model contributes only its
        adapter tensors, named as its ``save_pretrained`` does -- or, when the module's
        ``lora_publish`` is ``"merged"``, the merged weights under the base model's names.
        """
        model = self.hf_model(pl_module)
        inner = _unwrap(model)
        if is_sharded(trainer, pl_module):
            root = getattr(trainer.strategy, "model", None) or pl_module
            state = gather_full_state_dict(root, self._module_prefix(pl_module, model))
            if not trainer.is_global_zero:
                return None
            # the gathered copies no longer share storage: drop tied names by the module's ties
            aliases = tied_aliases(inner)
            state = {k: v for k, v in state.items() if k not in aliases}
        else:
            if not trainer.is_global_zero:
                return None
            state = inner.state_dict()
        if _is_peft(inner) and getattr(pl_module, "lora_publish", None) == "merged":
            from astralight.lora import merged_state_dict

            state = merged_state_dict(inner, state)  # W + B @ A * scaling, under the base names
        elif _is_peft(inner):
            from peft import get_peft_model_state_dict

            adapter = inner.active_adapter
            state = get_peft_model_state_dict(inner, state_dict=state, adapter_name=adapter)
            if self._adapter_meta is None:
                self._adapter_meta = {"type": "lora", "adapter_name": adapter,
                                      "peft_config": _jsonable(inner.peft_config[adapter].to_dict())}
        out: dict[str, Tensor] = {}
        seen: set[tuple[int, int, tuple]] = set()
        for name, t in state.items():
            if not isinstance(t, Tensor):
                continue
            alias = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if t.device.type != "meta" and alias in seen:
                continue
            seen.add(alias)
            if t.is_floating_point():
                out[name] = t.detach()
        return out

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
        if self._builder is None:
            self._builder = self.make_builder()
        full = True if self._force_full else None
        return self._builder.build(version, tensors, full=full)

    def after_publish(self, version: int, tensors: dict[str, Tensor] | None, artifact: Any) -> None:
        """(thread worker) Called after ``version`` is published (default: nothing)."""

    # ---------------------------------------------------------------- snapshot hand-off

    def _take_snapshot(self, trainer, pl_module, version: int, step: int) -> None:
        t = time.perf_counter()
        if self.worker == "thread":
            tensors = self.snapshot(trainer, pl_module)
            if tensors is not None:
                now = time.perf_counter()
                self._enqueue(_Job(version, step, time.time(), now, now - t, tensors=tensors,
                                   metadata=self._job_metadata()))
            return
        state = self.publish_state(trainer, pl_module)
        if state is None:
            return
        key = tuple((n, tuple(x.shape)) for n, x in state.items())
        if key != self._layout_key:
            self._new_layout(key)
        with self._cv:  # a free slot: the pending one (replaced) or the one not in flight
            if self._pending is not None:
                slot = self._pending.slot
                self._pending = None
                self.replaced += 1
            else:
                slot = 0 if self._inflight_slot != 0 else 1
        views = self._slots[slot]
        for name, x in state.items():
            views[name].copy_(x)  # fp32 -> bf16 round-to-nearest-even, as .to(torch.bfloat16)
        now = time.perf_counter()
        self._enqueue(_Job(version, step, time.time(), now, now - t, slot=slot,
                           metadata=self._job_metadata()))

    def _job_metadata(self) -> dict | None:
        return {"adapter": self._adapter_meta} if self._adapter_meta is not None else None

    def _new_layout(self, key: tuple) -> None:
        """(Re)create the two snapshot slots for these names/shapes; the encoder restarts
        (rare: the first snapshot, or a model whose tensors changed), waiting for it first."""
        if self._layout_key is not None:
            self.flush(self.flush_timeout_s)
        with self._cv:
            self._close_encoder()
            self._close_slots()
            self._layout, elements = layout_of(dict(key))
            self._slot_fds = [new_slot_fd(elements) for _ in range(2)]
            self._slots = []
            for fd in self._slot_fds:
                bits = map_slot(fd, elements, writable=True)
                self._slots.append({n: torch.from_numpy(v).view(torch.bfloat16)
                                    for n, v in slot_views(bits, self._layout).items()})
            self._layout_key = key

    def _prestart(self, trainer, pl_module) -> None:
        """Lay out the slots and start the encoder now, so its start-up (imports, ~1-2 s of
        its own CPU) overlaps the first steps instead of delaying the first publications.
        (Sharded models skip this: their layout needs the collective gather.)"""
        try:
            state = self.publish_state(trainer, pl_module)
            if state is None:
                return
            self._new_layout(tuple((n, tuple(x.shape)) for n, x in state.items()))
            with self._cv:
                self._ensure_encoder()
        except Exception as exc:  # the first publication retries (and reports) it
            log.warning("could not start the weight encoder process early: %s", exc)

    def _close_slots(self) -> None:
        for fd in self._slot_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._slot_fds, self._slots, self._layout_key = [], [], None

    def _close_encoder(self, timeout: float = 30.0) -> None:
        if self._encoder is not None:
            self._encoder.close(timeout)
            self._encoder = None

    def _ensure_encoder(self) -> _Encoder:
        if self._encoder is not None and not self._encoder.alive():
            self._close_encoder(0)
        if self._encoder is None:
            if not self.dataflow_url:
                raise ValueError("dataflow_url: not set and the datamodule has none; set "
                                 "callbacks[WeightPublisher].init_args.dataflow_url")
            args = ["--url", self.dataflow_url, "--model-id", self.model_id,
                    "--full-every", str(self.full_every), "--threads", str(self.encode_threads),
                    "--nice", str(self.worker_nice)]
            if self.zstd_level is not None:
                args += ["--level", str(self.zstd_level)]
            encoder = _Encoder(args, self._slot_fds, self.token)
            elements = sum(int(np.prod(shape, dtype=np.int64)) for _, _, shape in self._layout)
            encoder.send({"op": "layout", "elements": elements, "tensors": self._layout})
            self._encoder = encoder
        return self._encoder

    # ---------------------------------------------------------------- worker

    def _start_worker(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
        self._thread.start()

    def _enqueue(self, job: _Job) -> None:
        with self._cv:
            if self._pending is not None:
                self.replaced += 1
            self._pending = job
            self.enqueued += 1
            self._cv.notify_all()

    def _run(self) -> None:
        if self.worker == "thread" and self.worker_nice:
            try:  # Linux: niceness is per thread and inherited by threads this one starts
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               min(19, os.getpriority(os.PRIO_PROCESS, 0) + self.worker_nice))
            except (AttributeError, OSError) as exc:  # other platforms, or not permitted
                log.debug("could not lower the publisher thread's priority: %s", exc)
        while True:
            with self._cv:
                while self._pending is None and not self._stop:
                    self._cv.wait()
                if self._pending is None:
                    return
                job, self._pending = self._pending, None
                self._busy = True
                self._inflight_slot = job.slot
            try:
                if self.worker == "thread":
                    self._publish(job)
                else:
                    self._publish_via_encoder(job)
            except Exception as exc:  # a failed publication must not kill later ones
                log.exception("publishing version %d of %r failed; the next version will be full",
                              job.version, self.model_id)
                self._failed(job, f"{type(exc).__name__}: {exc}")
            finally:
                with self._cv:
                    self._busy = False
                    self._inflight_slot = None
                    self._cv.notify_all()

    def _failed(self, job: _Job, error: str) -> None:
        with self._cv:
            self._force_full = True  # the builder's base may not be a published version
            self.errors += 1
            if self._refused is None or job.version >= self._refused.version:
                self._refused = job
            self.last_error = f"version {job.version}: {error}"
            self._unlogged.append({"step": job.step, **self._counters()})

    def _publish(self, job: _Job) -> None:
        """Thread worker: encode, upload, publish here."""
        t0 = time.perf_counter()
        artifact = self.encode(job.version, job.tensors)
        manifest = artifact.manifest
        if manifest.version != job.version or manifest.model_id != self.model_id:
            raise ValueError(f"encode() built {manifest.model_id!r} v{manifest.version}, "
                             f"expected {self.model_id!r} v{job.version}")
        t1 = time.perf_counter()
        for name, data in artifact.files.items():
            self.client.upload_weight_file(self.model_id, job.version, name, data)
        manifest.created = job.created
        manifest.metadata = {**manifest.metadata, "step": job.step, **(job.metadata or {})}
        self.client.publish(manifest)
        t2 = time.perf_counter()
        self.after_publish(job.version, job.tensors, artifact)
        self._published(job, {**artifact_record(artifact), "encode_s": t1 - t0,
                              "upload_s": t2 - t1})

    def _publish_via_encoder(self, job: _Job) -> None:
        """Process worker: hand the slot to the encoder process and wait for its answer."""
        with self._cv:
            full = self._force_full
        try:
            encoder = self._ensure_encoder()
            encoder.send({"op": "job", "version": job.version, "step": job.step,
                          "slot": job.slot, "created": job.created, "full": full,
                          "metadata": {"step": job.step, **(job.metadata or {})}})
            answer = encoder.recv()
        except Exception:
            self._close_encoder(0)  # a new process starts from a full version
            raise
        if answer.get("version") != job.version:
            self._close_encoder(0)
            raise RuntimeError(f"the encoder answered for version {answer.get('version')}, "
                               f"expected {job.version}")
        if not answer.get("ok"):
            log.error("publishing version %d of %r failed in the encoder: %s; the next version "
                      "will be full", job.version, self.model_id, answer.get("error"))
            self._failed(job, str(answer.get("error")))
            return
        self._published(job, answer["record"])

    def _published(self, job: _Job, record: dict) -> None:
        record = {"version": job.version, "step": job.step, "snapshot_s": job.snapshot_s,
                  **record, "latency_s": time.perf_counter() - job.t_snap}
        with self._cv:
            self._force_full = False
            if self._refused is not None and job.version >= self._refused.version:
                self._refused = None
            self.last_published_version = job.version
            self.published_versions.append(job.version)
            self.last_latency_s = record["latency_s"]
            self.last_bytes = record["bytes"]
            record.update(self._counters())
            self.history.append(record)
            self._unlogged.append(record)

    def _counters(self) -> dict:
        """Running totals logged with every record (call with the lock held)."""
        return {"published_version": self.last_published_version, "replaced": self.replaced,
                "skipped": self.skipped, "errors": self.errors}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending or in flight; False if ``timeout`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def _shutdown(self, wait: bool) -> None:
        if wait:
            if not self.flush(self.flush_timeout_s):
                log.warning("weight publication still running after %.0f s; version %s may be "
                            "unpublished", self.flush_timeout_s,
                            self._pending.version if self._pending else "in flight")
        with self._cv:
            self._stop = True
            if not wait:
                self._pending = None
            self._cv.notify_all()
        if not wait:
            self._close_encoder(0)  # unblocks a worker waiting for an answer
        if self._thread is not None:
            self._thread.join(timeout=self.flush_timeout_s if wait else 5.0)
        self._thread = None
        self._close_encoder()
        self._close_slots()

    def log_published(self, trainer: pl.Trainer) -> int:
        """Write the per-version metrics of versions published since the last call to every
        logger, at the step each snapshot was taken; returns how many versions were written."""
        with self._cv:
            records, self._unlogged = self._unlogged, []
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
        if trainer.is_global_zero:
            self._start_worker()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.worker == "process" and trainer.is_global_zero and not is_sharded(trainer, pl_module):
            self._prestart(trainer, pl_module)

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
                self.skipped += 1
            else:
                self._take_snapshot(trainer, pl_module, version, step)
        if trainer.is_global_zero and self._unlogged:
            self.log_published(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._thread is not None:
            self._publish_refused_last()
            self._shutdown(wait=True)
        self.log_published(trainer)

    def _publish_refused_last(self) -> None:
        """Before the trainer exits: a refused newest version (e.g. a full weight store) is
        retried, in full, with backoff for up to ``flush_timeout_s``. Later versions normally
        replace a refused one; the last has no later one, and leaving it unpublished would leave
        the dataflow behind for good while the trainer exits 0. Raises if it still fails."""
        self.flush(self.flush_timeout_s)
        deadline = time.monotonic() + self.flush_timeout_s
        delay = 1.0
        while True:
            with self._cv:
                job = self._refused
            if job is None or job.version <= self.last_published_version:
                return
            if time.monotonic() + delay > deadline:
                raise RuntimeError(
                    f"version {job.version} of {self.model_id!r} (the trainer's last) could not "
                    f"be published within flush_timeout_s={self.flush_timeout_s:.0f}: "
                    f"{self.last_error}; the trained weights are in the checkpoint")
            log.warning("version %d of %r was refused (%s); retrying in %.0f s before the trainer "
                        "exits", job.version, self.model_id, self.last_error, delay)
            time.sleep(delay)
            delay = min(delay * 2, 30.0)
            with self._cv:
                self._force_full = True
                self._refused = None
                self._builder = None  # it already counted the refused version as its last
            if self.worker != "thread":
                self._close_encoder(0)  # likewise the encoder's; a new one starts from a full
            self._enqueue(job)
            self.flush(max(deadline - time.monotonic(), 0.0))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        if self._thread is not None:
            self._shutdown(wait=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._thread is not None:
            self._shutdown(wait=True)
        self.close_client()

    def state_dict(self) -> dict[str, Any]:
        return {"last_published_version": self.last_published_version,
                "last_enqueued_step": self._last_enqueued_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters; the delta base is not in the checkpoint, so the next version is full."""
        self.last_published_version = int(state_dict.get("last_published_version", 0))
        self._last_enqueued_step = int(state_dict.get("last_enqueued_step", -1))
        with self._cv:
            self._builder = None
            self._force_full = True  # (a new encoder process would start from a full anyway)


__all__ = ["WeightPublisher", "tensor_sha256", "WEIGHT_FILE", "METRIC_KEYS",
           "gather_full_state_dict", "is_sharded"]
