"""Weight publication off the training thread: one publish routine behind one worker interface.

:func:`publish_artifact` is the only encode -> upload -> publish sequence: build a version's
artifact, upload its files, then send its manifest (the dataflow re-checks every file's sha256).
Both workers run it: :class:`ThreadPublisher` in a thread of the trainer, and the encoder process
that :class:`astralight.weights.publish_worker.ProcessPublisher` feeds through two shared-memory
snapshot slots, so that encoding and HTTP never share the GIL with training.

:class:`Publisher` is the interface the ``WeightPublisher`` callback drives: :meth:`~Publisher.submit`
a snapshot, :meth:`~Publisher.flush`, :meth:`~Publisher.close`, and :meth:`~Publisher.retry_last`
for a refused newest version. The hand-off is a bounded slot of size one: a newer snapshot
**replaces** one still pending (counted in ``replaced``), so the step never waits for encoding or
the network and published versions only increase. After any failed publication the next version
is full (the builder's delta base may no longer be a published version).
"""

from __future__ import annotations

import abc
import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from astralight.weights.artifacts import Artifact, ArtifactBuilder
from astralight.weights.bf16 import state_to_bits

log = logging.getLogger(__name__)

HISTORY = 10_000


class PublishBuilder(ArtifactBuilder):
    """:class:`ArtifactBuilder` that also reports a full version's sparsity against the previous
    published state (a delta reports its own in ``manifest.metadata["sparsity"]``)."""

    def build(self, version, state, *, full=None):
        previous = self._published  # a full build replaces this dict; a delta updates it in place
        art = super().build(version, state, full=full)
        if art.manifest.kind == "full" and previous is not None:
            new = state_to_bits(state)
            if set(new) == set(previous) and all(new[n].shape == previous[n].shape for n in new):
                elements = sum(int(a.size) for a in new.values())
                changed = sum(int(np.count_nonzero(previous[n] != new[n])) for n in new)
                art.manifest.metadata["sparsity"] = 1.0 - changed / elements if elements else 1.0
        return art


def artifact_record(artifact: Artifact) -> dict:
    """Per-version figures: kind (1 full, 0 delta), sizes, compression ratio, sparsity."""
    m = artifact.manifest
    sent = sum(len(d) for d in artifact.files.values())
    full_bytes = 2 * sum(int(np.prod(t["shape"], dtype=np.int64)) for t in m.tensors.values())
    rec = {"kind": 1.0 if m.kind == "full" else 0.0, "base_version": m.base_version,
           "full_bytes": full_bytes, "bytes": sent,
           "compression_ratio": full_bytes / sent if sent else float("inf")}
    if m.kind == "delta":
        rec["delta_bytes"] = sent
    if "sparsity" in m.metadata:
        rec["sparsity"] = float(m.metadata["sparsity"])
    return rec


def publish_artifact(client: Any, model_id: str, version: int, encode: Callable[[], Artifact],
                     created: float, metadata: Mapping) -> tuple[Artifact, dict]:
    """Encode version ``version`` (``encode()``), upload its files, publish its manifest with
    ``created`` and ``metadata`` merged in; returns the artifact and its record (with timings)."""
    t0 = time.perf_counter()
    artifact = encode()
    manifest = artifact.manifest
    if manifest.version != version or manifest.model_id != model_id:
        raise ValueError(f"encode() built {manifest.model_id!r} v{manifest.version}, "
                         f"expected {model_id!r} v{version}")
    t1 = time.perf_counter()
    for name, data in artifact.files.items():
        client.upload_weight_file(model_id, version, name, data)
    manifest.created = created
    manifest.metadata = {**manifest.metadata, **metadata}
    client.publish(manifest)
    t2 = time.perf_counter()
    return artifact, {**artifact_record(artifact), "encode_s": t1 - t0, "upload_s": t2 - t1}


@dataclass
class Job:
    """One snapshot handed to a worker."""

    version: int
    step: int
    created: float  # wall clock, recorded in the manifest
    t_snap: float  # perf_counter when the snapshot was complete
    snapshot_s: float
    tensors: dict[str, Tensor] | None = None  # thread worker: the bf16 copies
    slot: int | None = None  # process worker: the shared slot holding the snapshot
    metadata: dict | None = None  # merged into the manifest's metadata


class Publisher(abc.ABC):
    """A worker thread that publishes the newest submitted snapshot, and the counters it keeps.

    Subclasses say how a job is published (:meth:`_handle`) and how a snapshot is held.
    Counters are written by the worker under the lock and may be read anywhere.
    """

    def __init__(self, model_id: str | None = None, flush_timeout_s: float = 600.0):
        self.model_id = model_id
        self.flush_timeout_s = flush_timeout_s
        self.force_full = False
        self._cv = threading.Condition()
        self._pending: Job | None = None
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._inflight_slot: int | None = None
        self._unlogged: list[dict] = []
        self._refused: Job | None = None  # the newest job whose publication failed
        self.last_published_version = 0
        self.published_versions: list[int] = []
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY)
        self.replaced = 0
        self.skipped = 0
        self.errors = 0
        self.last_error: str | None = None
        self.last_latency_s = 0.0
        self.last_bytes = 0
        self.enqueued = 0

    # ------------------------------------------------------------ what subclasses provide

    @abc.abstractmethod
    def submit(self, version: int, step: int, state: dict[str, Tensor], started: float,
               metadata: dict | None = None) -> None:
        """Hand over the snapshot of ``version`` taken at ``step`` (begun at ``started``,
        a ``perf_counter``); replaces one still pending."""

    def prestart(self, state: dict[str, Tensor]) -> None:
        """Prepare for snapshots shaped like ``state`` before the first one (default: nothing)."""

    @abc.abstractmethod
    def _handle(self, job: Job) -> dict | None:
        """Publish ``job``: its record, or None after reporting a failure with :meth:`_failed`."""

    def _forget_base(self, restart: bool) -> None:
        """Drop the delta base (the next version is full); ``restart``: also any worker state
        that holds one (default: nothing)."""

    def _abort(self) -> None:
        """Unblock a job in flight (default: nothing)."""

    def _release(self) -> None:
        """Free what the worker holds once its thread has stopped (default: nothing)."""

    def _on_thread_start(self) -> None:
        """Run first in the worker thread (default: nothing)."""

    # ------------------------------------------------------------ the interface

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
        self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending or in flight; False if ``timeout`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self, wait: bool) -> None:
        """Stop the worker: after the pending version is published (``wait``), or dropping it."""
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
            self._abort()
        if self._thread is not None:
            self._thread.join(timeout=self.flush_timeout_s if wait else 5.0)
        self._thread = None
        self._release()

    def wait_published(self, version: int, timeout: float | None) -> bool:
        """Wait until ``version`` or a later one is published; False if the worker went idle
        without publishing one (those publications failed), stopped, or ``timeout`` passed."""
        with self._cv:
            self._cv.wait_for(lambda: (self.last_published_version >= version or self._stop
                                       or (self._pending is None and not self._busy)), timeout)
            return self.last_published_version >= version

    def restore(self, last_published_version: int) -> None:
        """Resume counting from a checkpoint; the delta base is not in it, so the next is full."""
        self.last_published_version = last_published_version
        with self._cv:
            self._forget_base(restart=False)
            self.force_full = True

    def count_skipped(self) -> None:
        with self._cv:
            self.skipped += 1

    def drain_records(self) -> list[dict]:
        """The records of versions published (or refused) since the last call."""
        with self._cv:
            records, self._unlogged = self._unlogged, []
        return records

    def retry_last(self) -> None:
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
                self.force_full = True
                self._refused = None
            self._forget_base(restart=True)  # it already counted the refused version as its last
            self._enqueue(job)
            self.flush(max(deadline - time.monotonic(), 0.0))

    # ------------------------------------------------------------ the worker thread

    def _enqueue(self, job: Job) -> None:
        with self._cv:
            if self._pending is not None:
                self.replaced += 1
            self._pending = job
            self.enqueued += 1
            self._cv.notify_all()

    def _run(self) -> None:
        self._on_thread_start()
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
                record = self._handle(job)
                if record is not None:
                    self._published(job, record)
            except Exception as exc:  # a failed publication must not kill later ones
                log.exception("publishing version %d of %r failed; the next version will be full",
                              job.version, self.model_id)
                self._failed(job, f"{type(exc).__name__}: {exc}")
            finally:
                with self._cv:
                    self._busy = False
                    self._inflight_slot = None
                    self._cv.notify_all()

    def _failed(self, job: Job, error: str) -> None:
        with self._cv:
            self.force_full = True  # the builder's base may not be a published version
            self.errors += 1
            if self._refused is None or job.version >= self._refused.version:
                self._refused = job
            self.last_error = f"version {job.version}: {error}"
            self._unlogged.append({"step": job.step, **self._counters()})

    def _published(self, job: Job, record: dict) -> None:
        record = {"version": job.version, "step": job.step, "snapshot_s": job.snapshot_s,
                  **record, "latency_s": time.perf_counter() - job.t_snap}
        with self._cv:
            self.force_full = False
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


class ThreadPublisher(Publisher):
    """Encodes, uploads and publishes in the worker thread of this process.

    ``client()`` returns the client to publish with; ``encode(version, tensors)`` (default:
    :meth:`encode`) builds the artifact and ``after_publish(version, tensors, artifact)`` runs
    after each publication. ``nice`` lowers the thread's CPU priority (Linux: per thread, and
    inherited by the threads it starts).
    """

    def __init__(self, client: Callable[[], Any], make_builder: Callable[[], ArtifactBuilder],
                 encode: Callable | None = None, after_publish: Callable | None = None,
                 nice: int = 0, **kwargs):
        super().__init__(**kwargs)
        self._client = client
        self._make_builder = make_builder
        self._encode = encode or self.encode
        self._after_publish = after_publish
        self.nice = nice
        self._builder: ArtifactBuilder | None = None

    def encode(self, version: int, tensors: dict[str, Tensor]) -> Artifact:
        """Full or delta onto the last published version (full when forced)."""
        if self._builder is None:
            self._builder = self._make_builder()
        full = True if self.force_full else None
        return self._builder.build(version, tensors, full=full)

    def submit(self, version, step, state, started, metadata=None) -> None:
        now = time.perf_counter()
        self._enqueue(Job(version, step, time.time(), now, now - started, tensors=state,
                          metadata=metadata))

    def _handle(self, job: Job) -> dict:
        artifact, record = publish_artifact(
            self._client(), self.model_id, job.version,
            lambda: self._encode(job.version, job.tensors), job.created,
            {"step": job.step, **(job.metadata or {})})
        if self._after_publish is not None:
            self._after_publish(job.version, job.tensors, artifact)
        return record

    def _forget_base(self, restart: bool) -> None:
        self._builder = None

    def _on_thread_start(self) -> None:
        if self.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               min(19, os.getpriority(os.PRIO_PROCESS, 0) + self.nice))
            except (AttributeError, OSError) as exc:  # other platforms, or not permitted
                log.debug("could not lower the publisher thread's priority: %s", exc)


__all__ = ["HISTORY", "Job", "PublishBuilder", "Publisher", "ThreadPublisher",
           "artifact_record", "publish_artifact"]
