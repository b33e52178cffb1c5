"""`runs()` and `compare()`: the registry as a notebook table and overlaid metric curves.

Both return small objects with `_repr_html_` (the curves are an inline SVG from
gpunb.charts, so no plotting library is needed) and a plain-text `__repr__` that depends
only on the stored data, so it is stable under nbval.
"""

from __future__ import annotations

import html
import time

from gpunb.charts import line_chart
from gpunb.errors import GpunbError
from gpunb.runs.registry import Registry

_COLUMNS = ("name", "status", "started", "duration", "steps", "last loss", "device")
_STATUS_COLOURS = {"running": "#1f77b4", "completed": "#2ca02c", "stopped": "#ff7f0e",
                   "interrupted": "#ff7f0e", "failed": "#d62728"}


def runs(limit: int = 20, *, registry: Registry | None = None) -> RunTable:
    """The newest `limit` recorded runs as a table (name, status, started, duration, steps, last loss, device)."""
    return RunTable((registry or Registry()).list_runs(limit))


def compare(*names_or_ids: str, metric: str = "loss", registry: Registry | None = None) -> RunComparison:
    """Overlay `metric` against step for the given runs (by name, newest first, or by id)."""
    registry = registry or Registry()
    if not names_or_ids:
        raise GpunbError("compare() needs at least one run name or id.",
                         "pass names, e.g. `gpunb.runs.compare('baseline', 'bigger-lr')`; "
                         "`gpunb.runs.runs()` lists the recorded runs.")
    return RunComparison([_resolve(registry, key) for key in names_or_ids], metric)


def _resolve(registry: Registry, key: str) -> dict:
    run = registry.get_run(key)
    if run is None:
        for candidate in registry.list_runs(limit=10_000):
            if candidate["name"] == key or (len(key) >= 6 and candidate["id"].startswith(key)):
                run = registry.get_run(candidate["id"])
                break
    if run is None:
        raise GpunbError(f"No run named {key!r} (or with that id) in the run registry at {registry.path}.",
                         "`gpunb.runs.runs()` lists the recorded runs; names are the `name=` of each fit.")
    return run


class RunTable:
    """A list of run dicts that shows itself as a table."""

    def __init__(self, runs: list[dict]):
        self.runs = runs

    def __len__(self) -> int:
        return len(self.runs)

    def __getitem__(self, index: int) -> dict:
        return self.runs[index]

    def rows(self) -> list[tuple[str, ...]]:
        return [(run["name"] or "", run["status"], _clock(run["started_at"]), _duration(run),
                 _steps(run), _number(run["latest"].get("loss")), run["device"] or "-")
                for run in self.runs]

    def __repr__(self) -> str:
        if not self.runs:
            return "No runs recorded yet."
        return _text_table(_COLUMNS, self.rows())

    def _repr_html_(self) -> str:
        if not self.runs:
            return "<p>No runs recorded yet.</p>"
        head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in _COLUMNS)
        body = []
        for run, row in zip(self.runs, self.rows()):
            cells = [html.escape(cell) for cell in row]
            colour = _STATUS_COLOURS.get(run["status"], "inherit")
            cells[1] = f"<span style='color:{colour};font-weight:600'>{cells[1]}</span>"
            title = html.escape(run["error"] or run["id"], quote=True)
            body.append(f"<tr title='{title}'>" + "".join(f"<td style='text-align:left'>{c}</td>"
                                                          for c in cells) + "</tr>")
        return (f"<table class='gpunb-runs'><thead><tr>{head}</tr></thead>"
                f"<tbody>{''.join(body)}</tbody></table>")


class RunComparison:
    """`metric` against step for several runs: an SVG chart in the notebook, a summary as text."""

    def __init__(self, runs: list[dict], metric: str = "loss"):
        self.metric = metric
        self.runs = runs
        self.series = [[(point["step"], float(point[metric])) for point in run.get("history", [])
                        if isinstance(point.get(metric), (int, float)) and point.get("step") is not None]
                       for run in runs]

    def __repr__(self) -> str:
        rows = []
        for run, points in zip(self.runs, self.series):
            values = [value for _, value in points]
            if values:
                rows.append((run["name"] or run["id"], str(len(values)), _number(values[0]),
                             _number(min(values)), _number(max(values)), _number(values[-1]),
                             f"{points[0][0]}-{points[-1][0]}"))
            else:
                rows.append((run["name"] or run["id"], "0", "-", "-", "-", "-", "-"))
        return f"{self.metric} by step\n" + _text_table(
            ("run", "points", "first", "min", "max", "final", "steps"), rows)

    def _repr_html_(self) -> str:
        return line_chart(self.metric, [run["name"] or run["id"] for run in self.runs], self.series)


# ---------------------------------------------------------------------- formatting
def _text_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [header, tuple("-" * width for width in widths), *rows]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in lines)


def _clock(timestamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp)) if timestamp else "-"


def _duration(run: dict) -> str:
    # Until a run ends, its last write stands in for "now", so the text depends only on the data.
    end = run["ended_at"] or run["updated_at"]
    if not end or not run["started_at"]:
        return "-"
    seconds = max(0.0, end - run["started_at"])
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {seconds:02d}s"


def _steps(run: dict) -> str:
    step = run["step"] or 0
    if run["status"] == "running" and run["total_steps"]:
        return f"{step:,}/{run['total_steps']:,}"
    return f"{step:,}"


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"
