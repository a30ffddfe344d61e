"""``astralight fit``: a LightningCLI over any LightningModule and DataModule named by import path.

The model and data are in subclass mode, so a config says
``model: {class_path: astralight.policy.M2POPolicy, init_args: {...}}`` and a user's own module
plugs in the same way. ``fit`` is implied: ``astralight fit --config trainer.yaml``.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI


def main(argv: list[str] | None = None) -> None:
    LightningCLI(
        model_class=pl.LightningModule,
        datamodule_class=pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=["fit", *(argv or [])],
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
    )


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
