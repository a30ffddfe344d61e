"""SIGTERM during ``Trainer.fit``: with :class:`astralight.trainer.graceful_stop.GracefulStop` the fit ends
as at ``max_steps`` (the last checkpoint at the step it stopped, ``on_fit_end`` run); without it,
Lightning's own handling ends it on its exception path, with only the older periodic checkpoint.
A real Lightning trainer on a tiny model and a plain DataLoader (no dataflow)."""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from astralight.trainer.graceful_stop import GracefulStop, install


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SigtermAt(pl.Callback):
    """Sends this process SIGTERM at the end of optimizer step ``step``; records fit end."""

    def __init__(self, step: int):
        self.step = step
        self.fit_ended = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_fit_end(self, trainer, pl_module):
        self.fit_ended = True


def _trainer(tmp_path, callbacks, max_steps: int = 40) -> pl.Trainer:
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=5)
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ckpt, *callbacks])


def _data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(400, 4)), batch_size=2)


def test_sigterm_finishes_the_fit_with_a_last_checkpoint_at_that_step(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    probe = SigtermAt(7)
    trainer = _trainer(tmp_path, [probe])
    stop = install(trainer)
    assert install(trainer) is stop  # once per trainer
    trainer.fit(Tiny(), _data())  # returns: no exception path
    assert stop.requested and probe.fit_ended
    assert trainer.global_step == 7 and trainer.state.status == "finished"
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 7  # not the periodic step-5 one
    assert signal.getsignal(signal.SIGTERM) == previous  # Lightning restored the handler


def test_max_steps_between_two_checkpoint_steps_still_saves_the_last_step(tmp_path):
    trainer = _trainer(tmp_path, [], max_steps=7)
    install(trainer)
    trainer.fit(Tiny(), _data())
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 7


def test_without_it_lightning_stops_on_its_exception_path(tmp_path):
    """Why GracefulStop exists: the same SIGTERM under plain Lightning leaves step 5's checkpoint
    and never reaches on_fit_end (the WeightPublisher's last publication, the final eval)."""
    probe = SigtermAt(7)
    trainer = _trainer(tmp_path, [probe])
    with pytest.raises(SystemExit):
        trainer.fit(Tiny(), _data())
    assert not probe.fit_ended and trainer.state.status == "interrupted"
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 5


def test_a_second_sigterm_interrupts_at_once():
    stop = GracefulStop()
    stop._on_sigterm(signal.SIGTERM, None)
    assert stop.requested
    with pytest.raises(KeyboardInterrupt):
        stop._on_sigterm(signal.SIGTERM, None)
