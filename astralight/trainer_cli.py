"""``astralight fit``: a LightningCLI over any LightningModule and DataModule named by import path.

The model and data are in subclass mode, so a config says
``model: {class_path: astralight.policy.M2POPolicy, init_args: {...}}`` and a user's own module
plugs in the same way. ``fit`` is implied: ``astralight fit --config trainer.yaml``.

Resume: ``astralight fit --config trainer.yaml --ckpt_path last`` (or a path) continues from a
Lightning checkpoint: the optimizer step (so the policy version the WeightPublisher numbers from),
the publisher's counters (its first publication after a resume is a full version; versions the
dataflow already holds are skipped, never published again), and the datamodule's counters. The
launcher passes ``--ckpt_path`` when it restarts a trainer or resumes a run.

Checkpoints are written atomically (:class:`astralight.checkpoint_io.AtomicCheckpointIO`: temp
file in the checkpoint folder, fsync, rename) unless the config chooses a checkpoint IO plugin.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

from astralight.checkpoint_io import install as install_atomic_checkpoints


class AstralightCLI(LightningCLI):
    """LightningCLI whose trainer writes checkpoints atomically (see the module docstring) and
    that checks the model's ``model_path`` before building anything."""

    def before_instantiate_classes(self) -> None:
        """A local ``model.init_args.model_path`` that does not exist is a usage error (exit 2
        naming the key), not a Hugging Face hub error from deep inside the model's build."""
        from astralight.hf_models import check_model_path

        config = self.config.get(self.subcommand) if self.subcommand else self.config
        model = config.get("model") if config is not None else None
        init_args = getattr(model, "init_args", None) if model is not None else None
        path = getattr(init_args, "model_path", None) if init_args is not None else None
        try:
            check_model_path(path, "model.init_args.model_path")
        except ValueError as exc:
            self.parser.error(str(exc))

    def instantiate_trainer(self, **kwargs) -> pl.Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        install_atomic_checkpoints(trainer)
        return trainer


#: Lightning warnings that never apply to ``astralight fit`` (message prefixes): the CLI is given
#: ``args`` on purpose (the ``fit`` subcommand is implied); the policies optimise manually and
#: checkpoint after the step (the checkpoint holds the post-step state, which is what resume
#: needs); Lightning's own pytree call on newer torch.
QUIET_WARNINGS = (
    "LightningCLI's args parameter is intended to run from within Python",
    "Using ModelCheckpoint with manual optimization and every_n_train_steps",
    "`isinstance(treespec, LeafSpec)` is deprecated",
)
#: Lightning info lines that are advertising, not information
QUIET_INFO = ("💡 Tip: For seamless cloud logging",)


def quiet_lightning_noise() -> None:
    """Silence what does not apply on every ``astralight fit`` (see :data:`QUIET_WARNINGS`,
    :data:`QUIET_INFO`); every other warning and line stays."""
    import logging
    import re
    import warnings

    for prefix in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(prefix))
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _keep_record not in logger.filters:
            logger.addFilter(_keep_record)


def _keep_record(record) -> bool:
    """Logging filter: False for the lines of :data:`QUIET_INFO`."""
    return not str(record.msg).startswith(QUIET_INFO)


def main(argv: list[str] | None = None) -> None:
    quiet_lightning_noise()
    AstralightCLI(
        model_class=pl.LightningModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=["fit", *(argv or [])],
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        # error tips name the command a user typed ("astralight fit --help"), not "cli.py"
        parser_kwargs={"prog": "astralight"},
    )


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
