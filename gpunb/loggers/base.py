"""What every logger shares: the run's directory, which numbers a row holds, how a run ended.

A logger is a plain callback. It writes only on rank 0 (the notebook's side of a
multi-device run is rank 0 too) and hears, in order:

    on_fit_start     opens its run and records the config
    on_log           the log interval's row (loss, lr, samples_per_s, ...) at its step
    on_epoch_end     the epoch's row (train_loss, val_*, epoch) at the epoch's last step
    on_fit_end       the final metrics; closes the run (completed, stopped or interrupted)
    on_exception     closes the run as failed (or interrupted, for a KeyboardInterrupt)

A logger is an observer: a failure of its own (a full disk, a lost server) warns once,
naming the logger, the error and the fix, switches that logger off, and training goes on.
Only a logger that cannot start for a reason other than its file system (a wrong tracking
URI) raises, before the first step. Where it writes is checked before any work
(`check_destinations`), and each logger has its rows on disk at every log interval, so a
killed process loses at most the last interval.
"""

from __future__ import annotations

import importlib
import json
import math
import warnings
from pathlib import Path

from gpunb.errors import GpunbError
from gpunb.runtime.state.checkpoint_files import is_disk_full, probe_writable

LOG_DIR_KEY = "log_dir"  # state.extras: the fit's run directory, shared by its loggers
_NOT_METRICS = {"step", "steps", "epoch"}  # a log row's counters, not measurements
_EPOCH_ROW_SKIP = {"step", "elapsed_s"}  # elapsed_s is in the log rows already


def require(module: str, package: str):
    """Import an optional package, or say which `pip install` brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise GpunbError(f"This logger needs the `{package}` package, which is not installed ({error}).",
                         f"`pip install gpunb[loggers]` (or `pip install {package}`), then run the "
                         "cell again.") from None


def log_root(config, state=None) -> Path:
    """Where a fit's run directories go: log_dir, else <checkpoint_dir>/logs (the run's: a job's
    folder when the config names none), else ./gpunb_logs."""
    plan = getattr(state, "plan", None)
    checkpoint_dir = plan.checkpoint_dir if plan is not None else config.checkpoint_dir
    if config.log_dir:
        return Path(config.log_dir)
    if checkpoint_dir:
        return Path(checkpoint_dir) / "logs"
    return Path("gpunb_logs")


def run_dir(state) -> Path:
    """This fit's directory, `<root>/<run name>-<n>` with the first free n; the same for all its loggers."""
    if LOG_DIR_KEY not in state.extras:
        root = log_root(state.config, state)
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in state.run_name)
        number = 1
        while True:
            try:
                (root / f"{name}-{number}").mkdir(parents=True)  # the root too, whoever probed it before
                break
            except FileExistsError:
                number += 1
        state.extras[LOG_DIR_KEY] = str(root / f"{name}-{number}")
    return Path(state.extras[LOG_DIR_KEY])


def numbers(row: dict, skip=_NOT_METRICS) -> dict:
    """The finite numbers of a row, without its counters."""
    return {k: float(v) for k, v in row.items()
            if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def flat_config(state) -> dict:
    """The config as the run used it (RunState.settings), as one level of JSON-friendly values
    (a dict's entries as `<key>/<entry>`), plus the run's name."""
    flat = {"run_name": state.run_name, "world_size": state.world_size}
    for key, value in state.settings().items():
        if isinstance(value, dict):
            flat.update({f"{key}/{k}": _plain(v) for k, v in value.items()})
        else:
            flat[key] = _plain(value)
    return flat


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return json.dumps([_plain(v) for v in value])
    return str(value)


def final_metrics(state) -> dict:
    """The run's final metrics and counts, from state.result."""
    result = state.result
    return {**numbers(result.final_metrics), "steps": result.steps, "samples": result.samples}


def outcome(state=None, error: BaseException | None = None) -> str:
    """completed, stopped, interrupted or failed."""
    if error is not None:
        return "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
    return state.result.status


class Logger:
    """The events, with the rank-0 guard and the observer's rule; a logger defines start, write,
    finish, and may define `directory(config)` (checked before training) and `abandon()`."""

    def on_fit_start(self, state) -> None:
        self._active = False
        if state.rank == 0:
            try:
                self.start(state)
            except OSError as error:  # its file system, not its configuration: train without it
                self._switch_off(state, error)
                return
            self._active = True  # only a run that started is finished

    def on_log(self, state, row) -> None:
        if getattr(self, "_active", False):
            self._observed(state, self.write, row["step"], numbers(row), state)

    def on_epoch_end(self, state, row) -> None:
        if getattr(self, "_active", False):
            self._observed(state, self.write, row["step"], numbers(row, _EPOCH_ROW_SKIP), state)

    def on_fit_end(self, state) -> None:
        if getattr(self, "_active", False):
            self._active = False
            if state.result is not None and LOG_DIR_KEY in state.extras:
                state.result.log_dir = state.extras[LOG_DIR_KEY]
            self._observed(state, self.finish, state, outcome(state))

    def on_exception(self, state, error) -> None:
        if getattr(self, "_active", False):
            self._active = False
            self._observed(state, self.finish, state, outcome(error=error))  # never hides `error`

    def start(self, state) -> None:
        raise NotImplementedError

    def write(self, step: int, metrics: dict, state) -> None:
        raise NotImplementedError

    def finish(self, state, status: str) -> None:
        raise NotImplementedError

    def directory(self, config) -> Path | None:
        """The local directory this logger writes in (None: none, e.g. a tracking server)."""
        return None

    def destination(self) -> str:
        """Where this logger writes, for messages."""
        return "its destination"

    def abandon(self) -> None:
        """Let go of what a failed logger holds (open files); it writes nothing more."""

    def _observed(self, state, action, *args) -> None:
        try:
            action(*args)
        except Exception as error:  # noqa: BLE001 (any failure of an observer; KeyboardInterrupt passes)
            self._switch_off(state, error)

    def _switch_off(self, state, error: Exception) -> None:
        self._active = False
        warn_failed(self, state, error)
        try:
            self.abandon()
        except Exception:  # noqa: BLE001 (already reported; closing a broken writer may fail again)
            pass


class LocalLogger(Logger):
    """A logger whose files go into its `log_dir`, else the fit's run directory (`self.dir` once started)."""

    def directory(self, config) -> Path:
        return self.log_dir or log_root(config)

    def destination(self) -> str:
        return str(getattr(self, "dir", None) or self.log_dir or "its run directory")


def warn_failed(logger, state, error: Exception) -> None:
    """The one warning of a logger that failed: which, at which step, why, what is kept, the fix."""
    name = type(logger).__name__
    where = logger.destination()
    if is_disk_full(error) or is_disk_full(error.__cause__ or error.__context__):
        fix = "free space there, or pass a `log_dir` on a disk with room; the next run logs again"
        why = f"the disk is full ({type(error).__name__}: {error})"
    else:
        fix = f"check that {where} can be written, or leave {_short(name)} out of `loggers`"
        why = f"{type(error).__name__}: {error}"
    warnings.warn(f"{name} failed at step {state.step} and is switched off: {why}. Training goes on; what "
                  f"it wrote before step {state.step} is kept in {where}.\nHINT: {fix}.",
                  RuntimeWarning, stacklevel=2)


def _short(class_name: str) -> str:
    """The name `loggers=` knows a logger class by, or "this logger"."""
    short = class_name.removesuffix("Logger").lower()
    return f"`{short}`" if short in ("csv", "tensorboard", "mlflow", "wandb") else "this logger"


def check_destinations(loggers, config) -> None:
    """Every logger's directory can be created and written in, before any work is done."""
    for logger in loggers:
        where = getattr(logger, "directory", None)
        directory = where(config) if callable(where) else None  # a subclass may use the name for a path
        if directory is None:
            continue
        try:
            _probe(Path(directory))
        except OSError as error:
            raise GpunbError(f"{type(logger).__name__} cannot write its logs to {directory}: "
                             f"{type(error).__name__}: {error.strerror or error}.",
                             "pass a `log_dir` you can write to (one under your home directory, say; a logger "
                             "object takes its own `log_dir` or `dir`), or `loggers=()` to train without loggers."
                             ) from error


def _probe(directory: Path) -> None:
    """`directory` can be made and written in; the folders the probe made are removed again, so
    that a check alone leaves nothing behind (a job's kernel checks its loggers, which write in the
    job's folder: no empty ./gpunb_logs where the notebook runs)."""
    made = [folder for folder in (directory, *directory.parents) if not folder.exists()]  # deepest first
    try:
        probe_writable(directory)
    finally:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # something was written there meanwhile: it stays
                break
