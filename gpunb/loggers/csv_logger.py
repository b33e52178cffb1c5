"""CSVLogger: metrics.csv, config.json and result.json in the run's directory; no dependency."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from gpunb.loggers.base import LocalLogger, final_metrics, run_dir

_FIRST = ["step", "epoch"]


class CSVLogger(LocalLogger):
    """One row per log interval and per epoch, as `pandas.read_csv(<dir>/metrics.csv)` reads it.

    Columns are `step`, `epoch` and every metric seen so far; a row leaves the metrics it
    does not have empty. A new metric (val_acc after the first epoch) adds a column: the
    file is rewritten with the wider header, as Lightning's CSVLogger does, into a new file
    that replaces the old one (a full disk mid-way leaves the old file whole, as it leaves
    no half row after an append). Each row is
    on disk when `write` returns (the file is closed), so a killed process loses none.
    `log_dir`: the directory to write in; None: the fit's run directory (see TrainConfig.log_dir).
    """

    def __init__(self, log_dir: str | os.PathLike | None = None):
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.rows: list = []
        self.columns: list = list(_FIRST)

    def start(self, state) -> None:
        self.dir = self.log_dir or run_dir(state)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows, self.columns = [], list(_FIRST)
        (self.dir / "metrics.csv").unlink(missing_ok=True)
        _write_json(self.dir / "config.json", {"run_name": state.run_name, "world_size": state.world_size,
                                               **state.settings()})

    def write(self, step: int, metrics: dict, state) -> None:
        row = {"step": step, "epoch": state.epoch, **{k: v for k, v in metrics.items() if k != "epoch"}}
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        self.columns.extend(new)
        path = self.dir / "metrics.csv"
        if new or not path.exists():  # a wider header: write the whole file again
            _replace_csv(path, self.columns, self.rows)
        else:
            _append_csv(path, self.columns, row)

    def finish(self, state, status: str) -> None:
        result = {"status": status}
        if state.result is not None:
            result.update(final_metrics(state))
            result["stop_reason"] = state.result.stop_reason
        _write_json(self.dir / "result.json", result)


def _append_csv(path: Path, columns: list, row: dict) -> None:
    size = path.stat().st_size
    try:
        with open(path, "a", newline="") as f:
            csv.DictWriter(f, columns).writerow(row)
    except OSError:
        os.truncate(path, size)  # a full disk: no half row left, the file ends at its last whole row
        raise


def _replace_csv(path: Path, columns: list, rows: list) -> None:
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, default=str) + "\n")
