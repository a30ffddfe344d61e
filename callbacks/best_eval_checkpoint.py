"""BestEvalCheckpoint: keep the trainer checkpoint of the best-evaluated version as ``best.ckpt``.

Lightning's ``ModelCheckpoint(monitor=...)`` saves the weights of the step at which a metric
improves. Here the metric comes late: the dataflow evaluates a published version while the
trainer goes on, so by the time version v's accuracy is known the weights have moved on, and a
checkpoint taken then would be labelled with another version's accuracy. So this callback decides
*when* in two steps, and ``trainer.save_checkpoint`` does *how*:

1. at the step that produces a version the dataflow will evaluate (a multiple of its
   ``eval.every``, read from ``/v1/info``), it saves ``version=V.ckpt`` in ``dirpath``;
2. every ``every_n_steps`` steps and at the end of fit it reads the eval results; for each saved
   version whose evaluation is complete it keeps the checkpoint as ``best.ckpt`` (with
   ``best.json``: version, avg@k) when it beats the best so far, and deletes it otherwise.

The fit's last version is evaluated at the end whatever ``eval.every`` says (the launcher's final
evaluation), so its checkpoint is saved too, and at the end of fit the callback asks for that
evaluation and waits for the pending ones, up to ``wait_final_eval_s``: in a run, the last
version is often the best. A saved version the dataflow never evaluates (a WeightPublisher that
fell behind publishes only its newest snapshot, so the version it skipped is never published) is
deleted once a later version has been scheduled for evaluation.

So the disk holds ``best.ckpt`` and the checkpoints still waiting for their evaluation. A run that
collapses (the launcher's run guard, ``guard.stop: true``) ends with its best version's
checkpoint kept, like Lightning's ``EarlyStopping`` with ``ModelCheckpoint``; ``astralight
export`` turns it into a model folder. Only rank 0 reads the results; every rank saves (a sharded
checkpoint needs all of them).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import lightning.pytorch as pl

from astralight.atomic_files import atomic_write_bytes
from astralight.dataflow.client import LazyDataflowClient

from .final_eval import request_final_eval

log = logging.getLogger(__name__)

#: the files this callback writes in ``dirpath``
BEST, BEST_INFO = "best.ckpt", "best.json"


def pending_name(version: int) -> str:
    return f"version={int(version)}.ckpt"


class BestEvalCheckpoint(LazyDataflowClient, pl.Callback):
    """Keeps ``best.ckpt``, the checkpoint of the best-evaluated version (module docstring).

    Args:
        dirpath: folder of ``best.ckpt``, ``best.json`` and the pending ``version=V.ckpt``.
        dataflow_url: the dataflow service (default: the datamodule's ``dataflow_url``).
        model_id: the policy (default: the module's ``model_id``).
        every_n_steps: read the eval results every this many optimizer steps.
        eval_every: versions between evaluations (default: the dataflow's ``eval.every``).
        wait_final_eval_s: at the end of fit, wait up to this long for the pending evaluations
            (the last version's included) before settling them (0: settle what is known).
        token: bearer token (default: env ``ASTRALIGHT_TOKEN``).
    """

    def __init__(self, dirpath: str, dataflow_url: str | None = None,
                 model_id: str | None = None, every_n_steps: int = 5,
                 eval_every: int | None = None, wait_final_eval_s: float = 120.0,
                 token: str | None = None):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps: must be >= 1, got {every_n_steps}")
        if eval_every is not None and eval_every < 1:
            raise ValueError(f"eval_every: versions, must be >= 1 (or unset: the dataflow's "
                             f"eval.every), got {eval_every}")
        if wait_final_eval_s < 0:
            raise ValueError(f"wait_final_eval_s: seconds, must be >= 0, got {wait_final_eval_s}")
        self.wait_final_eval_s = float(wait_final_eval_s)
        self.dirpath = Path(dirpath)
        self.dataflow_url, self.model_id, self.token = dataflow_url, model_id, token
        self.every_n_steps, self.eval_every = every_n_steps, eval_every
        self.steps_per_version = 1
        self.pending: set[int] = set()
        self.best: dict | None = None  # {"version": v, "avg_at_k": a}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from .weight_publisher import WeightPublisher

        dm = getattr(trainer, "datamodule", None)
        self.dataflow_url = self.dataflow_url or getattr(dm, "dataflow_url", None)
        self.model_id = self.model_id or getattr(pl_module, "model_id", None) or "policy"
        pubs = [c for c in trainer.callbacks if isinstance(c, WeightPublisher)]
        if not pubs:
            raise ValueError("BestEvalCheckpoint needs a WeightPublisher among the trainer's "
                             "callbacks: it numbers the versions the dataflow evaluates")
        self.steps_per_version = pubs[0].every_n_steps
        self.dirpath.mkdir(parents=True, exist_ok=True)
        info = self.dirpath / BEST_INFO
        if info.is_file():  # a resumed fit keeps the best of the launches before
            self.best = json.loads(info.read_text())
        self.pending = {int(p.name[len("version="):-len(".ckpt")])
                        for p in self.dirpath.glob("version=*.ckpt")}

    def _eval_every(self) -> int | None:
        """``eval_every``, else the dataflow's ``eval.every`` (asked until it answers); None
        while unknown or when the dataflow evaluates nothing."""
        if self.eval_every is None:
            try:
                info = self.client.info().get("eval") or {}
            except Exception as exc:  # noqa: BLE001 - asked again at the next version
                log.warning("BestEvalCheckpoint: the dataflow's eval.every not read (%s)", exc)
                return None
            if not info.get("enabled"):
                return None
            self.eval_every = int(info.get("every") or 0) or None
        return self.eval_every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.steps_per_version == 0:
            version = step // self.steps_per_version
            every = self._eval_every()
            if every is not None and version % every == 0:
                trainer.save_checkpoint(self.dirpath / pending_name(version))
                self.pending.add(version)
        if step % self.every_n_steps == 0:
            self.settle(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        """Save the last version's checkpoint too: it is evaluated at the end of a run."""
        step = trainer.global_step
        version = step // self.steps_per_version
        if (step and step % self.steps_per_version == 0 and version not in self.pending
                and (self.best or {}).get("version") != version
                and self._eval_every() is not None):
            trainer.save_checkpoint(self.dirpath / pending_name(version))
            self.pending.add(version)

    def on_fit_end(self, trainer, pl_module) -> None:
        """Ask for the last version's evaluation, wait up to ``wait_final_eval_s`` for the
        pending ones, and settle them."""
        if trainer.global_rank != 0:
            return
        last = trainer.global_step // self.steps_per_version
        deadline = time.monotonic() + self.wait_final_eval_s
        asked = last not in self.pending
        while True:
            self.settle(trainer)
            if not self.pending or time.monotonic() >= deadline:
                break
            if not asked:
                asked = request_final_eval(self.client, self.model_id, last,
                                           "BestEvalCheckpoint") is not False
            time.sleep(1.0)
        if self.pending:
            log.warning("BestEvalCheckpoint: the evaluation of version(s) %s did not complete "
                        "within wait_final_eval_s=%g s; their checkpoints are left in %s",
                        sorted(self.pending), self.wait_final_eval_s, self.dirpath)

    def settle(self, trainer: pl.Trainer) -> None:
        """Keep or delete every pending checkpoint whose version's evaluation is complete."""
        if trainer.global_rank != 0 or not self.pending:
            return
        try:
            evals = self.client.eval_results(self.model_id)
        except Exception as exc:  # noqa: BLE001 - the next look tries again
            log.warning("BestEvalCheckpoint: eval results not read (%s)", exc)
            return
        newest = max(map(int, evals), default=-1)  # the newest version scheduled for eval
        for version in sorted(self.pending):
            result = evals.get(version)
            if result is None and newest > version:
                # never published (the publisher skipped it), so never evaluated
                self.pending.discard(version)
                (self.dirpath / pending_name(version)).unlink(missing_ok=True)
                log.info("BestEvalCheckpoint: version %d was not evaluated (a later one was; "
                         "the publisher skipped it): its checkpoint deleted", version)
                continue
            if not result or not result.get("complete"):
                continue
            self.pending.discard(version)
            path = self.dirpath / pending_name(version)
            accuracy = float(result.get("avg_at_k") or 0.0)
            if self.best is None or accuracy > float(self.best["avg_at_k"]):
                os.replace(path, self.dirpath / BEST)
                self.best = {"version": version, "avg_at_k": accuracy}
                atomic_write_bytes(self.dirpath / BEST_INFO, json.dumps(self.best).encode())
            else:
                path.unlink(missing_ok=True)
