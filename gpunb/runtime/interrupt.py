"""Turn Ctrl-C / the kernel's stop button into a flag the loop reads at step boundaries.

A first SIGINT only sets the flag, so the step in progress finishes and the weights
stay consistent; a second one raises KeyboardInterrupt at once, as usual.
"""

from __future__ import annotations

import signal
import threading


class InterruptFlag:
    def __init__(self):
        self.raised = False
        self._previous = None

    def __enter__(self) -> "InterruptFlag":
        if threading.current_thread() is threading.main_thread():
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
