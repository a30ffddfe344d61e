"""A short CPU ``Trainer.fit`` of the policy on a fake dataflow client (:func:`fit`), and
:class:`FlushEachStep`, a callback that waits for each publication and records the trainer's
bf16 weights (:func:`bf16_bits`) at that step; shared by the WeightPublisher unit tests.

Shared here so that tests never import from one another (no test module imports from a
``test_*`` module; ``tests/unit/test_no_cross_test_imports.py`` checks it).
"""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import torch

from astralight.datamodules import RolloutDataModule
from astralight.policy import M2POPolicy
from astralight.weights import to_bf16_bits


def fit(model_dir, fake, callbacks, max_steps, policy=None, ckpt_path=None, logger=False, lr=1e-3):
    dm = RolloutDataModule("http://127.0.0.1:9", model_id="policy", batch_size=4)
    dm.client = fake
    policy = policy or M2POPolicy(str(model_dir), lr=lr)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, log_every_n_steps=1)
    fake.trainer = trainer
    trainer.fit(policy, datamodule=dm, ckpt_path=ckpt_path)
    return policy, trainer


def bf16_bits(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: to_bf16_bits(t.detach().to(torch.bfloat16)) for n, t in module.state_dict().items()}


class FlushEachStep(pl.Callback):
    """Waits for each publication (placed after the publisher) and records the trainer's bf16
    weights at that step, so every version is observable and comparable."""

    def __init__(self, publisher, weights=bf16_bits):
        self.publisher = publisher
        self.weights = weights
        self.at_step: dict[int, dict[str, np.ndarray]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert self.publisher.flush(timeout=60)
        self.at_step[trainer.global_step] = self.weights(pl_module.model)
