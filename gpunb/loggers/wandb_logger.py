"""WandbLogger: a Weights & Biases run, offline unless WANDB_MODE says otherwise."""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from pathlib import Path

from gpunb.loggers.base import Logger, final_metrics, flat_config, log_root, require

_EXIT_CODE = {"completed": 0, "stopped": 0, "interrupted": 130, "failed": 1}
# W&B's own service process writes the run's .wandb file and flushes it on a timer (15 s by
# default), not on request: a kill loses what it holds. A 1 s timer bounds that loss to
# about a second (a log interval, unless intervals are shorter than that).
_FLUSH_S = 1.0
_MIN_FREE = 1 << 20  # bytes: below this the service's writes fail, and it says nothing of it


class WandbLogger(Logger):
    """The config, metrics by step, the final metrics in the run's summary, and `finish`
    with the run's exit code (0; 130 interrupted; 1 failed).

    `mode`: None is "offline" unless the WANDB_MODE environment variable is set (then W&B
    reads it); `wandb sync <dir>/wandb/offline-run-*` uploads an offline run later.
    `dir`: None is the log root (see TrainConfig.log_dir). Other keywords go to `wandb.init`.
    """

    def __init__(self, project: str = "gpunb", mode: str | None = None, dir: str | None = None, **init):
        require("wandb", "wandb")
        self.project, self.mode, self.dir, self.init = project, mode, dir, init
        self.run = None
        self.pending = None  # the step whose row W&B holds uncommitted

    def start(self, state) -> None:
        import wandb

        self.folder = self.directory(state.config, state)
        os.makedirs(self.folder, exist_ok=True)
        mode = self.mode or (None if os.environ.get("WANDB_MODE") else "offline")
        options = dict(project=self.project, name=state.run_name, config=flat_config(state), dir=str(self.folder))
        if "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {}):
            options["settings"] = wandb.Settings(x_transaction_log_flush_interval=_FLUSH_S)
        options.update(self.init)  # the user's settings win
        if mode is not None:
            options["mode"] = mode
        self.run = wandb.init(**options)
        run_dir = Path(self.run.dir).resolve()
        # W&B falls back to a temp dir when it cannot write where it is told: say so
        if self.run.settings.mode != "disabled" and self.folder.resolve() not in run_dir.parents:
            warnings.warn(f"WandbLogger: W&B writes this run in {run_dir}, not in {self.folder} as asked.",
                          RuntimeWarning, stacklevel=2)

    def write(self, step: int, metrics: dict, state) -> None:
        # W&B's service process does not report a write it could not make: look at the disk here.
        if self.run.settings.mode == "offline" and shutil.disk_usage(self.folder).free < _MIN_FREE:
            raise OSError(errno.ENOSPC, f"less than 1 MiB free where W&B's service writes the run ({self.folder}), "
                          "and it does not report the writes it cannot make")
        self.run.log(metrics, step=step, commit=False)  # the epoch's row may still join this step's row
        self.pending = step

    def on_step_end(self, state) -> None:
        """The step after a row: no other row joins it now. W&B commits a step's row only when a
        later step is logged, so a kill would lose it: commit it here (once per row)."""
        if self.pending is not None and self._active:
            self._observed(state, self._commit)

    def _commit(self) -> None:
        step, self.pending = self.pending, None
        self.run.log({}, step=step, commit=True)

    def finish(self, state, status: str) -> None:
        try:
            if state.result is not None:
                self.run.summary.update(final_metrics(state))
            self.run.summary["status"] = status
        finally:
            self.run.finish(exit_code=_EXIT_CODE[status])

    def directory(self, config, state=None) -> Path:
        return Path(self.dir) if self.dir else log_root(config, state)

    def destination(self) -> str:
        return str(getattr(self, "folder", None) or self.dir or "its W&B directory")

    def abandon(self) -> None:
        self.pending = None
        if self.run is not None:
            self.run.finish(exit_code=1)
