"""`runs()`, `compare()`, `remove()`, `prune()`: the registry from a notebook.

Both return small objects with `_repr_html_` (the curves are an SVG image from
gpunb.charts, so no plotting library is needed) and a plain-text `__repr__` that depends
only on the stored data, so it is stable under nbval.
"""

from __future__ import annotations

import html
import socket
import time
import warnings

from gpunb.charts import as_image, line_chart
from gpunb.errors import GpunbError
from gpunb.render import html_table
from gpunb.runs.liveness import whereabouts
from gpunb.runs.registry import Registry
from gpunb.units import format_duration

_COLUMNS = ("name", "status", "started", "duration", "steps", "last loss", "device")
_STATUS_COLOURS = {"queued": "#7f7f7f", "cancelled": "#ff7f0e", "running": "#1f77b4", "completed": "#2ca02c", "stopped": "#ff7f0e",
                   "interrupted": "#ff7f0e", "failed": "#d62728", "lost": "#7f7f7f"}


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


def remove(*names_or_ids: str, registry: Registry | None = None) -> int:
    """Delete finished runs (by name, newest first, or by id) and their metrics; returns how many.

    A running run is refused: stop it first (the sidebar's Stop button, or interrupt its cell).
    A run that another host's reader took for dead but whose heartbeat is fresh again is kept,
    with a warning that says so.
    """
    registry = registry or Registry()
    if not names_or_ids:
        raise GpunbError("remove() needs at least one run name or id.",
                         "pass names, e.g. `gpunb.runs.remove('baseline')`; `gpunb.runs()` lists them.")
    found = [_resolve(registry, key, with_history=False) for key in names_or_ids]
    running = [run for run in found if run["status"] in ("running", "queued")]
    if running:
        host, now = socket.gethostname(), time.time()
        listed = "; ".join(f"{_label(run)} ({whereabouts(run, host, now)})" for run in running)
        raise GpunbError(f"Cannot remove {listed}: still running.",
                         "stop it first (the sidebar's Stop button, or interrupt its cell), then remove it.")
    return _remove(registry, found, "remove")


def prune(*, older_than_days: float | None = None, keep: int | None = None,
          registry: Registry | None = None) -> int:
    """Delete finished runs that started more than `older_than_days` ago, and/or all but the
    newest `keep` finished runs; returns how many were removed. Running runs always stay (a run
    on another host sharing the registry runs while its heartbeat is fresh); a warning names
    those that started before the cutoff.

        gpunb.runs.prune(keep=20)              # the 20 newest finished runs stay
        gpunb.runs.prune(older_than_days=30)   # a month of history stays
    """
    if older_than_days is None and keep is None:
        raise GpunbError("prune() needs `older_than_days`, `keep`, or both.",
                         "e.g. `gpunb.runs.prune(keep=20)` keeps the 20 newest finished runs.")
    if (older_than_days is not None and older_than_days < 0) or (keep is not None and keep < 0):
        raise GpunbError(f"prune() got older_than_days={older_than_days!r}, keep={keep!r}; both must be >= 0.",
                         "e.g. `gpunb.runs.prune(older_than_days=30)`.")
    registry = registry or Registry()
    every = registry.list_runs(limit=1_000_000)
    finished = [run for run in every if run["status"] not in ("running", "queued")]
    cutoff = None if older_than_days is None else time.time() - older_than_days * 86400
    doomed = [run for index, run in enumerate(finished)  # newest first
              if (keep is not None and index >= keep)
              or (cutoff is not None and (run["started_at"] or 0) < cutoff)]
    if cutoff is not None:
        _warn_kept([run for run in every if run["status"] == "running" and (run["started_at"] or 0) < cutoff],
                   "prune")
    return _remove(registry, doomed, "prune") if doomed else 0


def _remove(registry: Registry, runs: list[dict], action: str) -> int:
    """Remove `runs`; the registry keeps any that turned out to be alive, and the user hears why."""
    removed = set(registry.remove([run["id"] for run in runs]))
    kept = [registry.get_run(run["id"], with_history=False) for run in runs if run["id"] not in removed]
    _warn_kept([run for run in kept if run is not None], action)  # None: removed by someone else
    return len(removed)


def _warn_kept(runs: list[dict], action: str) -> None:
    if not runs:
        return
    host, now = socket.gethostname(), time.time()
    listed = "; ".join(f"{_label(run)} ({whereabouts(run, host, now)})" for run in runs)
    warnings.warn(f"gpunb.runs.{action}() kept {listed}: still running. HINT: stop it first (the sidebar's "
                  f"Stop button, or interrupt its cell), then {action} again.", UserWarning, stacklevel=3)


def _label(run: dict) -> str:
    return repr(run["name"] or run["id"])


def _resolve(registry: Registry, key: str, with_history: bool = True) -> dict:
    run = registry.get_run(key, with_history)
    if run is None:
        for candidate in registry.list_runs(limit=10_000):
            if candidate["name"] == key or (len(key) >= 6 and candidate["id"].startswith(key)):
                run = registry.get_run(candidate["id"], with_history)
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
        return [(run["name"] or "", _status(run), _clock(run["started_at"]), _duration(run),
                 _steps(run), _number(run["latest"].get("loss")), _where(run))
                for run in self.runs]

    def __repr__(self) -> str:
        if not self.runs:
            return "No runs recorded yet."
        return _text_table(_COLUMNS, self.rows())

    def _repr_html_(self) -> str:
        if not self.runs:
            return "<p>No runs recorded yet.</p>"
        rows = []
        for run, row in zip(self.runs, self.rows()):
            colour = _STATUS_COLOURS.get(run["status"], "inherit")
            status = f"<span style='color:{colour};font-weight:600'>{html.escape(row[1])}</span>"
            rows.append((row[0], status, *row[2:]))
        return html_table(rows, _COLUMNS, css_class="gpunb-runs", raw=(1,),
                          row_titles=[run["error"] or run["id"] for run in self.runs])


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
        names = [run["name"] or run["id"] for run in self.runs]
        return as_image(line_chart(self.metric, names, self.series), f"{self.metric} of {', '.join(names)}")


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
    return format_duration(end - run["started_at"])


def _steps(run: dict) -> str:
    step = run["step"] or 0
    if run["status"] == "running" and run["total_steps"]:
        return f"{step:,}/{run['total_steps']:,}"
    return f"{step:,}"


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _status(run: dict) -> str:
    """The run's status; a waiting job's also says why it waits (Slurm's state and reason)."""
    job = run.get("job")
    if not job or run["status"] != "queued" or not job.get("state"):
        return run["status"]
    return f"queued ({job['state']}" + (f": {job['reason']})" if job.get("reason") else ")")


def _where(run: dict) -> str:
    """The device; for a job, also its cluster and size ("slurm 2x8 cuda")."""
    job = run.get("job")
    if not job:
        return run["device"] or "-"
    size = f"{job.get('nodes', 1)}x{job.get('tasks_per_node', 1)}"
    device = run["device"] if run["device"] and ":" not in run["device"] else ""
    return " ".join(part for part in (job.get("cluster"), job.get("id") and f"#{job['id']}", size, device) if part)
