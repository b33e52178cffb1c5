"""Ready-made callbacks: early stopping (the terminal progress line is gpunb.render.ProgressPrinter)."""

from __future__ import annotations

import math


class EarlyStopping:
    """Stop when `monitor` has not improved by `min_delta` for `patience` validations."""

    def __init__(self, monitor: str = "val_loss", patience: int = 3, mode: str = "min",
                 min_delta: float = 0.0):
        if mode not in ("min", "max"):
            from gpunb.errors import GpunbError

            raise GpunbError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}.")
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.bad_epochs = 0

    def on_validation_end(self, state, metrics) -> None:
        if self.monitor not in metrics:
            return
        value = metrics[self.monitor]
        better = (value < self.best - self.min_delta if self.mode == "min"
                  else value > self.best + self.min_delta)
        if better:
            self.best, self.bad_epochs = value, 0
            return
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            state.request_stop(f"early stopping: {self.monitor} did not improve for "
                               f"{self.patience} validations (best {self.best:.4g})")
