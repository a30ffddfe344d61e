"""``RolloutDataModule``: a streaming datamodule that pulls training batches from the dataflow.

The trainer never schedules rollouts: it asks the dataflow for the next batch of its policy
(``pull_batch`` long-polls until ``batch_size`` samples are ready), trains on it and acknowledges
it. There is no epoch: the stream is infinite, and the Trainer's ``max_steps`` ends the run (the
dataset defines no ``__len__``, so Lightning treats it as infinite and never calls ``len()``).

Why the pull happens in ``on_before_batch_transfer``: Lightning's fit loop prefetches one batch
ahead of the step it is running. A batch pulled into that slot would be one version staler than
necessary and, at the end of ``fit``, pulled but never trained or acknowledged. The stream the
DataModule hands to Lightning therefore yields cheap :class:`PendingPull` placeholders and the
DataModule performs the HTTP pull in ``on_before_batch_transfer``, i.e. exactly when the loop is
about to train that batch (after the previous step and its callbacks, weight publication
included). Iterating :class:`RolloutStream` directly (``lazy=False``) pulls eagerly instead.

Why every batch carries ``trainer_version``: staleness (``train/staleness_*``) is the number of
versions between the weights that sampled a token and the weights the optimizer step is applied
to. The trainer knows the latter (:meth:`RolloutDataModule.trainer_version`, from its
WeightPublisher); the batch's ``policy_version`` is only what the dataflow knew when serving it,
one version behind whenever the last publication had not arrived yet.

Why a keep-alive (:class:`BatchKeepAlive`): the dataflow re-queues a batch not acknowledged within
its ``batch_ack_timeout_s`` (a trainer that died never will), and may serve it again to the next
pull. A live trainer whose step outlasts the timeout (long rollouts of a big model) would then ack
late and train those samples twice. So while a pulled batch is outstanding (pulled, not yet
acked) a daemon thread extends it every ``keepalive_interval_s`` (default: a third of the
timeout, which the service sends with every pull); only a dead or frozen trainer loses its batch.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from astralight.agents.stats import batch_scalars
from astralight.dataflow.client import DataflowClient, DataflowError, LazyDataflowClient

log = logging.getLogger(__name__)

PAD_ID = 0
#: seconds between two "waiting for samples" lines while the dataflow has nothing to serve
WAIT_LOG_EVERY_S = 30.0


def collate_batch(batch: Any, wait_s: float = 0.0, pad_id: int = PAD_ID,
                  trainer_version: int | None = None) -> dict[str, Any]:
    """A protocol ``Batch`` -> the trainer batch dict (right-padded to the longest).

    Keys: ``input_ids`` / ``attention_mask`` / ``versions`` long ``[B, T]`` (versions -1 on
    padding), ``loss_mask`` / ``behaviour_logprobs`` float ``[B, T]``, ``advantages`` /
    ``rewards`` float ``[B]``, ``temperature`` float64 ``[B]`` (NaN where a sample did not say),
    and plain ``batch_id``, ``model_id``, ``policy_version`` (the dataflow's current version
    when it served the batch), ``trainer_version`` (the version of the weights the trainer
    will step with this batch, or None when unknown: see
    :meth:`RolloutDataModule.trainer_version`), ``wait_s``, ``task_ids`` and ``metadata`` (one
    entry per sample: its task, which groups samples, and the workflow's ``Sample.metadata``,
    e.g. ``finish_reason``; :meth:`astralight.policy.RLPolicy.prepare_batch` passes both on to
    the objective), ``agent_stats`` (tool workflows' per-sample means,
    :func:`astralight.agents.stats.batch_scalars`; empty otherwise).
    """
    samples = batch.samples
    if not samples:
        raise ValueError(f"batch {batch.batch_id}: no samples")
    bsz = len(samples)
    length = max(s.num_tokens for s in samples)
    input_ids = np.full((bsz, length), pad_id, dtype=np.int64)
    attention = np.zeros((bsz, length), dtype=np.int64)
    loss_mask = np.zeros((bsz, length), dtype=np.float32)
    logprobs = np.zeros((bsz, length), dtype=np.float32)
    versions = np.full((bsz, length), -1, dtype=np.int64)
    temps = np.full(bsz, np.nan, dtype=np.float64)
    for i, s in enumerate(samples):
        n = s.num_tokens
        input_ids[i, :n] = s.token_ids
        attention[i, :n] = 1
        loss_mask[i, :n] = s.loss_mask
        logprobs[i, :n] = s.logprobs
        versions[i, :n] = s.versions
        t = (s.metadata or {}).get("temperature")
        if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
            temps[i] = float(t)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "loss_mask": torch.from_numpy(loss_mask),
        "behaviour_logprobs": torch.from_numpy(logprobs),
        "versions": torch.from_numpy(versions),
        "advantages": torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32),
        "rewards": torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
        "temperature": torch.from_numpy(temps),
        "batch_id": batch.batch_id,
        "model_id": batch.model_id,
        "policy_version": int(batch.policy_version),
        "trainer_version": None if trainer_version is None else int(trainer_version),
        "wait_s": float(wait_s),
        "task_ids": [s.task_id for s in samples],
        "metadata": [dict(s.metadata or {}) for s in samples],
        "agent_stats": batch_scalars(s.metadata for s in samples),
    }


class BatchKeepAlive:
    """Extends every batch this trainer holds (pulled, not yet acked) from a daemon thread.

    :meth:`hold` a batch right after its pull, :meth:`release` it right before its ack (so an
    extend racing the ack is not mistaken for a refusal), :meth:`close` at teardown. Every
    ``interval_s`` the thread calls ``client.extend_batch`` for each held batch:

    * 404/409 (unknown, already acked, or already re-queued because the trainer was frozen
      longer than the timeout): the batch is dropped from the held set and a warning is logged
      (once per process; the ack will say whether samples were trained twice);
    * any other failure (connection refused, a restarting dataflow, a 5xx): counted, logged once
      per run of failures, retried at the next tick. Nothing here ever raises into the step.

    ``client_fn`` builds the client the thread uses (called in the thread, once; closed at
    :meth:`close` if ``owns_client``); ``name`` says whose batches these are in log lines.
    """

    def __init__(self, client_fn: Callable[[], Any], interval_s: float, name: str = "trainer",
                 owns_client: bool = True):
        if not interval_s > 0:
            raise ValueError(f"keepalive_interval_s: must be > 0 seconds, got {interval_s}")
        self.client_fn = client_fn
        self.owns_client = owns_client  # close the client at close()
        self.interval_s = float(interval_s)
        self.name = name
        self.extended = 0  # successful extends
        self.refused = 0  # batches the service would not extend (404/409)
        self.errors = 0  # transient failures (retried)
        self._held: dict[str, float] = {}  # batch_id -> when pulled (monotonic)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = None
        self._warned_refused = False
        self._failing = False

    @property
    def held(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def hold(self, batch_id: str) -> None:
        with self._lock:
            self._held[batch_id] = time.monotonic()
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"astralight-keepalive-{self.name}")
                self._thread.start()

    def release(self, batch_id: str) -> bool:
        """Stop extending ``batch_id``; True if it was held."""
        with self._lock:
            return self._held.pop(batch_id, None) is not None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> None:
        """Extend every held batch once (the thread's loop body; tests call it directly)."""
        for batch_id in self.held:
            if self._stop.is_set():
                return
            try:
                if self._client is None:
                    self._client = self.client_fn()
                self._client.extend_batch(batch_id)
            except DataflowError as exc:
                if exc.status in (404, 409):
                    self._refused(batch_id, exc)
                else:
                    self._transient(batch_id, exc)
            except Exception as exc:  # never let the keep-alive thread die
                self._transient(batch_id, exc)
            else:
                self.extended += 1
                if self._failing:
                    log.info("%s: batch keep-alive reaches the dataflow again", self.name)
                    self._failing = False

    def _refused(self, batch_id: str, exc: DataflowError) -> None:
        if not self.release(batch_id):
            return  # acked meanwhile: the 409 is about our own ack
        self.refused += 1
        if not self._warned_refused:
            self._warned_refused = True
            log.warning(
                "%s: the dataflow refused to extend batch %s (%s). A batch is re-queued when it "
                "is neither acked nor extended within batch_ack_timeout_s: this trainer was "
                "frozen (stopped, swapped out) or cut off from the dataflow for longer than that, "
                "and the batch's samples may be trained again by the next pull. (Logged once.)",
                self.name, batch_id, exc.message)

    def _transient(self, batch_id: str, exc: Exception) -> None:
        self.errors += 1
        if not self._failing:
            self._failing = True
            log.warning("%s: could not extend batch %s (%s: %s); retrying every %.1f s",
                        self.name, batch_id, type(exc).__name__, exc, self.interval_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (an extend in flight finishes first) and close its client."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout_s)
        with self._lock:
            self._held.clear()
        if self._client is not None and self.owns_client and hasattr(self._client, "close"):
            self._client.close()
        self._client = None


@dataclass(frozen=True)
class PendingPull:
    """Placeholder yielded by a lazy stream; resolved into a batch by :meth:`RolloutStream.pull`."""

    index: int


class RolloutStream(IterableDataset):
    """Infinite stream of trainer batches of one policy, pulled from the dataflow.

    ``client_fn`` builds the client in the iterating process (the client is not shared across
    processes). Raises ``TimeoutError`` when ``max_wait_s`` passes without a batch.
    ``trainer_version_fn``, if given, is asked at each pull for the trainer's own weight
    version, carried in the batch as ``trainer_version``.
    """

    def __init__(self, client_fn: Callable[[], Any], model_id: str, batch_size: int,
                 pull_timeout_s: float = 30.0, max_wait_s: float | None = None,
                 trainer_id: str | None = None, lazy: bool = False, where: str = "dataflow",
                 on_pull: Callable[[Any], None] | None = None,
                 trainer_version_fn: Callable[[], int | None] | None = None):
        super().__init__()
        self.on_pull = on_pull  # called with each protocol Batch as soon as it is pulled
        self.trainer_version_fn = trainer_version_fn
        self.client_fn = client_fn
        self.model_id = model_id
        self.batch_size = batch_size
        self.pull_timeout_s = pull_timeout_s
        self.max_wait_s = max_wait_s
        self.trainer_id = trainer_id
        self.lazy = lazy
        self.where = where
        self.pulled = 0
        self._client = None

    @property
    def client(self):
        if self._client is None:
            self._client = self.client_fn()
        return self._client

    def __iter__(self) -> Iterator[Any]:
        index = 0
        while True:
            yield PendingPull(index) if self.lazy else self.pull()
            index += 1

    def pull(self) -> dict[str, Any]:
        """Block until the dataflow serves a batch; return it collated, with ``wait_s``."""
        start = time.monotonic()
        next_log = start + WAIT_LOG_EVERY_S
        while True:
            batch = self.client.pull_batch(self.model_id, self.batch_size,
                                           timeout_s=self.pull_timeout_s,
                                           trainer_id=self.trainer_id)
            now = time.monotonic()
            if batch is not None and batch.samples:
                if batch.model_id != self.model_id:
                    raise ValueError(f"batch.model_id: asked for {self.model_id!r}, "
                                     f"the dataflow served {batch.model_id!r}")
                if len(batch.samples) != self.batch_size:
                    log.warning("batch %s has %d samples, asked for %d", batch.batch_id,
                                len(batch.samples), self.batch_size)
                self.pulled += 1
                if self.on_pull is not None:
                    self.on_pull(batch)
                version = self.trainer_version_fn() if self.trainer_version_fn else None
                return collate_batch(batch, wait_s=now - start, trainer_version=version)
            waited = now - start
            if self.max_wait_s is not None and waited >= self.max_wait_s:
                raise TimeoutError(
                    f"no batch of {self.batch_size} samples for model_id {self.model_id!r} from "
                    f"{self.where} after {waited:.0f} s (max_wait_s={self.max_wait_s}); is a RaaS "
                    "serving this policy and is the dataflow producing tasks?")
            if now >= next_log:
                log.info("waiting for samples of %r from %s (%.0f s so far)", self.model_id,
                         self.where, waited)
                next_log = now + WAIT_LOG_EVERY_S

    def close(self) -> None:
        if self._client is not None and hasattr(self._client, "close"):
            self._client.close()
        self._client = None


class TrainerStopping:
    """``is_set()``: the trainer ``owner.trainer`` wants to stop -- ``should_stop`` (what
    ``astralight fit`` sets on SIGTERM, or an early-stopping callback) or Lightning's own
    ``received_sigterm``. The datamodule's client takes it as its ``stop``, so that a pull waiting
    for an unreachable dataflow gives up at once (``DataflowStopped``) instead of after
    ``retry_s``: the fit loop would stop after that pull anyway."""

    def __init__(self, owner: Any):
        self.owner = owner

    def is_set(self) -> bool:
        trainer = getattr(self.owner, "trainer", None)
        if trainer is None:
            return False
        return bool(getattr(trainer, "should_stop", False)
                    or getattr(trainer, "received_sigterm", False))


class RolloutDataModule(LazyDataflowClient, pl.LightningDataModule):
    """Streams batches of ``model_id`` from the dataflow at ``dataflow_url``.

    Args:
        dataflow_url: the dataflow service, e.g. ``http://127.0.0.1:8400``.
        model_id: the policy whose samples to pull.
        batch_size: samples per batch (the dataflow returns exactly this many).
        pull_timeout_s: long-poll duration of one pull request.
        token: bearer token (default: env ``ASTRALIGHT_TOKEN``, read by the client).
        max_wait_s: give up (``TimeoutError``) after waiting this long for one batch;
            ``None`` waits forever, logging a "waiting for samples" line every ~30 s.
        trainer_id: name this trainer gives the dataflow (default: host-pid-rank).
        keepalive_interval_s: extend every pulled, not yet acknowledged batch this often
            (:class:`BatchKeepAlive`), so a step longer than the dataflow's
            ``batch_ack_timeout_s`` keeps its batch. ``None``: a third of that timeout (the
            service sends it with every pull; a service too old to send it gets no keep-alive);
            ``0``: off.

    Tests may set :attr:`client` to any object with ``pull_batch``/``ack`` (and ``close``; with
    ``extend_batch`` and a ``batch_ack_timeout_s`` attribute, or ``keepalive_interval_s``, it
    is kept alive too).
    """

    def __init__(
        self,
        dataflow_url: str,
        model_id: str = "policy",
        batch_size: int = 64,
        pull_timeout_s: float = 30.0,
        token: str | None = None,
        max_wait_s: float | None = None,
        trainer_id: str | None = None,
        keepalive_interval_s: float | None = None,
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if keepalive_interval_s is not None and not (math.isfinite(keepalive_interval_s)
                                                     and keepalive_interval_s >= 0):
            raise ValueError(f"keepalive_interval_s: must be >= 0 seconds (0: off, None: a third "
                             f"of the dataflow's batch_ack_timeout_s), got {keepalive_interval_s}")
        self.keepalive_interval_s = keepalive_interval_s
        self._keepalive: BatchKeepAlive | None = None
        self._keepalive_off_logged = False
        self.dataflow_url = dataflow_url
        self.model_id = model_id
        self.batch_size = batch_size
        self.pull_timeout_s = pull_timeout_s
        self.token = token
        self.max_wait_s = max_wait_s
        self.trainer_id = trainer_id
        self._client = None
        self._stream: RolloutStream | None = None
        #: the last acknowledged batch ids (bounded) and how many in all
        self.acknowledged: collections.deque[str] = collections.deque(maxlen=1024)
        self.n_acknowledged = 0
        self._pulled_before = 0  # batches pulled by earlier streams (and before a resume)
        self._resumed_step: int | None = None  # set by a checkpoint load, reported at first pull

    # ---------------------------------------------------------------- client

    def make_client(self):
        """The pull / ack client; it stops retrying an unreachable dataflow as soon as the
        trainer wants to stop (:class:`TrainerStopping`): a SIGTERM must not wait out the
        client's ``retry_s``."""
        client = super().make_client()
        client.stop = TrainerStopping(self)
        return client

    def _trainer_id(self) -> str:
        if self.trainer_id:
            return self.trainer_id
        trainer = getattr(self, "trainer", None)
        rank = trainer.global_rank if trainer is not None else 0
        return f"{self.model_id}@{socket.gethostname()}:{os.getpid()}:r{rank}"

    # ---------------------------------------------------------------- Lightning hooks

    def stream(self, lazy: bool = True) -> RolloutStream:
        return RolloutStream(lambda: self.client, self.model_id, self.batch_size,
                             self.pull_timeout_s, self.max_wait_s, self._trainer_id(), lazy=lazy,
                             where=self.dataflow_url, on_pull=self._on_pull,
                             trainer_version_fn=self.trainer_version)

    def trainer_version(self) -> int | None:
        """The policy version of the weights this trainer's next optimizer step is applied to
        (what ``train/staleness_*`` is measured against), or None when no callback numbers them.

        It is the version the trainer's WeightPublisher publishes its current weights as:
        ``global_step // every_n_steps``, asked of the first callback with a
        ``weights_version(global_step)`` method whose ``model_id`` is this policy's (or not yet
        set). The pull happens in :meth:`on_before_batch_transfer`, after the previous step and
        its callbacks, so ``global_step`` there counts every step before the one this batch
        trains; after a resume Lightning has restored it from the checkpoint.

        Not the batch's ``policy_version``: that is the version the dataflow knew when it served
        the batch, which lags the trainer's own while a publication is still on its way
        (publication runs off the step), so staleness measured against it reads one version low.
        """
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return None
        for callback in getattr(trainer, "callbacks", None) or []:
            weights_version = getattr(callback, "weights_version", None)
            policy = getattr(callback, "model_id", None)
            if callable(weights_version) and policy in (None, self.model_id):
                return int(weights_version(trainer.global_step))
        return None

    # ---------------------------------------------------------------- keep-alive

    def _keepalive_interval(self) -> float | None:
        if self.keepalive_interval_s is not None:
            return self.keepalive_interval_s or None
        timeout = getattr(self.client, "batch_ack_timeout_s", None)
        if isinstance(timeout, (int, float)) and timeout > 0:
            return timeout / 3.0
        return None

    def _keepalive_client(self, interval: float):
        """The keep-alive thread's own client (one attempt per extend, short timeout: a failure
        is retried at the next tick, never blocks the step), or a substituted client that can
        extend, or None."""
        client = self.client
        if type(client) is DataflowClient:
            return lambda: DataflowClient(client.url, token=self.token,
                                          timeout=max(2.0, interval), retry_s=0.0), True
        if hasattr(client, "extend_batch"):
            return (lambda: client), False
        return None

    def _on_pull(self, batch: Any) -> None:
        """A batch was pulled: keep it alive until :meth:`acknowledge`."""
        interval = self._keepalive_interval()
        made = self._keepalive_client(interval) if interval else None
        if made is None:
            if not self._keepalive_off_logged:
                self._keepalive_off_logged = True
                why = ("keepalive_interval_s=0" if self.keepalive_interval_s == 0 else
                       "the client cannot extend batches" if interval else
                       "the dataflow did not say its batch_ack_timeout_s (an older service)")
                log.info("%s: batch keep-alive off (%s): a step longer than the dataflow's "
                         "batch_ack_timeout_s loses its batch", self.model_id, why)
            return
        if self._keepalive is None:
            client_fn, owns = made
            self._keepalive = BatchKeepAlive(client_fn, interval, name=self._trainer_id(),
                                             owns_client=owns)
        self._keepalive.interval_s = interval  # follows the service's timeout after a restart
        self._keepalive.hold(batch.batch_id)

    @property
    def n_pulled(self) -> int:
        """Batches pulled in this trainer's life, resumes included."""
        return self._pulled_before + (self._stream.pulled if self._stream is not None else 0)

    def train_dataloader(self) -> DataLoader:
        if self._stream is not None:
            self._pulled_before += self._stream.pulled
        self._stream = self.stream(lazy=True)
        # batch_size=None: the stream yields whole batches; num_workers=0: pulls happen in the
        # training process, where the ack and the weight publication also happen.
        return DataLoader(self._stream, batch_size=None, num_workers=0,
                          collate_fn=_identity)

    def _global_step(self) -> int | None:
        trainer = getattr(self, "trainer", None)
        step = getattr(trainer, "global_step", None) if trainer is not None else None
        return int(step) if isinstance(step, int) else None

    def _report_resume(self) -> None:
        """Once after a restart from a checkpoint (rank zero): tell the dataflow the step it was
        taken at, so that the batches acked after it -- trained into weights the crash lost --
        are counted as rolled back instead of trained. Never fails the step: an older service
        without the route, or a client without the method, only gets a log line."""
        step, self._resumed_step = self._resumed_step, None
        trainer = getattr(self, "trainer", None)
        if step is None or (trainer is not None and not trainer.is_global_zero):
            return
        report = getattr(self.client, "trainer_resumed", None)
        if report is None:
            return
        try:
            answer = report(self.model_id, step)
        except Exception as exc:  # noqa: BLE001 - accounting only; training goes on
            log.warning("%s: could not tell the dataflow this trainer resumed at step %d (%s: %s); "
                        "batches acked after that step stay counted as trained", self.model_id,
                        step, type(exc).__name__, exc)
            return
        if isinstance(answer, dict) and answer.get("batches_rolled_back"):
            log.warning("%s: resumed at step %d; the dataflow counts %d batches (%d samples) "
                        "acked after it as rolled back (their training was lost with the crash)",
                        self.model_id, step, answer["batches_rolled_back"],
                        answer.get("samples_rolled_back", 0))

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self._resumed_step is not None:
            self._report_resume()
        if isinstance(batch, PendingPull):
            stream = self._stream or self.stream(lazy=True)
            self._stream = stream
            return stream.pull()
        return batch

    def acknowledge(self, batch_id: str, wait_s: float | None = None,
                    step_s: float | None = None) -> None:
        """Tell the dataflow this batch is trained (called by the module after its optimizer
        step), with how long the trainer waited for it and how long the whole step took.

        The keep-alive stops extending the batch first. A late ack (the dataflow had re-queued
        the batch: this trainer was frozen longer than ``batch_ack_timeout_s``) is logged as a
        warning when the dataflow says samples were trained twice."""
        if self._keepalive is not None:
            self._keepalive.release(batch_id)
        kw: dict[str, Any] = {}
        if wait_s is not None and step_s is not None:
            kw.update(wait_s=wait_s, step_s=step_s)
        step = self._global_step()
        if step is not None:
            kw["step"] = step  # a restart from an older checkpoint rolls back acks after it
        answer = self.client.ack(batch_id, **kw)
        self.acknowledged.append(batch_id)
        self.n_acknowledged += 1
        if isinstance(answer, dict) and answer.get("late"):
            if answer.get("warning"):
                log.warning("%s: %s", self.model_id, answer["warning"])
            else:
                log.warning("%s: batch %s was acked after the dataflow had re-queued it (this "
                            "trainer was frozen longer than batch_ack_timeout_s); its %s samples "
                            "were still queued and are taken back", self.model_id, batch_id,
                            answer.get("taken_back"))

    def teardown(self, stage: str) -> None:
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        self.close_client()
        if self._stream is not None:
            self._pulled_before += self._stream.pulled
        self._stream = None

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The datamodule's position, saved in every checkpoint.

        A pull stream has no replayable position of its own: the dataflow owns it (each batch
        is served once, acknowledged after its optimizer step, re-served if never acknowledged).
        What the trainer keeps is how far it got: batches pulled and acknowledged, and the last
        acknowledged ids. Lightning saves checkpoints after a step's ack, so a checkpoint never
        holds a batch pulled and not acknowledged; batches acknowledged after the checkpoint
        were trained into weights a crash lost, and the resumed trainer trains on new ones --
        so the checkpoint also keeps its optimizer ``step``, which a resumed trainer reports
        (``POST /v1/trainer/resumed``) for the dataflow to count those acks as rolled back.
        """
        return {"batches_pulled": self.n_pulled, "batches_acknowledged": self.n_acknowledged,
                "last_acknowledged": list(self.acknowledged)[-32:], "step": self._global_step()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pulled_before = int(state_dict.get("batches_pulled", 0))
        if self._stream is not None:
            self._stream.pulled = 0
        self.n_acknowledged = int(state_dict.get("batches_acknowledged", 0))
        self.acknowledged.clear()
        self.acknowledged.extend(str(b) for b in state_dict.get("last_acknowledged", []))
        step = state_dict.get("step")
        self._resumed_step = int(step) if isinstance(step, int) and step >= 0 else None
        rank_zero_info(f"{self.model_id}: resumed after {self.n_acknowledged} acknowledged "
                       f"batches (last {self.acknowledged[-1] if self.acknowledged else None})")


def _identity(x: Any) -> Any:
    return x


__all__ = ["RolloutDataModule", "RolloutStream", "PendingPull", "BatchKeepAlive", "collate_batch"]
