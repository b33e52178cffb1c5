"""The events file of a job: rank 0 appends, the kernel tails.

One JSON object a line: {"t": time.time(), "event": name, ...}. The run's own events are the
relay's messages (distributed/relay.py: rank 0's RelayWriter over an `EventsChannel`, the
kernel's Mirror), one a line: the log rows since the last line, the event's arguments as
JSON (`args`), and the RunState's relayed fields pickled and base64-encoded (`relayed`),
since some are objects. The job adds its own events:

    job_started   a task group started (again, after a requeue): host, world size, attempt
    job_done      result.pt and result.pkl are written
    job_failed    the job ended with an error: what, hint, traceback (a version mismatch too)
    requeued      stopped for preemption or the time limit, checkpoint written, back in the queue

Each line is written with one write() at once, as the relay sends it (at each log,
validation, epoch, checkpoint, and a progress line at most every relay.PROGRESS_EVERY_S), so
the kernel sees a row about as soon as the job has it. Nothing is fsynced: a reader on the
same machine or on a shared file system's client sees written data; only a crash of the node
could lose a line.

The file is a log that survives damage. A write that fails (a full disk) warns once, leaves
no half line behind, and the run goes on, as it does when a checkpoint cannot be written. A
writer that died mid-line leaves a half line: the next writer starts on a fresh line, so the
damage stays a line of its own. The reader takes a line once it ends with a newline (a half
line is read again when it is complete), and skips a line that is not an event, with one
warning. The job's end does not hang on this file: result.pt says it too (follow.py).
"""

from __future__ import annotations

import base64
import errno
import json
import os
import pickle
import time
import warnings

from gpunb.runs.registry import json_safe

EVENTS_FILE = "events.jsonl"
LINE_START = b'{"t": '  # how every line begins (json.dumps of a dict whose first key is "t")

_warned: set[str] = set()  # files whose failed write was reported: one warning per file and process


def append(path, event: str, **fields) -> None:
    """One event line, appended (a failed write warns once and is dropped: see LineFile)."""
    line = json.dumps(json_safe({"t": time.time(), "event": event, **fields}), allow_nan=False)
    log = LineFile(path)
    log.write(line)
    log.close()


class LineFile:
    """Appends whole lines to a file that other processes tail.

    Each line goes out in one os.write() on a descriptor opened for appending. A write that
    fails (ENOSPC, EDQUOT, any OSError) is cut back to where the line began, so readers never
    see half of it, and warns once; the next line is tried as usual. A file that does not end
    with a newline when this writer starts (a writer died mid-line), or that could not be cut
    back, gets one first, so that the next line stands on its own.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self._fd = None
        self._clean = False  # the file is known to end with a newline (or to be empty)

    def write(self, text: str) -> bool:
        """`text` (one JSON object, no newline) as a line; False if it could not be written."""
        start, data = None, text.encode() + b"\n"
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
            start = os.fstat(self._fd).st_size
            if not self._clean and start and os.pread(self._fd, 1, start - 1) != b"\n":
                data = b"\n" + data
            _write_all(self._fd, data)
            self._clean = True
            return True
        except OSError as error:
            # cut back to a clean end: the file is as it was, which ended a line unless we began one
            self._clean = self._cut_back(start) and not data.startswith(b"\n")
            _warn_once(self.path, error)
            return False

    def _cut_back(self, size: int | None) -> bool:
        """The file back to `size` bytes (its size before the failed line); False if unknown."""
        if self._fd is None or size is None:
            return False
        try:
            os.ftruncate(self._fd, size)  # shrinking needs no space, so it works on a full disk
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
            self._clean = False  # reopened later, it checks again: another writer may have died mid-line


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:  # a full disk can end a write short, then refuse the rest
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


def _warn_once(path: str, error: OSError) -> None:
    if path in _warned:
        return
    _warned.add(path)
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    why = "the disk is full" if full else f"{type(error).__name__}: {error}"
    warnings.warn(f"Could not write to the job's events file {path} ({why}); training goes on, and later "
                  "events are tried again. The notebook misses the events that were not written; the job's "
                  "checkpoints and its result are written apart from this file.\n"
                  "HINT: free space in the job folder's file system (or raise its quota); the run's end "
                  "reaches the notebook through result.pt even if its event is lost.",
                  RuntimeWarning, stacklevel=3)


class EventsChannel:
    """The relay's channel for a job (distributed/relay.py): each message one line of the events
    file. A line that could not be written is lost (its rows go out with the next one); the
    job's stop requests come in through jobs/control.py, not here."""

    def __init__(self, path):
        self.file = LineFile(path)

    def send(self, message: dict) -> bool:
        relayed = base64.b64encode(pickle.dumps(message["fields"], protocol=pickle.HIGHEST_PROTOCOL)).decode()
        extra = {k: v for k, v in message.items() if k not in ("event", "rows", "fields", "args")}
        line = {"t": time.time(), "event": message["event"], "rows": message["rows"], "relayed": relayed,
                **({"args": message["args"]} if message["args"] else {}), **extra}
        # The C encoder as it is (json_safe's walk in Python costs more than the rest of the write):
        # NaN stays NaN, which the kernel's json.loads reads; anything else odd becomes its value or text.
        return self.file.write(json.dumps(line, default=_plain))

    def stop_requested(self) -> None:
        return None

    def close(self) -> None:
        self.file.close()


def _plain(value):
    """A tensor or NumPy scalar as its number; any other object the encoder cannot take, as text."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    return str(value)


def message(line: dict) -> dict:
    """The relay's message a line of the run's own events carries (for relay.Mirror.receive)."""
    return {"event": line["event"], "rows": line["rows"], "fields": pickle.loads(base64.b64decode(line["relayed"])),
            "args": line.get("args", [])}


class EventsReader:
    """Reads the lines appended since the last call. A line still being written (no newline yet)
    is left in the file and read again once it is complete: `offset` stays at its start."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.offset = 0  # where the first line not read yet begins
        self.skipped = 0  # damaged lines skipped (the first one warns)

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # past the last complete line (0: none yet)
        lines, start = [], self.offset
        for raw in data[:end].split(b"\n"):
            if raw.strip():
                line, damaged = _event(raw)
                if damaged:
                    self._skip(start, raw)
                if line is not None:
                    lines.append(line)
            start += len(raw) + 1
        self.offset += end
        return lines

    def _skip(self, at: int, raw: bytes) -> None:
        self.skipped += 1
        if self.skipped == 1:
            warnings.warn(f"Skipped a damaged line in {self.path} (at byte {at}: {raw[:60]!r}...): it is not an "
                          "event (a writer stopped mid-line, or the file was edited). The events around it "
                          "are read as usual; later damaged lines are skipped without a word.",
                          RuntimeWarning, stacklevel=3)


def _event(raw: bytes) -> tuple[dict | None, bool]:
    """(the event a line holds or None, whether the line is damaged). A line glued to the end of a
    half one (a writer died mid-line, then the next attempt appended) gives the event at its end."""
    found = _parsed(raw)
    if found is not None:
        return found, False
    at = raw.find(LINE_START, 1)
    while found is None and at > 0:
        found = _parsed(raw[at:])
        at = raw.find(LINE_START, at + 1)
    return found, True


def _parsed(raw: bytes) -> dict | None:
    try:
        line = json.loads(raw)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        return None
    return line if isinstance(line, dict) and isinstance(line.get("event"), str) else None
