"""Fakes for the trainer-side unit tests: a dataflow client that serves synthetic batches.

Behaviour log-probs come from the tiny model at its initial weights (teacher-forced at the given
temperature), so the first step is on-policy and later ones go progressively off-policy, as in a
real run. Group rewards are random 0/1; advantages are GRPO group-normalised like the dataflow's.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from astralight.protocol import Batch, Sample
from astralight.rl.advantages import group_normalized_advantages
from astralight.rl.logprobs import causal_lm_logprobs


class FakeDataflowClient:
    def __init__(self, model_dir, model_id: str = "policy", temperature: float = 1.0,
                 group_size: int = 2, seed: int = 0, logprob_noise: float = 0.0):
        from astralight.hf_models import causal_lm_from_pretrained

        self.model = causal_lm_from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model_id = model_id
        self.temperature = temperature
        self.group_size = group_size
        self.logprob_noise = logprob_noise
        self.rng = np.random.default_rng(seed)
        self.served: list[str] = []
        self.acks: list[tuple[str, int | None]] = []
        self.trainer = None  # set by a test to record the optimizer step at each ack
        self.closed = False
        # weight-store face
        self.lock = threading.Lock()
        self.uploads: list[tuple[int, str, bytes]] = []
        self.manifests = []
        self.version = 0

    # ------------------------------------------------------------------ trainer side

    def make_batch(self, size: int) -> Batch:
        samples = []
        n_groups = max(1, size // self.group_size)
        for g in range(n_groups):
            task_id = f"task-{len(self.served)}-{g}"
            rewards = self.rng.integers(0, 2, self.group_size).astype(float)
            for k in range(self.group_size):
                prompt_len = int(self.rng.integers(3, 6))
                gen_len = int(self.rng.integers(2, 7))
                prompt = self.rng.integers(3, 40, prompt_len)
                gen = np.append(self.rng.integers(3, 40, gen_len - 1), 1)  # ends with EOS
                ids = np.concatenate([[2], prompt, gen]).astype(np.int32)
                loss_mask = np.zeros(ids.shape[0], dtype=np.uint8)
                loss_mask[1 + prompt_len:] = 1
                with torch.no_grad():
                    lp = causal_lm_logprobs(self.model, torch.from_numpy(ids).long()[None],
                                            temperature=self.temperature)[0].numpy()
                logprobs = np.concatenate([[0.0], lp]).astype(np.float32)
                if self.logprob_noise:
                    logprobs = logprobs + self.rng.normal(0, self.logprob_noise,
                                                          logprobs.shape).astype(np.float32)
                logprobs = np.minimum(logprobs, 0.0) * loss_mask
                versions = np.where(loss_mask > 0, max(0, self.version - int(self.rng.integers(0, 3))),
                                    -1).astype(np.int32)
                samples.append(Sample(
                    task_id=task_id, sample_index=k, model_id=self.model_id, token_ids=ids,
                    logprobs=logprobs.astype(np.float32), loss_mask=loss_mask, versions=versions,
                    reward=float(rewards[k]), prompt_len=1 + prompt_len,
                    metadata={"temperature": self.temperature, "finish_reason": "stop"}))
        adv = group_normalized_advantages(torch.tensor([s.reward for s in samples]),
                                          [s.task_id for s in samples])
        for s, a in zip(samples, adv.tolist()):
            s.advantage = a
        batch = Batch(batch_id=f"batch-{len(self.served)}", model_id=self.model_id,
                      policy_version=self.version, samples=samples[:size])
        return batch

    def pull_batch(self, model_id, size, timeout_s=30.0, trainer_id=None):
        assert model_id == self.model_id
        batch = self.make_batch(size)
        self.served.append(batch.batch_id)
        return batch

    def ack(self, batch_id, wait_s=None, step_s=None, step=None):
        step = self.trainer.global_step if self.trainer is not None else None
        self.acks.append((batch_id, step))

    def close(self):
        self.closed = True

    # ------------------------------------------------------------------ weight store

    def current_version(self, model_id):
        return self.version

    def upload_weight_file(self, model_id, version, name, data):
        with self.lock:
            self.uploads.append((version, name, data))

    def publish(self, manifest):
        with self.lock:
            names = {(v, n) for v, n, _ in self.uploads}
            assert all((manifest.version, n) in names for n in manifest.files)
            self.manifests.append(manifest)
            self.version = max(self.version, manifest.version)
        return {"version": manifest.version}
