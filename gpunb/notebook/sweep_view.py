"""The live view of a sweep in its cell: the trials' table, their curves overlaid, the objective
against each parameter, re-sent through one display handle as trials validate and end.

Every notebook front end applies `update_display_data` (nbconvert and nbclient too), and the
charts are images, so what the notebook keeps renders when it is reopened untrusted. Without
a kernel (terminal IPython) there is nothing to re-send: the trials' lines are the view.
"""

from __future__ import annotations

import time

UPDATE_EVERY_S = 1.0  # the view is re-sent at most this often while a trial trains


class SweepView:
    """A callback of every trial's fit (the sweep sets `trial` to the running trial's row)."""

    def __init__(self, trials: int, monitor: str, direction: str):
        from IPython.display import HTML, display

        self.trials, self.monitor, self.direction = trials, monitor, direction
        self.rows: list = []  # the trials that ended
        self.trial = None  # the running trial's row
        self._shown = 0.0
        self.handle = display(HTML(f"<b>sweep: {trials} trials, starting</b>"), display_id=True)

    def on_step_end(self, state) -> None:
        if time.monotonic() - self._shown >= UPDATE_EVERY_S:
            self.show(state.step, state.total_steps)

    def on_validation_end(self, state, metrics) -> None:
        self.show(state.step, state.total_steps)

    def ended(self, row) -> None:
        self.rows.append(row)
        self.trial = None
        self.show()

    def show(self, step: int | None = None, total: int | None = None) -> None:
        from IPython.display import HTML

        from gpunb.sweeps.result import SweepResult, sweep_html

        running = [self.trial] if self.trial is not None and self.trial.state == "running" else []
        sweep = SweepResult("", "", self.monitor, self.direction, self.rows + running)
        done = [row for row in self.rows if row.value is not None]
        if done:
            best = (min if self.direction == "minimize" else max)(done, key=lambda row: row.value)
            sweep.best_trial = best.number
        header = f"sweep: {len(self.rows)} of {self.trials} trials ended"
        if running:
            header += f"; trial {running[0].number} running" + (f", step {step}" if step is not None else "") + (
                f" of {total}" if total else "")
        self.handle.update(HTML(sweep_html(sweep, header)))
        self._shown = time.monotonic()

    def close(self, sweep) -> None:
        """The finished sweep in place of the live view (its text for front ends without HTML)."""
        self.handle.update(sweep)
