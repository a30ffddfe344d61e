"""``WeightPublisher``: publishes the policy's weights to the dataflow's weight store, off the step.

After every ``every_n_steps`` optimizer steps the callback publishes version
``v = optimizer_steps // every_n_steps`` of its policy (version 0 is the initial model). The training thread only
takes a snapshot (a bf16 copy of every floating tensor, on CPU); a background thread encodes it,
uploads the files, and publishes the manifest. The hand-off is a bounded slot of size one: if the
worker is still busy with an older version when a newer snapshot arrives, the newer one
**replaces** the pending one (counted in ``replaced``), so the step never waits for the network,
memory holds at most two snapshots, and published versions only ever increase. ``flush()``
(called at fit end) waits for the last publication.

This issue publishes full weights, encoded by :func:`astralight.weights.build_full`: the Hugging
Face ``state_dict`` (HF names; tied aliases dropped like ``save_pretrained`` does) as bf16
safetensors -- one ``model.safetensors`` up to 1 GiB, shards beyond (the dataflow caps a file at
``max_weight_file_bytes``) -- and a manifest with every file's sha256/bytes and every tensor's
dtype/shape/sha256, which is exactly what the RaaS side (``WeightState``) verifies.

Extension point for the bf16-delta path: override :meth:`encode` (``version, tensors ->
astralight.weights.Artifact``), e.g. with ``astralight.weights.ArtifactBuilder.build`` which picks
full or delta; :meth:`after_publish` runs in the worker after each successful publication.
:meth:`snapshot` decides what is copied on the training thread.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

log = logging.getLogger(__name__)

WEIGHT_FILE = "model.safetensors"


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
    tensors: dict[str, Tensor]
    created: float


class WeightPublisher(pl.Callback):
    """Publish version ``optimizer_steps // every_n_steps`` every ``every_n_steps`` steps.

    Args:
        dataflow_url: the dataflow service (default: the datamodule's ``dataflow_url``).
        model_id: the policy (default: the module's ``model_id``, else the datamodule's).
        every_n_steps: optimizer steps per published version.
        token: bearer token (default: env ``ASTRALIGHT_TOKEN``, read by the client).
        flush_timeout_s: how long ``fit`` end waits for the last publication.

    Runs on global rank 0 only (under FSDP every rank joins the full-state gather). Tests may set
    :attr:`client` to any object with ``upload_weight_file`` and ``publish``.
    """

    def __init__(
        self,
        dataflow_url: str | None = None,
        model_id: str | None = None,
        every_n_steps: int = 1,
        token: str | None = None,
        flush_timeout_s: float = 600.0,
    ):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps: must be >= 1, got {every_n_steps}")
        self.dataflow_url = dataflow_url
        self.model_id = model_id
        self.every_n_steps = every_n_steps
        self.token = token
        self.flush_timeout_s = flush_timeout_s
        self._client = None
        self._cv = threading.Condition()
        self._pending: _Job | None = None
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_enqueued_step = -1
        # counters (written by the worker under the lock, read anywhere)
        self.last_published_version = 0
        self.published_versions: list[int] = []
        self.replaced = 0
        self.errors = 0
        self.last_error: str | None = None
        self.last_latency_s = 0.0
        self.last_bytes = 0
        self.enqueued = 0

    # ---------------------------------------------------------------- client

    def make_client(self):
        from astralight.dataflow.client import DataflowClient

        if not self.dataflow_url:
            raise ValueError("dataflow_url: not set and the datamodule has none; "
                             "set callbacks[WeightPublisher].init_args.dataflow_url")
        return DataflowClient(self.dataflow_url, token=self.token)

    @property
    def client(self):
        if self._client is None:
            self._client = self.make_client()
        return self._client

    @client.setter
    def client(self, value) -> None:
        self._client = value

    # ---------------------------------------------------------------- extension points

    def hf_model(self, pl_module: pl.LightningModule) -> torch.nn.Module:
        """The module whose ``state_dict`` names are the HF names (``pl_module.model``)."""
        model = getattr(pl_module, "model", None)
        return model if isinstance(model, torch.nn.Module) else pl_module

    def snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Tensor] | None:
        """bf16 CPU copies of the HF state_dict's floating tensors on the training thread.

        Returns None on ranks other than 0.

        Tied aliases (the same storage under a second name, e.g. ``lm_head.weight`` tied to the
        embeddings) are dropped after the first name, as ``save_pretrained`` does.
        """
        model = self.hf_model(pl_module)
        if "FSDP" in type(trainer.strategy).__name__:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            state = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if not trainer.is_global_zero:
                return None
        else:
            if not trainer.is_global_zero:
                return None
            state = model.state_dict()
        out: dict[str, Tensor] = {}
        seen: set[tuple[int, int, tuple]] = set()
        for name, t in state.items():
            if not isinstance(t, Tensor):
                continue
            alias = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if t.device.type != "meta" and alias in seen:
                continue
            seen.add(alias)
            if t.is_floating_point():  # integer buffers are not weights: never published
                out[name] = t.detach().to(device="cpu", dtype=torch.bfloat16, copy=True)
        return out

    def encode(self, version: int, tensors: dict[str, Tensor]):
        """Full weights as an ``astralight.weights.Artifact`` (override for the delta path)."""
        from astralight.weights import build_full

        return build_full(self.model_id, version, tensors)

    def after_publish(self, version: int, tensors: dict[str, Tensor], artifact: Any) -> None:
        """Called in the worker after ``version`` is published (default: nothing)."""

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
        while True:
            with self._cv:
                while self._pending is None and not self._stop:
                    self._cv.wait()
                if self._pending is None:
                    return
                job, self._pending = self._pending, None
                self._busy = True
            try:
                self._publish(job)
            except Exception as exc:  # a failed publication must not kill later ones
                log.exception("publishing version %d of %r failed", job.version, self.model_id)
                with self._cv:
                    self.errors += 1
                    self.last_error = f"version {job.version}: {type(exc).__name__}: {exc}"
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _publish(self, job: _Job) -> None:
        t0 = time.perf_counter()
        artifact = self.encode(job.version, job.tensors)
        manifest = artifact.manifest
        if manifest.version != job.version or manifest.model_id != self.model_id:
            raise ValueError(f"encode() built {manifest.model_id!r} v{manifest.version}, "
                             f"expected {self.model_id!r} v{job.version}")
        for name, data in artifact.files.items():
            self.client.upload_weight_file(self.model_id, job.version, name, data)
        manifest.created = job.created
        manifest.metadata = {**manifest.metadata, "step": job.step}
        self.client.publish(manifest)
        self.after_publish(job.version, job.tensors, artifact)
        with self._cv:
            self.last_published_version = job.version
            self.published_versions.append(job.version)
            self.last_latency_s = time.perf_counter() - t0
            self.last_bytes = sum(len(d) for d in artifact.files.values())

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
        if self._thread is not None:
            self._thread.join(timeout=self.flush_timeout_s if wait else 5.0)
        self._thread = None

    # ---------------------------------------------------------------- Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        dm = getattr(trainer, "datamodule", None)
        if self.dataflow_url is None:
            self.dataflow_url = getattr(dm, "dataflow_url", None)
        if self.model_id is None:
            self.model_id = getattr(pl_module, "model_id", None) or getattr(dm, "model_id", None)
        if self.model_id is None:
            raise ValueError("model_id: not set and neither the module nor the datamodule has one")
        if trainer.is_global_zero:
            self._start_worker()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        expected = trainer.global_step // self.every_n_steps
        try:
            current = self.client.current_version(self.model_id)
        except Exception as exc:  # the service may be starting; publication will retry anyway
            log.warning("could not read the current version of %r: %s", self.model_id, exc)
            return
        if current > expected:
            log.warning(
                "the dataflow already holds version %d of %r but this trainer starts at version "
                "%d (step %d): resume from the checkpoint that published it, or new versions "
                "will not supersede it", current, self.model_id, expected, trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step > self._last_enqueued_step and step > 0 and step % self.every_n_steps == 0:
            self._last_enqueued_step = step
            tensors = self.snapshot(trainer, pl_module)
            if tensors is not None:
                self._enqueue(_Job(step // self.every_n_steps, step, tensors, time.time()))
        if trainer.is_global_zero:
            with self._cv:
                stats = {
                    "publish/version": float(self.last_published_version),
                    "publish/latency_s": float(self.last_latency_s),
                    "publish/bytes": float(self.last_bytes),
                    "publish/replaced": float(self.replaced),
                    "publish/errors": float(self.errors),
                }
            pl_module.log_dict(stats, on_step=True, on_epoch=False, rank_zero_only=True,
                               batch_size=1)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._thread is not None:
            self._shutdown(wait=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        if self._thread is not None:
            self._shutdown(wait=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._thread is not None:
            self._shutdown(wait=True)
        if self._client is not None and hasattr(self._client, "close"):
            self._client.close()
            self._client = None

    def state_dict(self) -> dict[str, Any]:
        return {"last_published_version": self.last_published_version,
                "last_enqueued_step": self._last_enqueued_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_published_version = int(state_dict.get("last_published_version", 0))
        self._last_enqueued_step = int(state_dict.get("last_enqueued_step", -1))


__all__ = ["WeightPublisher", "tensor_sha256", "WEIGHT_FILE"]
