"""RunWriter: one run's registry writes, done by a daemon thread off the training loop.

The training thread only hands over data (`submit`), which takes a lock for a few
microseconds; every SQLite call, and every wait on another process's lock, happens
here. What could not be written yet stays pending and is merged with newer data
(newest fields win, metric rows accumulate, thinned when many), so a run that could
not be recorded at start is recorded in full once the lock clears.

With nothing to write for HEARTBEAT_EVERY_S, the thread stamps the run's heartbeat: a
step that runs for minutes still shows, to a host that shares the registry, that the
run lives (the training thread does nothing for it, and a locked registry only delays
the stamp). In between, every STOP_POLL_S it reads whether the sidebar asked the run to
stop, unless the training thread looked meanwhile, at a log (each read here takes the GIL
from the step): the training thread reads `stop_requested` at each step, so a stop lands at
the next step boundary, however long the log interval.

The thread is a daemon, which would keep a stuck registry from letting the process exit; so
that exit does not cut off a run's end that a locked registry held back past its fit, an
exit hook gives such ends EXIT_WAIT_S more.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable

from gpunb.runs.registry import Registry, RegistryLocked
from gpunb.runs.threads import run_in_thread

LOCKED_RETRY_S = 0.25  # pause between tries while another process holds the lock
RETRY_AFTER_S = 30.0  # after any other failure (disk full, damaged file), leave the registry alone this long
MAX_PENDING_ROWS = 1000  # metric rows kept while the registry is unavailable (thinned evenly beyond)
HEARTBEAT_EVERY_S = 5.0  # idle this long, the thread stamps the run's heartbeat (liveness.STALE_AFTER_S is far longer)
STOP_POLL_S = 0.5  # idle, the thread reads the run's stop request this often (one read, off the training thread)
EXIT_WAIT_S = 10.0  # at exit, wait this long at most for runs' ends not yet written
ABANDONED = "the fit ended without reporting its end to the run registry"

log = logging.getLogger(__name__)


class RunWriter:
    """Writes run `run_id` to `registry`, starting with `start_run(**start)`.

    `warn(error)` is called (from this thread) after a failed write; `stop_requested`
    turns True once the registry holds a stop request for the run.
    """

    def __init__(self, registry: Registry, run_id: str, start: dict, warn: Callable[[Exception], None],
                 owner: object = None):
        self.registry, self.run_id = registry, run_id
        # Weakly: a fit that ended without its end reaching the recorder drops the recorder, and
        # the thread then ends the run as failed instead of stamping it alive for ever.
        self._owner = weakref.ref(owner) if owner is not None else None
        self._warn = weakref.WeakMethod(warn) if hasattr(warn, "__self__") else (lambda: warn)
        self.stop_requested = False  # as of this thread's last read
        # time.monotonic() of the training thread's own last look for a stop request (the recorder
        # looks at each log: stop_signal.py): while that is recent, this thread need not poll
        self.stop_read_at = float("-inf")
        self.recorded = threading.Event()  # the run's row exists
        self.finished = threading.Event()  # the final status is written, or given up
        self._changed = threading.Condition()
        self._start: dict | None = start  # start_run's arguments until the row exists
        self._start_args = dict(start)  # kept: a row another host removed is recorded again
        self._fields: dict = {}  # newest `Registry.update` fields not yet written
        self._rows: list = []  # (step, metrics) not yet written
        self._finish: dict | None = None  # `Registry.finish` arguments
        self._busy = False  # a thread (this one, or at the end the training thread) holds work taken from the pending state
        self._ending = threading.Event()  # the final status was submitted: cut any back-off short
        run_in_thread(self._loop, name=f"gpunb-run-{run_id[:8]}")

    # ------------------------------------------------------------------ training thread
    def submit(self, fields: dict | None = None, rows: list | None = None, finish: dict | None = None) -> None:
        with self._changed:
            self._fields.update(fields or {})
            self._rows.extend(rows or ())
            if len(self._rows) > MAX_PENDING_ROWS:  # keep every other row, and the newest
                self._rows = self._rows[:-1:2] + self._rows[-1:]
            if finish is not None:
                self._set_end(finish)
            self._changed.notify_all()

    def end(self, registry: Registry, finish: dict, rows: list) -> bool:
        """Submit the run's end and write it, with anything still pending, on the calling thread
        through `registry` (the caller's own, which never waits for a lock), unless this thread is
        writing; True once it is written. A fit's end then need not wait for this thread to wake."""
        with self._changed:
            self._rows.extend(rows)
            self._set_end(finish)
            mine = not self._busy and not self.finished.is_set()
            self._busy = self._busy or mine
            if not mine:
                self._changed.notify_all()
                return self.finished.is_set()
        try:
            self._write_pending(registry)
        except Exception:  # put back by _write_pending: this thread tries again, and reports it
            pass
        with self._changed:
            self._busy = False
            self._changed.notify_all()
        return self.finished.is_set()

    def _set_end(self, finish: dict) -> None:  # under self._changed
        self._finish = finish
        self._ending.set()
        _UNWRITTEN_ENDS.add(self)
        _exit_hook()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written; False if `timeout` ran out first."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending() and not self._busy
                                          or self.finished.is_set(), timeout)

    # ------------------------------------------------------------------ writer thread
    def _pending(self) -> bool:
        return bool(self._start or self._fields or self._rows or self._finish)

    def _wanted(self) -> bool:  # something for this thread to do now
        return self._pending() and not self._busy or self.finished.is_set()

    def _loop(self) -> None:
        last_beat = time.monotonic()
        while not self.finished.is_set():
            # a read of the stop request by the training thread puts the next poll off by STOP_POLL_S
            since_read = time.monotonic() - self.stop_read_at
            poll_in = max(0.01, STOP_POLL_S - since_read) if since_read < STOP_POLL_S else STOP_POLL_S
            with self._changed:
                idle = not self._changed.wait_for(self._wanted, min(poll_in, HEARTBEAT_EVERY_S))
                if self.finished.is_set():  # written (by the training thread), or given up
                    return
                if self._busy:  # the training thread writes the run's end itself: see what it left
                    self._changed.wait_for(lambda: not self._busy)
                    continue
                self._busy = True
            error = None
            try:
                if not idle:
                    self._write_pending()
                    last_beat = time.monotonic()  # a write touches the row as a heartbeat does
                elif self._owner is not None and self._owner() is None:
                    self._finish = {"status": "failed", "error": ABANDONED}  # written on the next turn
                elif time.monotonic() - last_beat >= HEARTBEAT_EVERY_S:
                    self._beat()
                    last_beat = time.monotonic()
                elif self.recorded.is_set() and time.monotonic() - self.stop_read_at >= STOP_POLL_S:
                    self.stop_requested = self.registry.stop_requested(self.run_id)
            except Exception as caught:  # kept pending; training matters more than the record
                error = caught
                warn = self._warn()
                if warn is not None:
                    warn(error)
                if not isinstance(error, RegistryLocked) and self._finish is not None:
                    self.finished.set()  # the run is over and the registry is broken: give up
            with self._changed:
                self._busy = False
                self._changed.notify_all()
            if isinstance(error, RegistryLocked):
                time.sleep(LOCKED_RETRY_S)
            elif error is not None:
                self._ending.wait(RETRY_AFTER_S)  # the run's end is worth one more try at once

    def _beat(self) -> None:
        if self.registry.heartbeat(self.run_id):
            self.stop_requested = self.registry.stop_requested(self.run_id)
        elif self.recorded.is_set():  # removed by a host that took the run for dead: it lives, record it again
            self.registry.start_run(run_id=self.run_id, **{**self._start_args, "reopen": True})

    def _write_pending(self, registry: Registry | None = None) -> None:
        registry = registry or self.registry
        if self._start is not None:
            registry.start_run(run_id=self.run_id, **self._start)
            self._start = None
            self.recorded.set()
        with self._changed:
            fields, self._fields = self._fields, {}
            rows, self._rows = self._rows, []
            finish = self._finish
        if not (fields or rows or finish):  # the row alone: it may be a job's, with a stop request waiting
            self.stop_requested = registry.stop_requested(self.run_id)
            return
        try:
            # One transaction: the second's logs, the newest fields and, at the end, the final status.
            self.stop_requested = registry.record(self.run_id, fields, rows, finish)
        except Exception:
            with self._changed:  # put back what was not written, under anything newer
                self._fields = fields | self._fields
                self._rows = rows + self._rows
            raise
        if finish is not None:
            self.finished.set()


_UNWRITTEN_ENDS: weakref.WeakSet = weakref.WeakSet()  # writers given a run's end (a finished one's thread is gone)


@functools.cache
def _exit_hook() -> None:
    atexit.register(_write_ends_at_exit)  # once, at the first run's end: nothing happens at import


def _write_ends_at_exit() -> None:
    waiting = [writer for writer in list(_UNWRITTEN_ENDS) if not writer.finished.is_set()]
    if not waiting:
        return
    log.warning("gpunb: waiting up to %g s for the run registry to record the end of %d run(s).",
                EXIT_WAIT_S, len(waiting))
    deadline = time.monotonic() + EXIT_WAIT_S
    for writer in waiting:
        writer.flush(max(0.0, deadline - time.monotonic()))
