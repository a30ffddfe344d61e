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
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from astralight.dataflow.client import LazyDataflowClient

log = logging.getLogger(__name__)

PAD_ID = 0
#: seconds between two "waiting for samples" lines while the dataflow has nothing to serve
WAIT_LOG_EVERY_S = 30.0


def collate_batch(batch: Any, wait_s: float = 0.0, pad_id: int = PAD_ID) -> dict[str, Any]:
    """A protocol ``Batch`` -> the trainer batch dict (right-padded to the longest).

    Keys: ``input_ids`` / ``attention_mask`` / ``versions`` long ``[B, T]`` (versions -1 on
    padding), ``loss_mask`` / ``behaviour_logprobs`` float ``[B, T]``, ``advantages`` /
    ``rewards`` float ``[B]``, ``temperature`` float64 ``[B]`` (NaN where a sample did not say),
    and plain ``batch_id``, ``model_id``, ``policy_version``, ``wait_s``, ``task_ids``.
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
        "wait_s": float(wait_s),
        "task_ids": [s.task_id for s in samples],
    }


@dataclass(frozen=True)
class PendingPull:
    """Placeholder yielded by a lazy stream; resolved into a batch by :meth:`RolloutStream.pull`."""

    index: int


class RolloutStream(IterableDataset):
    """Infinite stream of trainer batches of one policy, pulled from the dataflow.

    ``client_fn`` builds the client in the iterating process (the client is not shared across
    processes). Raises ``TimeoutError`` when ``max_wait_s`` passes without a batch.
    """

    def __init__(self, client_fn: Callable[[], Any], model_id: str, batch_size: int,
                 pull_timeout_s: float = 30.0, max_wait_s: float | None = None,
                 trainer_id: str | None = None, lazy: bool = False, where: str = "dataflow"):
        super().__init__()
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
                return collate_batch(batch, wait_s=now - start)
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

    Tests may set :attr:`client` to any object with ``pull_batch``/``ack`` (and ``close``).
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
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
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

    # ---------------------------------------------------------------- client

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
                             where=self.dataflow_url)

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

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, PendingPull):
            stream = self._stream or self.stream(lazy=True)
            self._stream = stream
            return stream.pull()
        return batch

    def acknowledge(self, batch_id: str, wait_s: float | None = None,
                    step_s: float | None = None) -> None:
        """Tell the dataflow this batch is trained (called by the module after its optimizer
        step), with how long the trainer waited for it and how long the whole step took."""
        if wait_s is None or step_s is None:
            self.client.ack(batch_id)
        else:
            self.client.ack(batch_id, wait_s=wait_s, step_s=step_s)
        self.acknowledged.append(batch_id)
        self.n_acknowledged += 1

    def teardown(self, stage: str) -> None:
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
        were trained into weights a crash lost, and the resumed trainer trains on new ones.
        """
        return {"batches_pulled": self.n_pulled, "batches_acknowledged": self.n_acknowledged,
                "last_acknowledged": list(self.acknowledged)[-32:]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pulled_before = int(state_dict.get("batches_pulled", 0))
        if self._stream is not None:
            self._stream.pulled = 0
        self.n_acknowledged = int(state_dict.get("batches_acknowledged", 0))
        self.acknowledged.clear()
        self.acknowledged.extend(str(b) for b in state_dict.get("last_acknowledged", []))
        rank_zero_info(f"{self.model_id}: resumed after {self.n_acknowledged} acknowledged "
                       f"batches (last {self.acknowledged[-1] if self.acknowledged else None})")


def _identity(x: Any) -> Any:
    return x


__all__ = ["RolloutDataModule", "RolloutStream", "PendingPull", "collate_batch"]
