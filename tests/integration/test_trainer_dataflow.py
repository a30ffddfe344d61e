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
from astralight.protocol import Sample
from astralight.rl.logprobs import causal_lm_logprobs
from astralight.weights import WeightState


def fake_raas(url: str, model_dir, stop: threading.Event, errors: list) -> None:
    from astralight.hf_models import causal_lm_from_pretrained
    from astralight.tinymodel import build_tokenizer

    try:
        tok = build_tokenizer()
        # this thread loads while the test's Trainer.fit loads the policy: both under the lock
        # (overlapping from_pretrained calls can switch transformers' weight tying off for the
        # whole process, see astralight.hf_models)
        model = causal_lm_from_pretrained(model_dir, dtype=torch.float32).eval()
        rng = np.random.default_rng(0)
        client = DataflowClient(url)
        instance = client.register(["policy"], capacity=8)["instance_id"]
        while not stop.is_set():
            tasks = client.lease(instance, 4)
            if not tasks:
                stop.wait(0.05)
                continue
            version = client.current_version("policy")
            for task in tasks:
                prompt = [2] + tok.encode(task.prompt, add_special_tokens=False)
                samples = []
                for k in range(task.n):
                    gen = list(rng.integers(3, 20, int(rng.integers(1, 4)))) + [1]
                    ids = np.array(prompt + gen, dtype=np.int32)
                    with torch.no_grad():
                        lp = causal_lm_logprobs(model, torch.from_numpy(ids).long()[None])[0].numpy()
                    loss_mask = np.zeros(len(ids), dtype=np.uint8)
                    loss_mask[len(prompt):] = 1
                    logprobs = (np.concatenate([[0.0], lp]) * loss_mask).astype(np.float32)
                    samples.append(Sample(
                        task_id=task.task_id, sample_index=k, model_id="policy", token_ids=ids,
                        logprobs=np.minimum(logprobs, 0.0), loss_mask=loss_mask,
                        versions=np.where(loss_mask > 0, version, -1).astype(np.int32),
                        reward=float(rng.integers(0, 2)), prompt_len=len(prompt),
                        metadata={"temperature": 1.0, "finish_reason": "stop"}))
                client.push(instance, task.task_id, samples)
        client.close()
    except Exception as exc:  # surfaced by the test
        errors.append(exc)


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
