"""The managed training runtime: pure PyTorch, no IPython, no Jupyter.

`run(config, context, model, ...)` trains in this process; gpunb.Trainer (the front
door, one layer up) picks the context and the default callbacks and calls it.
"""

from gpunb.runtime.context import LocalContext
from gpunb.runtime.loop import run
from gpunb.runtime.result import TrainResult

__all__ = ["LocalContext", "TrainResult", "run"]
