"""WeightPublisher: ordered versions, exact bf16 payloads, publication off the training thread."""

from __future__ import annotations

import hashlib
import threading

import lightning.pytorch as pl
import torch
from safetensors.torch import load

from astralight.callbacks import WeightPublisher, tensor_sha256
from astralight.datamodules import RolloutDataModule
from astralight.policy import M2POPolicy
from astralight.weights import read_full
from tests.unit.trainer_fakes import FakeDataflowClient


def fit(tmp_path, model_dir, fake, callbacks, max_steps):
    dm = RolloutDataModule("http://127.0.0.1:9", model_id="policy", batch_size=4)
    dm.client = fake
    policy = M2POPolicy(str(model_dir), lr=1e-3)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    fake.trainer = trainer
    trainer.fit(policy, datamodule=dm)
    return policy, trainer


class FlushEachStep(pl.Callback):
    """Waits for each publication, so every version is observable (placed after the publisher)."""

    def __init__(self, publisher):
        self.publisher = publisher

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert self.publisher.flush(timeout=60)


def test_versions_published_in_order_with_exact_bf16_weights(tiny_model_dir, tmp_path):
    fake = FakeDataflowClient(tiny_model_dir)
    publisher = WeightPublisher()  # url and model_id come from the datamodule / module
    publisher.client = fake
    policy, trainer = fit(tmp_path, tiny_model_dir, fake, [publisher, FlushEachStep(publisher)], 4)

    assert publisher.dataflow_url == "http://127.0.0.1:9" and publisher.model_id == "policy"
    assert [m.version for m in fake.manifests] == [1, 2, 3, 4]
    assert publisher.published_versions == [1, 2, 3, 4]
    assert publisher.state_dict()["last_published_version"] == 4
    assert publisher.errors == 0 and publisher.replaced == 0
    last = fake.manifests[-1]
    assert last.kind == "full" and last.model_id == "policy" and last.metadata["step"] == 4
    data = [d for v, n, d in fake.uploads if v == 4 and n == "model.safetensors"][0]
    assert last.files["model.safetensors"] == {"sha256": hashlib.sha256(data).hexdigest(),
                                               "bytes": len(data)}
    tensors = load(data)
    state = policy.model.state_dict()
    assert set(tensors) == set(state)  # HF names, nothing tied in the tiny model
    for name, t in tensors.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, state[name].to(torch.bfloat16)), name
        meta = last.tensors[name]
        assert meta["dtype"] == "bfloat16" and meta["shape"] == list(t.shape)
        assert meta["sha256"] == tensor_sha256(t)
    # the receiving side (RaaS WeightState) accepts it: files and every tensor checksum verify
    bits = read_full(last, {"model.safetensors": data})
    assert set(bits) == set(state)
    # successive versions differ (the model trained between them)
    first = load([d for v, n, d in fake.uploads if v == 1][0])
    assert any(not torch.equal(first[k], tensors[k]) for k in tensors)


class BlockingUploads(FakeDataflowClient):
    """An upload that blocks until released: the network is 'slow' for as long as the test says."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.started = threading.Event()

    def upload_weight_file(self, model_id, version, name, data):
        self.started.set()
        assert self.release.wait(timeout=120), "upload never released"
        super().upload_weight_file(model_id, version, name, data)


class Observe(pl.Callback):
    """Records, after each step, how many publications had completed; releases at the last one."""

    def __init__(self, publisher, fake, last_step):
        self.publisher, self.fake, self.last_step = publisher, fake, last_step
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            assert self.fake.started.wait(timeout=60)  # the worker is now stuck in upload
        self.seen.append((trainer.global_step, len(self.fake.manifests)))
        if trainer.global_step == self.last_step:
            self.fake.release.set()


def test_slow_upload_does_not_block_training(tiny_model_dir, tmp_path):
    fake = BlockingUploads(tiny_model_dir)
    publisher = WeightPublisher(every_n_steps=1)
    publisher.client = fake
    observer = Observe(publisher, fake, last_step=4)
    fit(tmp_path, tiny_model_dir, fake, [publisher, observer], 4)

    # all four steps ran while the first upload was still blocked
    assert observer.seen == [(1, 0), (2, 0), (3, 0), (4, 0)]
    # v1 was in flight; v2 and v3 were replaced by newer snapshots; v4 went out at fit end
    assert [m.version for m in fake.manifests] == [1, 4]
    assert publisher.replaced == 2
    assert publisher.last_published_version == 4
    assert fake.acks and len(fake.acks) == 4


def test_every_n_steps_and_restore(tiny_model_dir, tmp_path):
    fake = FakeDataflowClient(tiny_model_dir)
    publisher = WeightPublisher(model_id="policy", every_n_steps=2)
    publisher.client = fake
    fit(tmp_path, tiny_model_dir, fake, [publisher, FlushEachStep(publisher)], 5)
    assert [m.version for m in fake.manifests] == [1, 2]  # after steps 2 and 4
    assert [m.metadata["step"] for m in fake.manifests] == [2, 4]

    restored = WeightPublisher(every_n_steps=2)
    restored.load_state_dict(publisher.state_dict())
    assert restored.last_published_version == 2
