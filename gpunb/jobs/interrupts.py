"""The kernel's interrupt while a cell follows a job, told apart from a restart or a shutdown.

jupyter_client's restart_kernel() and shutdown_kernel() (JupyterLab's Restart and Shut Down)
interrupt the kernel first (SIGINT), then send a shutdown_request, which ipykernel's control
thread answers at once by setting the shell's `exit_now`; SIGTERM follows after half of
`shutdown_wait_time` (2.5 s by default) if the kernel has not left. So an interrupt is acted on
only GRACE_S after it came, and only if no shutdown came meanwhile: a shutdown, seen at any
time, ends the following at once and the job goes on. The first interrupt that stands then
asks the job to stop, a second one cancels it.

Outside IPython (a script's Ctrl-C) there is no shutdown to wait for, and the same grace holds.
"""

from __future__ import annotations

import sys
import time

from gpunb.runtime.interrupt import InterruptFlag

GRACE_S = 2.0  # a shutdown_request comes within milliseconds of its interrupt; SIGTERM after 2.5 s


class KernelInterrupts(InterruptFlag):
    """SIGINT while following a job, as times (the handler installed as InterruptFlag's); `due()`
    counts those past their grace."""

    def __init__(self, grace_s: float = GRACE_S):
        super().__init__()
        self.grace_s = grace_s
        self.times: list[float] = []

    def _handle(self, signum, frame) -> None:
        self.times.append(time.monotonic())  # only noted: a handler must not decide before the shutdown can show

    def due(self, now: float | None = None) -> int:
        """How many interrupts stand: all of them once the newest is past its grace (two presses
        close together are one double press: a cancel), with no shutdown of the kernel in sight."""
        if self.shutting_down() or not self.times:
            return 0
        now = time.monotonic() if now is None else now
        return len(self.times) if now - self.times[-1] >= self.grace_s else 0

    @staticmethod
    def shutting_down() -> bool:
        """The kernel got a shutdown_request (a restart or a shut down): ipykernel sets `exit_now`."""
        ipython = sys.modules.get("IPython")  # never imported here: a kernel has it already
        shell = ipython.get_ipython() if ipython is not None else None
        return bool(getattr(shell, "exit_now", False))
