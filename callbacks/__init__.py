"""Lightning callbacks; importable as ``astralight.callbacks``."""

from .dataflow_monitor import DataflowMonitor
from .weight_publisher import WeightPublisher, tensor_sha256

__all__ = ["DataflowMonitor", "WeightPublisher", "tensor_sha256"]
