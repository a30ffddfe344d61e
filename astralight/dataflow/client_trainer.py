"""The calls a trainer makes through :class:`~astralight.dataflow.client.DataflowClient` for its
batches: long-poll a batch, keep it alive, acknowledge it, and say it resumed from a checkpoint.
(Publishing weights is :mod:`astralight.dataflow.client_weights`.)"""

from __future__ import annotations

import logging

from astralight.protocol import Batch, decode, expect

#: response header of /v1/pull carrying the service's batch_ack_timeout_s
ACK_TIMEOUT_HEADER = "X-Batch-Ack-Timeout-S"
log = logging.getLogger("astralight.dataflow.client")  # one logger for the whole client


class TrainerCalls:
    """Mixed into :class:`~astralight.dataflow.client.DataflowClient`, whose ``_send`` and
    ``_call`` carry every request."""

    #: the service's batch_ack_timeout_s as its last pull answer said (None: not yet known)
    batch_ack_timeout_s: float | None = None

    def pull_batch(self, model_id: str, size: int, timeout_s: float = 30.0,
                   trainer_id: str | None = None) -> Batch | None:
        """Long-poll for a batch of exactly ``size`` samples (None if none came in time). The
        service's ``batch_ack_timeout_s`` (a response header; None from a service that does not
        send it) is kept in :attr:`batch_ack_timeout_s`: ack or extend a batch within it."""
        timeout_s = max(0.0, float(timeout_s))  # the service refuses negative timeouts
        resp = self._send("POST", "/v1/pull", body={"model_id": model_id, "size": size,
                                                    "timeout_s": timeout_s,
                                                    "trainer_id": trainer_id},
                          timeout=max(self.timeout, timeout_s + 30.0))
        header = resp.headers.get(ACK_TIMEOUT_HEADER)
        if header is not None:
            try:
                self.batch_ack_timeout_s = float(header)
            except ValueError:
                log.warning("ignoring a malformed %s header: %r", ACK_TIMEOUT_HEADER, header[:64])
        out = decode(resp.content)
        return None if out is None else expect(out, Batch, "batch")

    def ack(self, batch_id: str, wait_s: float | None = None, step_s: float | None = None,
            step: int | None = None) -> dict:
        """Acknowledge a trained batch; a trainer also reports how long it waited for the batch
        and its whole step took (the balance report's trainer wait fraction).

        Returns the service's answer: ``{acked, already, samples, ...}``; for a batch the
        service had re-queued (a late ack) also ``late``, ``taken_back``, ``trained_twice`` and,
        when samples were trained twice, a ``warning`` to log. ``step``: the trainer's optimizer
        step count after this batch (see :meth:`trainer_resumed`)."""
        body: dict = {"batch_id": batch_id}
        if wait_s is not None and step_s is not None:
            body.update(wait_s=float(wait_s), step_s=float(step_s))
        if step is not None:
            body["step"] = int(step)
        return self._call("POST", "/v1/ack", body)

    def trainer_resumed(self, model_id: str, step: int) -> dict:
        """Say that a trainer of ``model_id`` restarted from a checkpoint taken after optimizer
        step ``step``: the service marks the batches acked after it as rolled back (their
        training was lost with the crash). Returns ``{model_id, step, batches_rolled_back,
        samples_rolled_back}``."""
        return self._call("POST", "/v1/trainer/resumed", {"model_id": model_id, "step": int(step)})

    def extend_batch(self, batch_id: str) -> dict:
        """Keep a pulled, not yet acknowledged batch from being re-queued: its ack deadline moves
        to now + ``batch_ack_timeout_s``. Returns ``{batch_id, extended, deadline_s,
        batch_ack_timeout_s}``; raises :class:`DataflowError` 404 (unknown batch) or 409 (already
        acked, or already re-queued: stop extending it)."""
        return self._call("POST", "/v1/batches/extend", {"batch_id": batch_id})
