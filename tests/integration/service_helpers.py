"""Helpers for the integration tests against the real dataflow service over HTTP: a group of
samples for a task (:func:`make_samples`), a published one-file full version
(:func:`publish_version`), a model's stats (:func:`model_stats`), and :func:`fake_raas`, a thread
body that plays the RaaS (register, lease, push samples scored by the tiny model at its initial
weights) until told to stop.

Shared here so that tests never import from one another (no test module imports from a
``test_*`` module; ``tests/unit/test_no_cross_test_imports.py`` checks it).
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import torch

from astralight.dataflow.client import DataflowClient
from astralight.protocol import Sample, WeightManifest
from astralight.rl.logprobs import causal_lm_logprobs


def make_samples(task, rewards, version: int = 0, model_id: str = "policy",
                 gen_versions: list[int] | None = None) -> list[Sample]:
    """A group of samples for ``task``: 3 prompt tokens then generated tokens of ``version``."""
    out = []
    for i, r in enumerate(rewards):
        gen = gen_versions or [version] * (3 + i)
        T = 3 + len(gen)
        out.append(Sample(task_id=task.task_id, sample_index=i, model_id=model_id,
                          token_ids=np.arange(10 * i, 10 * i + T, dtype=np.int32),
                          logprobs=np.array([0, 0, 0] + [-0.125 * (j + 1) for j in range(len(gen))],
                                            np.float32),
                          loss_mask=np.array([0, 0, 0] + [1] * len(gen), np.uint8),
                          versions=np.array([-1, -1, -1] + gen, np.int32),
                          reward=float(r), prompt_len=3, metadata={"finish_reason": "stop"}))
    return out


def publish_version(client: DataflowClient, version: int, payload: bytes | None = None,
                    model_id: str = "policy") -> WeightManifest:
    data = payload or f"weights v{version}".encode()
    client.upload_weight_file(model_id, version, "model.safetensors", data)
    manifest = WeightManifest(model_id=model_id, version=version, kind="full",
                              files={"model.safetensors": {"sha256": hashlib.sha256(data).hexdigest(),
                                                           "bytes": len(data)}})
    client.publish(manifest)
    return manifest


def model_stats(client: DataflowClient, model_id: str = "policy") -> dict:
    return client.stats()["models"][model_id]


def fake_raas(url: str, model_dir, stop: threading.Event, errors: list) -> None:
    from astralight.trainer.hf_models import causal_lm_from_pretrained
    from astralight.trainer.tinymodel import build_tokenizer

    try:
        tok = build_tokenizer()
        # this thread loads while the test's Trainer.fit loads the policy: both under the lock
        # (overlapping from_pretrained calls can switch transformers' weight tying off for the
        # whole process, see astralight.trainer.hf_models)
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
