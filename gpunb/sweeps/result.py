"""SweepResult: the trials of a sweep as a table, the study, and the best trial.

Shown as text (deterministic: no clock readings) or as HTML with the trials' monitored
curves overlaid and the objective against each parameter, drawn as images so a reopened,
untrusted notebook still shows them.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from gpunb.charts import as_image, line_chart
from gpunb.render import fmt, html_table


@dataclass
class SweepResult:
    name: str
    folder: str
    monitor: str
    direction: str  # "minimize" or "maximize"
    rows: list = field(default_factory=list)  # TrialRow per trial, in the order they ran
    study: object = field(default=None, repr=False)  # the Optuna study, for its own plots
    best_trial: int | None = None  # the best completed trial's number
    best_result: object = field(default=None, repr=False)  # its TrainResult
    best_model: object = field(default=None, repr=False)  # its model, trained (build(trial)'s "model")

    @property
    def best_value(self) -> float | None:
        row = self._best_row()
        return None if row is None else row.value

    @property
    def best_params(self) -> dict:
        row = self._best_row()
        return {} if row is None else dict(row.params)

    @property
    def table(self):
        """One row per trial (trial, state, value, each parameter, pruned_at, steps, run, error):
        a pandas DataFrame where pandas is installed, else a list of dicts."""
        records = [self._record(row) for row in self.rows]
        try:
            import pandas
        except ImportError:
            return records
        return pandas.DataFrame.from_records(records, columns=self._columns())

    def counts(self) -> dict:
        counted: dict = {}
        for row in self.rows:
            counted[row.state] = counted.get(row.state, 0) + 1
        return counted

    def __repr__(self) -> str:
        return sweep_text(self)

    def _repr_html_(self) -> str:
        return sweep_html(self)

    def _best_row(self):
        return next((row for row in self.rows if row.number == self.best_trial), None)

    @property
    def param_names(self) -> list[str]:
        """Every parameter any trial was given, in the order they were first asked for."""
        return list(dict.fromkeys(name for row in self.rows for name in row.params))

    def _columns(self) -> list[str]:
        return ["trial", "state", "value", *self.param_names, "pruned_at", "steps", "run", "error"]

    @staticmethod
    def _record(row) -> dict:
        return {"trial": row.number, "state": row.state, "value": row.value, **row.params,
                "pruned_at": row.pruned_at, "steps": row.steps, "run": row.run_name, "error": row.error}


def sweep_text(s: SweepResult) -> str:
    counts = ", ".join(f"{n} {state}" for state, n in sorted(s.counts().items()))
    head = f"SweepResult({s.name!r}: {len(s.rows)} trials ({counts}); {s.direction} {s.monitor}"
    if s.best_trial is None:
        return head + "; no trial completed)"
    params = ", ".join(f"{k}={fmt(v)}" for k, v in s.best_params.items())
    return head + f"; best: trial {s.best_trial}, {s.monitor}={fmt(s.best_value)}, {params})"


def sweep_html(s: SweepResult, header: str | None = None) -> str:
    """The sweep's table and charts under `header` (default: its text)."""
    return (f"<div><b>{html.escape(header or sweep_text(s))}</b>{trials_html(s)}"
            f"{as_image(curves_chart(s), f'{s.monitor} of each trial')}"
            + "".join(as_image(objective_chart(s, name), f"{s.monitor} against {name}")
                      for name in s.param_names) + "</div>")


def trials_html(s: SweepResult) -> str:
    names = s.param_names
    rows = [(("★ " if row.number == s.best_trial else "") + str(row.number), row.state, fmt(row.value)
             if row.value is not None else "", *(fmt(row.params.get(n, "")) for n in names),
             "" if row.pruned_at is None else row.pruned_at, row.steps, row.error or "") for row in s.rows]
    return html_table(rows, ["trial", "state", s.monitor, *names, "pruned at", "steps", "error"])


def curves_chart(s: SweepResult) -> str:
    """Every trial's monitored value at its validations, overlaid."""
    shown = [row for row in s.rows if row.curve]
    return line_chart(s.monitor, [f"trial {row.number} ({row.state})" for row in shown],
                      [row.curve for row in shown], empty="for these trials")


def objective_chart(s: SweepResult, name: str) -> str:
    """The objective of each completed trial against one parameter (a dot per trial)."""
    done = [row for row in s.rows if row.value is not None and isinstance(row.params.get(name), (int, float))]
    return line_chart(s.monitor, [f"trial {row.number}" for row in done],
                      [[(float(row.params[name]), row.value)] for row in done], x_label=name,
                      integer_x=False, empty="for completed trials", width=360, height=220, legend=110)
