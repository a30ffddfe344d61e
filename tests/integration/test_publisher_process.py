"""WeightPublisher's default process worker against the real dataflow service: snapshots go
through the shared-memory slots to the encoder process, which publishes full and delta versions
that rebuild the trainer's bf16 weights bit for bit; a killed encoder is replaced and its
successor starts with a full version. Batches come from the unit tests' fake datamodule client."""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import numpy as np
import torch

from astralight.callbacks import WeightPublisher
from astralight.dataflow.client import DataflowClient
from astralight.datamodules import RolloutDataModule
from astralight.policy import M2POPolicy
from astralight.weights import WeightState, to_bf16_bits
from tests.fakes import FakeDataflowClient


class FlushEachStep(pl.Callback):
    """Waits for each publication, records the trainer's bf16 weights, kills the encoder once."""

    def __init__(self, publisher, kill_after_step=None):
        self.publisher, self.kill_after_step = publisher, kill_after_step
        self.at_step = {}
        self.killed_pid = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert self.publisher.flush(timeout=120)
        self.at_step[trainer.global_step] = {
            n: to_bf16_bits(t.detach().to(torch.bfloat16)) for n, t in pl_module.model.state_dict().items()}
        if trainer.global_step == self.kill_after_step:
            proc = self.publisher._worker._encoder.proc
            self.killed_pid = proc.pid
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_process_worker_publishes_exact_versions_and_survives_a_killed_encoder(
        dataflow_service, tiny_model_dir, tmp_path):
    service = dataflow_service(tmp_path)
    publisher = WeightPublisher(every_n_steps=1, full_every=10)  # worker="process" by default
    flush = FlushEachStep(publisher, kill_after_step=2)
    dm = RolloutDataModule(service.url, model_id="policy", batch_size=4)
    dm.client = FakeDataflowClient(tiny_model_dir)  # batches only; weights go to the service
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[publisher, flush])
    trainer.fit(M2POPolicy(str(tiny_model_dir), lr=1e-5), datamodule=dm)

    assert publisher.worker == "process" and publisher.errors == 0
    assert publisher.published_versions == [1, 2, 3, 4]
    client = DataflowClient(service.url)
    manifests = [client.manifest("policy", v) for v in (1, 2, 3, 4)]
    # v3 is full: the encoder that held v2 as its delta base was killed, its successor has none
    assert [(m.kind, m.base_version) for m in manifests] == [
        ("full", None), ("delta", 1), ("full", None), ("delta", 3)]
    ws = WeightState()
    for m in manifests:
        ws.apply(m, {n: client.download_weight_file("policy", m.version, n) for n in m.files})
        want = flush.at_step[m.version]
        assert set(ws.state) == set(want)
        for name in want:
            assert np.array_equal(ws.state[name], want[name]), (m.version, name)
    assert all(m.metadata["step"] == m.version for m in manifests)
    records = {r["version"]: r for r in publisher.history}
    assert records[2]["kind"] == 0.0 and 0.5 < records[2]["sparsity"] < 1.0
    assert records[2]["compression_ratio"] > 1.5 and records[2]["delta_bytes"] == records[2]["bytes"]
    # fit end stopped the encoder and released the slots
    assert publisher._worker._encoder is None and publisher._worker._slot_fds == []
    assert flush.killed_pid is not None
    client.close()
