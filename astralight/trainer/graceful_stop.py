"""SIGTERM ends ``astralight fit`` as if ``max_steps`` were reached: the last checkpoint is saved
and the last version published.

Why: Lightning's own SIGTERM handling raises ``SIGTERMException`` after the current batch, an
exception path: ``ModelCheckpoint`` saves nothing (unless ``save_on_exception``), the
WeightPublisher drops its queued publication, the DataflowMonitor never logs the final
evaluation. The launcher stops a run early (``stop.max_wall_s``, ``stop.target_accuracy``,
``stop.timeout_s``) by sending SIGTERM, and a scheduler (Slurm, Kubernetes) does the same before
it kills, so SIGTERM should be the polite stop.

:class:`GracefulStop` (a callback :func:`install` adds to every ``astralight fit`` trainer) takes
SIGTERM over once training starts (``on_train_start``, after Lightning registered its handlers)
and sets ``trainer.should_stop``: the step under way finishes, the fit ends normally, ``last``
is saved at that step (:meth:`GracefulStop.on_train_end`, for every ``ModelCheckpoint`` with
``save_last``: Lightning's own saves only at its ``every_n_train_steps``), and ``on_fit_end``
runs -- the WeightPublisher publishes the last version, the DataflowMonitor waits for its
evaluation. A second SIGTERM raises ``KeyboardInterrupt`` (Lightning's interrupted
shutdown) for a trainer stuck waiting for a batch. Lightning restores the previous handler when
the fit ends. Single-process trainers only: under a multi-process strategy Lightning's handling
stays (every rank must stop at the same step).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

log = logging.getLogger("astralight.trainer.graceful_stop")


class GracefulStop(pl.Callback):
    """SIGTERM -> ``trainer.should_stop`` (see the module docstring); ``requested`` says whether
    a stop was asked for."""

    def __init__(self):
        self.requested = False
        self._trainer: pl.Trainer | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size > 1 or threading.current_thread() is not threading.main_thread():
            return
        self._trainer = trainer
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt("second SIGTERM")
        self.requested = True
        log.warning("SIGTERM: finishing the current step, then saving the last checkpoint and "
                    "publishing the last version (a second SIGTERM stops at once)")
        if self._trainer is not None:
            self._trainer.should_stop = True


    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save ``last`` at the step the fit ended on, for every ``ModelCheckpoint`` with
        ``save_last`` that has not saved that step: Lightning's saves ``last`` only at its own
        ``every_n_train_steps``, so a fit stopped (or ``max_steps`` reached) between two of them
        would leave an older ``last.ckpt``, and a resume would train those steps again."""
        if trainer.global_step <= 0 or trainer.fast_dev_run:
            return
        for cb in trainer.checkpoint_callbacks:
            if not isinstance(cb, ModelCheckpoint) or not cb.save_last:
                continue
            if getattr(cb, "_last_global_step_saved", None) == trainer.global_step:
                continue
            cb._save_last_checkpoint(trainer, cb._monitor_candidates(trainer))
            log.info("saved the last checkpoint at step %d: %s", trainer.global_step,
                     cb.last_model_path)


def install(trainer: pl.Trainer) -> GracefulStop:
    """Add a :class:`GracefulStop` to ``trainer`` (unless it has one); returns it."""
    for cb in trainer.callbacks:
        if isinstance(cb, GracefulStop):
            return cb
    cb = GracefulStop()
    trainer.callbacks.append(cb)
    return cb


__all__ = ["GracefulStop", "install"]
