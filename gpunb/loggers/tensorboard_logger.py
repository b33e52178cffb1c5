"""TensorBoardLogger: event files through torch.utils.tensorboard, and the profiler's trace."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from gpunb.loggers.base import LocalLogger, final_metrics, flat_config, require, run_dir

TRACE_KEY = "profile_trace"  # state.extras: the chrome trace a profiler wrote during the run


class TensorBoardLogger(LocalLogger):
    """Scalars by step (log rows and epoch rows), the config as text, and at the end the
    config with the final metrics on the HPARAMS tab (`hparam/<metric>`).

    A trace taken during the run (gpunb.profiling.ProfilerCallback) is copied to
    `<log_dir>/plugins/profile/<time>/<host>.pt.trace.json`, where the PyTorch profiler's
    TensorBoard plugin looks for it. View with `tensorboard --logdir gpunb_logs`.
    `log_dir`: the directory to write in; None: the fit's run directory.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None):
        require("tensorboard", "tensorboard")  # torch.utils.tensorboard needs it
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.writer = None

    def start(self, state) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = self.log_dir or run_dir(state)
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.config = flat_config(state)
        text = "\n".join(f"    {k}: {json.dumps(v)}" for k, v in self.config.items())  # indented: code block
        self.writer.add_text("config", text, 0)

    def write(self, step: int, metrics: dict, state) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        # The writer's thread appends each event soon after it is queued, but a file system
        # without append (S3, GCS) holds them until a flush, every 120 s by default: flush at each
        # row, so a killed process loses at most this interval, and a full disk is heard here.
        self.writer.flush()

    def abandon(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def finish(self, state, status: str) -> None:
        from torch.utils.tensorboard.summary import hparams

        try:
            self.writer.add_text("status", status, state.step)
            if state.result is not None:
                finals = {f"hparam/{k}": v for k, v in final_metrics(state).items()}
                hparam_values = {k: ("None" if v is None else v) for k, v in self.config.items()}
                for summary in hparams(hparam_values, finals):
                    self.writer.file_writer.add_summary(summary)
                for name, value in finals.items():
                    self.writer.add_scalar(name, value, state.step)
            trace = state.extras.get(TRACE_KEY)
            if trace and os.path.exists(trace):
                copy_trace(trace, self.dir)
        finally:
            self.writer.close()


def copy_trace(trace: str, log_dir: Path) -> Path:
    """The trace where the profiler plugin reads it: <log_dir>/plugins/profile/<run>/<host>.pt.trace.json."""
    folder = log_dir / "plugins" / "profile" / time.strftime("%Y_%m_%d_%H_%M_%S")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{socket.gethostname()}.pt.trace.json"
    shutil.copyfile(trace, target)
    return target
