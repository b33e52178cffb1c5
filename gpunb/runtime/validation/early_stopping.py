"""Ready-made callbacks: early stopping (the terminal progress line is gpunb.render.ProgressPrinter)."""

from __future__ import annotations

from gpunb.runtime.validation.monitor import Monitor


class EarlyStopping:
    """Stop when `monitor` has not improved by `min_delta` for `patience` validations.

    Validations happen at epoch ends, or every `val_every_steps` steps when that is set.
    `mode` None chooses by the name, as best checkpoints do ("max" for acc, f1, ...).
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 3, mode: str | None = None,
                 min_delta: float = 0.0):
        self.judge = Monitor(monitor, mode)
        self.monitor, self.mode = self.judge.name, self.judge.mode
        self.patience, self.min_delta = patience, min_delta
        self.best = self.judge.worst
        self.bad_epochs = 0  # validations without improvement

    def on_fit_start(self, state) -> None:
        """A metric validation never produces would never stop the run: say so before training."""
        self.judge.check_produced(state.val_names, "EarlyStopping")

    def on_validation_end(self, state, metrics) -> None:
        if self.monitor not in metrics:
            return
        value = metrics[self.monitor]
        if self.judge.better(value, self.best, self.min_delta):
            self.best, self.bad_epochs = value, 0
            return
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            state.request_stop(f"early stopping: {self.monitor} did not improve for "
                               f"{self.patience} validations (best {self.best:.4g})")
