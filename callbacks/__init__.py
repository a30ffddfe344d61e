"""Lightning callbacks; importable as ``astralight.callbacks``."""

from .weight_publisher import WeightPublisher, tensor_sha256

__all__ = ["WeightPublisher", "tensor_sha256"]
