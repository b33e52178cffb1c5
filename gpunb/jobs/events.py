"""The events file of a job: rank 0 appends, the kernel tails.

One JSON object a line: {"t": time.time(), "event": name, ...}. The run's own events carry
what the launcher's relay sends over its queue (distributed/worker.py): the log rows since the
last line and the event's arguments as JSON, and the RunState's relayed fields (`relayed()`:
counters, newest metrics, the Plan, the device), pickled and base64-encoded since some are
objects; the kernel mirrors rank 0's state with `load_relayed`, as the launcher does. The job
adds its own events:

    job_started   a task group started (again, after a requeue): host, world size, attempt
    job_done      result.pt and result.pkl are written
    job_failed    the job ended with an error: what, hint, traceback (a version mismatch too)
    requeued      stopped for preemption or the time limit, checkpoint written, back in the queue

Each line is written with one write() and flushed at once: at each log, validation, epoch,
checkpoint, and a progress line at most every PROGRESS_EVERY_S, so the kernel sees a row
about as soon as the job has it. Nothing is fsynced: a reader on the same machine or on a
shared file system's client sees flushed data; only a crash of the node could lose a line.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import time

from gpunb.runs.registry import json_safe

EVENTS_FILE = "events.jsonl"
PROGRESS_EVERY_S = 0.25  # progress lines (the dashboard's bar) at most this often


def append(path, event: str, **fields) -> None:
    """One event line, appended and flushed."""
    line = json.dumps(json_safe({"t": time.time(), "event": event, **fields}), allow_nan=False) + "\n"
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line)


class EventsWriter:
    """Rank 0's callback: the run's events into the events file."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.rows_sent = 0
        self.progress_sent = 0.0
        self._file = None

    def on_fit_start(self, state) -> None:
        self.rows_sent = 0  # a resumed run sends its history again: the reader keeps what is new
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed at the end)
        self._write("on_fit_start", state)

    def on_step_end(self, state) -> None:
        now = time.monotonic()  # per step only a clock read: the line goes out at most 4 times a second
        if now - self.progress_sent >= PROGRESS_EVERY_S:
            self.progress_sent = now
            self._write("on_step_end", state)

    def on_log(self, state, metrics) -> None:
        self._write("on_log", state, args=[dict(metrics)])

    def on_validation_end(self, state, metrics) -> None:
        self._write("on_validation_end", state, args=[dict(metrics)])

    def on_epoch_end(self, state, metrics) -> None:
        self._write("on_epoch_end", state, args=[dict(metrics)])

    def on_checkpoint(self, state, path) -> None:
        self._write("on_checkpoint", state, args=[str(path)])

    def on_fit_end(self, state) -> None:
        self._write("on_fit_end", state, stop_reason=state.stop_reason)
        self._close()

    def on_exception(self, state, error) -> None:
        self._close()

    def _write(self, event: str, state, **fields) -> None:
        if self._file is None:
            return
        relayed = base64.b64encode(pickle.dumps(state.relayed(), protocol=pickle.HIGHEST_PROTOCOL)).decode()
        line = {"t": time.time(), "event": event, "rows": state.history[self.rows_sent:], "relayed": relayed,
                **fields}
        self.rows_sent = len(state.history)
        # The C encoder as it is (json_safe's walk in Python costs more than the rest of the write):
        # NaN stays NaN, which the kernel's json.loads reads; anything else odd becomes its value or text.
        self._file.write(json.dumps(line, default=_plain) + "\n")
        self._file.flush()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _plain(value):
    """A tensor or NumPy scalar as its number; any other object the encoder cannot take, as text."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    return str(value)


def relayed_fields(line: dict) -> dict:
    """The RunState fields an event line carries (for `load_relayed`)."""
    return pickle.loads(base64.b64decode(line["relayed"]))


class EventsReader:
    """Reads the lines appended since the last call; a line still being written waits."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.offset = 0
        self._partial = b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        complete, _, self._partial = data.rpartition(b"\n")
        return [json.loads(line) for line in complete.split(b"\n") if line.strip()] if complete else []
