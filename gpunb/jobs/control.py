"""In the job: the requests that end a run early, read at step boundaries.

- a stop: the job folder's `stop` file, which holds who asked, in words (`request_stop`: the
  kernel's interrupt button, `gpunb.stop`, the sidebar's Stop); the sidebar's Stop also goes
  through the run registry, which the job's RunRecorder reads. Either way the run stops at the
  next step, writes a checkpoint and sends its weights back.
- preemption or the time limit: the scheduler's warning signal (its backend's `requeue_signals`:
  Slurm's `--signal=USR2@90`, or a `scancel --signal=USR1`) reaches every task. The handler only sets a flag (a signal
  handler must not write checkpoints in the middle of a collective); the next step stops
  the run with reason "preempted", the checkpoint is written, and entry.py requeues the job.

Per step this costs an attribute read and a clock read; the file is looked at every
STOP_POLL_S.
"""

from __future__ import annotations

import os
import signal
import time

STOP_POLL_S = 0.5  # the stop file is looked for this often (a stat on a shared file system is not free)
PREEMPTED = "preempted"
DEFAULT_STOP = "stopped from the notebook"


class JobControl:
    """A callback on every rank: stop requests and preemption signals become `request_stop`."""

    def __init__(self, stop_path):
        self.stop_path = os.fspath(stop_path)
        self.preempted = False
        self._checked = 0.0

    def install_signal_handlers(self, signals) -> None:
        """Replace the scheduler's handlers for `signals` (submitit's would requeue at once, mid-step)
        with a flag."""
        for number in signals:
            signal.signal(number, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.preempted = True

    def on_step_end(self, state) -> None:
        if self.preempted:
            state.request_stop(PREEMPTED)
            return
        now = time.monotonic()
        if now - self._checked >= STOP_POLL_S:
            self._checked = now
            reason = stop_reason(self.stop_path)
            if reason is not None:
                state.request_stop(reason)


def request_stop(spec, reason: str) -> None:
    """Ask the job of `spec` to stop at its next step; `reason` is what its result and row will say."""
    temporary = spec.path / f".stop.{os.getpid()}"
    temporary.write_text(reason)
    os.replace(temporary, spec.stop_path)  # whole: the job never reads half a reason


def stop_reason(path) -> str | None:
    """The reason in a stop file (an empty one: the notebook's), None when there is none."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip() or DEFAULT_STOP
    except FileNotFoundError:
        return None
