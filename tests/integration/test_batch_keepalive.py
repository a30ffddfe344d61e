"""Batch keep-alive against the real dataflow service (a subprocess on 127.0.0.1).

* ``POST /v1/batches/extend`` through :class:`DataflowClient`: the pull says the service's
  ``batch_ack_timeout_s``; a batch extended well within it outlives it; acked / re-queued /
  unknown batches are refused (409 / 409 / 404) naming ``batch_id``;
* a real ``Trainer.fit`` whose every step sleeps longer than ``batch_ack_timeout_s`` while its
  batch is outstanding: with the datamodule's keep-alive no batch is re-queued and the audit
  finds no duplicate; with the keep-alive off the same run has its batch re-queued (the control
  that shows the first assertion can fail), and the late ack takes the samples back.
"""

from __future__ import annotations

import threading
import time

import lightning.pytorch as pl
import pytest

from astralight.dataflow.audit import audit
from astralight.dataflow.client import DataflowClient, DataflowError
from astralight.datamodules import RolloutDataModule
from astralight.policy import M2POPolicy
from tests.integration.service_helpers import fake_raas, make_samples

TIMEOUT = 2.0


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


def test_extend_route_over_http(tmp_path, dataflow_service, client_for):
    url, _, _ = dataflow_service(tmp_path, group_size=2, batch_ack_timeout_s=TIMEOUT)
    c = client_for(url)
    iid = c.register(["policy"], capacity=4)["instance_id"]
    for t in c.lease(iid, 2):
        c.push(iid, t.task_id, make_samples(t, [1.0, 0.0]))
    assert c.batch_ack_timeout_s is None
    kept = c.pull_batch("policy", 2, timeout_s=5, trainer_id="slow-trainer")
    assert kept is not None and c.batch_ack_timeout_s == TIMEOUT
    # extended every ~timeout/6 for three timeouts: never re-queued
    end = time.monotonic() + 3 * TIMEOUT
    while time.monotonic() < end:
        answer = c.extend_batch(kept.batch_id)
        assert answer["extended"] and answer["deadline_s"] == TIMEOUT
        time.sleep(TIMEOUT / 6)
    stats = c.stats()["models"]["policy"]
    assert stats["batches_requeued"] == 0 and stats["batches_outstanding"] == 1
    assert stats["batches_extended"] >= 3
    c.ack(kept.batch_id)
    with pytest.raises(DataflowError) as info:
        c.extend_batch(kept.batch_id)
    assert info.value.status == 409 and info.value.field == "batch_id"
    with pytest.raises(DataflowError) as info:
        c.extend_batch("no-such-batch")
    assert info.value.status == 404 and info.value.field == "batch_id"

    # never extended: re-queued by the service's sweeper, then refused
    dropped = c.pull_batch("policy", 2, timeout_s=5)
    wait_for(lambda: c.stats()["models"]["policy"]["batches_requeued"] == 1, what="re-queue")
    with pytest.raises(DataflowError) as info:
        c.extend_batch(dropped.batch_id)
    assert info.value.status == 409 and "re-queued" in info.value.message
    answer = c.ack(dropped.batch_id)  # late, nothing served again: taken back
    assert answer["late"] and answer["taken_back"] == 2 and answer["trained_twice"] == 0
    r = audit(tmp_path / "state")
    assert r["balanced"] and r["duplicates_trained"] == 0 and r["late_acks"] == 1, r


class SlowStep(pl.Callback):
    """Sleeps while the step's batch is outstanding (pulled, not yet acked): longer than the
    dataflow's batch_ack_timeout_s."""

    def __init__(self, sleep_s: float):
        self.sleep_s = sleep_s
        self.batch_ids: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_ids.append(batch["batch_id"])  # pulled already (on_before_batch_transfer)
        time.sleep(self.sleep_s)


def fit_slow_steps(service_url: str, tiny_model_dir, steps: int, **dm_kw):
    stop, errors = threading.Event(), []
    raas = threading.Thread(target=fake_raas, args=(service_url, tiny_model_dir, stop, errors),
                            daemon=True)
    raas.start()
    slow = SlowStep(2.5 * TIMEOUT)
    try:
        dm = RolloutDataModule(service_url, model_id="policy", batch_size=4, pull_timeout_s=5,
                               max_wait_s=120, **dm_kw)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[slow])
        trainer.fit(M2POPolicy(str(tiny_model_dir), lr=1e-3), datamodule=dm)
    finally:
        stop.set()
        raas.join(timeout=30)
    assert not errors, errors
    assert trainer.global_step == steps and len(slow.batch_ids) == steps
    assert dm._keepalive is None  # stopped at teardown
    return dm


def test_fit_with_steps_longer_than_the_ack_timeout_keeps_its_batches(
        dataflow_service, tiny_model_dir, tmp_path):
    service = dataflow_service(tmp_path, group_size=4, max_buffered_samples=16,
                               batch_ack_timeout_s=TIMEOUT)
    fit_slow_steps(service.url, tiny_model_dir, steps=2)  # keep-alive: timeout / 3
    with DataflowClient(service.url) as c:
        stats = c.stats()["models"]["policy"]
    assert stats["batches_acked"] == 2 and stats["batches_outstanding"] == 0
    assert stats["batches_requeued"] == 0 and stats["late_acks"] == 0
    assert stats["batches_extended"] >= 2  # each 5 s step spans several keep-alive ticks
    r = audit(tmp_path / "state")
    assert r["balanced"] and r["duplicates_trained"] == 0, r
    assert r["batches"] == {"acked": 2} and r["samples_trained"] == 8


def test_control_without_keepalive_the_slow_step_loses_its_batch(
        dataflow_service, tiny_model_dir, tmp_path):
    service = dataflow_service(tmp_path, group_size=4, max_buffered_samples=16,
                               batch_ack_timeout_s=TIMEOUT)
    fit_slow_steps(service.url, tiny_model_dir, steps=1, keepalive_interval_s=0)
    with DataflowClient(service.url) as c:
        stats = c.stats()["models"]["policy"]
    # the sweeper re-queued the batch mid-step; the late ack took its samples back
    assert stats["batches_requeued"] == 1 and stats["late_acks"] == 1
    assert stats["batches_extended"] == 0 and stats["samples_trained_twice"] == 0
    r = audit(tmp_path / "state")
    assert r["duplicates_trained"] == 0 and r["balanced"], r
