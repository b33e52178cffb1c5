"""The run's ETA: estimated once per log, in the runtime, and shown the same by every view.

The rate is steps over wall time across a window of recent logs: at least WINDOW_S and at
least one epoch, so that once an epoch has ended its validation pass counts in the rate,
and one slow or fast interval moves the estimate a little instead of doubling it. The
dashboard and the sidebar both count down from the newest estimate (`render.eta_left`).
"""

from __future__ import annotations

import time
from collections import deque

WINDOW_S = 30.0  # the shortest stretch of wall time the rate is measured over


class EtaClock:
    """Feeds on (step, elapsed seconds) at each log; says seconds left as (seconds, time.time())."""

    def __init__(self):
        self._points: deque = deque()  # (elapsed_s, step) of recent logs, oldest first
        self._epoch_s = 0.0  # wall time of the last whole epoch, once one has ended
        self._epoch_began = 0.0  # elapsed seconds are counted from the fit's start

    def at_log(self, step: int, elapsed_s: float, total_steps: int | None,
               interval_step_s: float) -> tuple[float, float] | None:
        """The estimate after a log at `step`; `interval_step_s`: the interval's time a step,
        the only measure there is at the first log."""
        if not total_steps:
            return None
        self._points.append((elapsed_s, step))
        window = max(WINDOW_S, self._epoch_s)
        while len(self._points) > 2 and elapsed_s - self._points[1][0] >= window:
            self._points.popleft()  # the oldest still leaves a window at least this long
        (t0, s0), (t1, s1) = self._points[0], self._points[-1]
        per_step = (t1 - t0) / (s1 - s0) if s1 > s0 else interval_step_s
        return max(0.0, (total_steps - step) * per_step), time.time()

    def at_epoch_end(self, elapsed_s: float) -> None:
        """An epoch (and its validation) ended: the window spans one epoch from now on."""
        self._epoch_s, self._epoch_began = elapsed_s - self._epoch_began, elapsed_s
