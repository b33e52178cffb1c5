"""WandbLogger: a Weights & Biases run, offline unless WANDB_MODE says otherwise."""

from __future__ import annotations

import os

from gpunb.loggers.base import Logger, final_metrics, flat_config, log_root, require

_EXIT_CODE = {"completed": 0, "stopped": 0, "interrupted": 130, "failed": 1}


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

    def start(self, state) -> None:
        import wandb

        directory = self.dir or log_root(state.config)
        os.makedirs(directory, exist_ok=True)
        mode = self.mode or (None if os.environ.get("WANDB_MODE") else "offline")
        options = dict(project=self.project, name=state.run_name, config=flat_config(state), dir=str(directory))
        options.update(self.init)
        if mode is not None:
            options["mode"] = mode
        self.run = wandb.init(**options)

    def write(self, step: int, metrics: dict, state) -> None:
        self.run.log(metrics, step=step)

    def finish(self, state, status: str) -> None:
        try:
            if state.result is not None:
                self.run.summary.update(final_metrics(state))
            self.run.summary["status"] = status
        finally:
            self.run.finish(exit_code=_EXIT_CODE[status])
