"""Lightning DataModules; importable as ``astralight.datamodules``."""

from .rollout import PendingPull, RolloutDataModule, RolloutStream, collate_batch

__all__ = ["RolloutDataModule", "RolloutStream", "PendingPull", "collate_batch"]
