"""Ready-made callbacks: early stopping and a plain-text progress line."""

from __future__ import annotations

import math
import sys
import time

from gpunb.units import format_duration


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


class ProgressPrinter:
    """One line per log interval (terminal IPython, scripts); rewritten in place on a TTY."""

    def __init__(self, stream=None, min_interval_s: float = 0.5):
        self.stream = stream or sys.stdout
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._tty = getattr(self.stream, "isatty", lambda: False)()

    def on_log(self, state, metrics) -> None:
        now = time.monotonic()
        if now - self._last < self.min_interval_s:
            return
        self._last = now
        self._write(progress_line(state))

    def on_epoch_end(self, state, metrics) -> None:
        values = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()
                           if isinstance(v, float))
        self._write(f"epoch {state.epoch + 1}: {values}", final=True)

    def on_fit_end(self, state) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def _write(self, line: str, final: bool = False) -> None:
        if self._tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def progress_line(state) -> str:
    """`step 120/450 (27%)  epoch 1/3  loss 0.412  3,210 samples/s  elapsed 4s  ETA 12s`"""
    return "  ".join(progress_parts(state, with_loss=True))


def progress_parts(state, with_loss: bool) -> list[str]:
    """The pieces of a progress line: step, epoch, (loss), throughput, elapsed time, ETA."""
    latest = state.latest
    total = f"/{state.total_steps}" if state.total_steps else ""
    percent = f" ({100 * state.progress:.0f}%)" if state.progress is not None else ""
    parts = [f"step {state.step}{total}{percent}",
             f"epoch {state.epoch + 1}{epochs_suffix(state)}"]
    if with_loss and "loss" in latest:
        parts.append(f"loss {latest['loss']:.4g}")
    if latest.get("samples_per_s"):
        parts.append(f"{latest['samples_per_s']:,.0f} samples/s")
    parts.append(f"elapsed {format_duration(time.time() - state.started_at)}")
    eta = eta_seconds(state)
    if eta is not None:
        parts.append(f"ETA {format_duration(eta)}")
    return parts


def epochs_suffix(state) -> str:
    """"/3" when the run has a set number of epochs; nothing when max_steps decides."""
    return f"/{state.config.epochs}" if state.config.epochs else ""


def eta_seconds(state) -> float | None:
    if not state.total_steps or not state.step or "step_time_ms" not in state.latest:
        return None
    return (state.total_steps - state.step) * state.latest["step_time_ms"] / 1000
