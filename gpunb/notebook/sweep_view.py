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
    """A callback of every trial's fit, or of its job's relayed events (several run at once with
    --parallel: their curves grow side by side)."""

    def __init__(self, trials: int, monitor: str, direction: str):
        from IPython.display import HTML, display

        self.trials, self.monitor, self.direction = trials, monitor, direction
        self.rows: list = []  # the trials that ended
        self.running: dict = {}  # number -> row of each trial running (its curve grows as it validates)
        self._shown = 0.0
        self.handle = display(HTML(f"<b>sweep: {trials} trials, starting</b>"), display_id=True)

    def on_step_end(self, state) -> None:
        if time.monotonic() - self._shown >= UPDATE_EVERY_S:
            self.show(state.step, state.total_steps)

    def on_validation_end(self, state, metrics) -> None:
        self.show(state.step, state.total_steps)

    def trial_started(self, row) -> None:
        self.running[row.number] = row

    def ended(self, row) -> None:
        self.rows.append(row)
        self.running.pop(row.number, None)
        self.show()

    def show(self, step: int | None = None, total: int | None = None) -> None:
        from IPython.display import HTML

        from gpunb.sweeps.result import SweepResult, sweep_html

        running = [row for row in self.running.values() if row.state == "running"]
        sweep = SweepResult("", "", self.monitor, self.direction, self.rows + running)
        done = [row for row in self.rows if row.value is not None]
        if done:
            best = (min if self.direction == "minimize" else max)(done, key=lambda row: row.value)
            sweep.best_trial = best.number
        header = f"sweep: {len(self.rows)} of {self.trials} trials ended"
        if len(running) == 1:
            header += f"; trial {running[0].number} running" + (f", step {step}" if step is not None else "") + (
                f" of {total}" if total else "")
        elif running:  # the step heard last may be any of theirs: none is named
            header += "; trials " + ", ".join(str(row.number) for row in running) + " running"
        self.handle.update(HTML(sweep_html(sweep, header)))
        self._shown = time.monotonic()

    def close(self, sweep) -> None:
        """The finished sweep in place of the live view (its text for front ends without HTML)."""
        self.handle.update(sweep)
