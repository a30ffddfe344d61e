"""The trainer side against the real dataflow service over HTTP.

A thread plays the RaaS (register, lease, push samples scored by the tiny model at its initial
weights); a real ``Trainer.fit`` of ``M2POPolicy`` pulls through ``RolloutDataModule``, acks every
batch after its step, and ``WeightPublisher`` publishes versions (a full, then bf16 deltas) the
service records and serves back; applied in order they give the trainer's bf16 weights bit for bit.
"""

from __future__ import annotations

import threading

import lightning.pytorch as pl
import numpy as np
import torch

from astralight.callbacks import WeightPublisher
from astralight.dataflow.client import DataflowClient
from astralight.datamodules import RolloutDataModule
from astralight.policy import M2POPolicy
from astralight.weights import WeightState
from tests.integration.service_helpers import fake_raas


def test_fit_against_the_dataflow_service(dataflow_service, tiny_model_dir, tmp_path):
    service = dataflow_service(tmp_path, group_size=4, max_buffered_samples=32)
    stop, errors = threading.Event(), []
    raas = threading.Thread(target=fake_raas, args=(service.url, tiny_model_dir, stop, errors),
                            daemon=True)
    raas.start()
    try:
        dm = RolloutDataModule(service.url, model_id="policy", batch_size=8, pull_timeout_s=5,
                               max_wait_s=120)
        policy = M2POPolicy(str(tiny_model_dir), lr=1e-3)
        publisher = WeightPublisher(every_n_steps=1)
        trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[publisher])
        trainer.fit(policy, datamodule=dm)
    finally:
        stop.set()
        raas.join(timeout=30)
    assert not errors, errors
    assert trainer.global_step == 3

    client = DataflowClient(service.url)
    stats = client.stats()["models"]["policy"]
    assert stats["batches_acked"] == 3 and stats["samples_acked"] == 24
    assert stats["batches_outstanding"] == 0  # nothing pulled and left unacknowledged
    # every ack carried the trainer's wait and step time (the balance report's wait fraction)
    assert stats["trainer_steps_timed"] == 3 and stats["trainer_step_ms"] >= stats["trainer_wait_ms"]
    assert publisher.last_published_version == client.current_version("policy") == 3
    manifest = client.latest_manifest("policy")
    # v1 full, then bf16 deltas onto the last published version (a version the trainer
    # outran while the encoder process started is skipped); a newcomer applies the chain
    manifests = [manifest]
    while manifests[0].kind == "delta":
        manifests.insert(0, client.manifest("policy", manifests[0].base_version))
    assert manifests[0].version == 1 and manifest.version == 3 and manifest.kind == "delta"
    assert len(publisher.published_versions) + publisher.replaced == 3
    ws = WeightState()
    for m in manifests:  # every file and tensor checksum verified
        ws.apply(m, {name: client.download_weight_file("policy", m.version, name)
                     for name in m.files})
    bits = ws.state
    state = policy.model.state_dict()
    for name, arr in bits.items():
        expected = state[name].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(arr, expected), name
    client.close()
