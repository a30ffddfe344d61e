"""Lightning callbacks; importable as ``astralight.callbacks``."""

from .best_eval_checkpoint import BestEvalCheckpoint
from .dataflow_monitor import DataflowMonitor
from .weight_publisher import WeightPublisher, tensor_sha256

__all__ = ["BestEvalCheckpoint", "DataflowMonitor", "WeightPublisher", "tensor_sha256"]
