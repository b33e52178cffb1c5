"""The managed training runtime: pure PyTorch, no IPython, no Jupyter."""

from gpunb.runtime.result import TrainResult
from gpunb.runtime.trainer import Trainer

__all__ = ["Trainer", "TrainResult"]
