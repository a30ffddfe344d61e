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


def main(argv: list[str] | None = None) -> None:
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
