"""Turn Ctrl-C / the kernel's stop button into a flag the loop reads at step boundaries.

A first SIGINT only sets the flag, so the step in progress finishes and the weights
stay consistent; a second one raises KeyboardInterrupt at once, as usual.

A process that ignores SIGINT (started in the background by a shell, or under `nohup`)
goes on ignoring it: Ctrl-C was never meant to reach it, and the flag stays down.
"""

from __future__ import annotations

import signal
import threading


class InterruptFlag:
    def __init__(self):
        self.raised = False
        self._previous = None

    def __enter__(self) -> "InterruptFlag":
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.raised:
            raise KeyboardInterrupt
        self.raised = True
