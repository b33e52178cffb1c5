"""The run registry: one SQLite file (WAL where the file system allows) shared by every kernel and the Jupyter server.

Connections are never shared between threads: with `keep_open=True` (the default)
each thread keeps one of its own, opened on first use (closing the last connection
checkpoints the WAL with an fsync, too slow to pay on every write); with
`keep_open=False` every operation opens and closes its own (the server, whose
requests must not queue behind each other). A connection never crosses a fork.
WAL lets readers go on while a writer holds the lock; busy_timeout (`timeout`)
makes writers queue, and a wait longer than that is a `RegistryLocked` error that
says so; write transactions start with BEGIN IMMEDIATE so a read-then-write never
deadlocks on a lock upgrade. A reader never waits for a writer: the one write a read
may make (marking a dead run failed) is skipped when the lock is taken. A file that is
not a readable SQLite database, or not a registry (another program's tables, a
directory), is a `RegistryDamaged` error that says how to recover.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpunb.errors import GpunbError
from gpunb.runs.errors import RegistryDamaged, RegistryLocked, registry_error
from gpunb.runs.journal import enable_wal
from gpunb.runs.liveness import (PROCESS_DIED, STALE_AFTER_S, alive, judged_dead, last_sign,  # noqa: F401
                                 process_start)
from gpunb.runs.liveness import kernel_id as current_kernel_id
from gpunb.runs.paths import default_path
from gpunb.runs.stop_signal import raise_signal

# "queued": a job (gpunb.jobs) submitted and not started yet; "cancelled": a job its scheduler ended;
# "lost": a job its scheduler no longer knows (its id forgotten, or reused for another job)
STATUSES = ("queued", "running", "completed", "stopped", "interrupted", "failed", "cancelled", "lost")
MAX_POINTS = 500  # metric points kept per run; older ones are thinned evenly
SERIES_POINTS = 60  # the newest points of a running run's loss that `list_runs` includes
_LOWER_IS_BETTER = ("loss", "err", "mse", "mae", "perplexity", "ppl")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, name TEXT, notebook TEXT, kernel_id TEXT,
    pid INTEGER, pid_started REAL, host TEXT, status TEXT NOT NULL, config TEXT,
    started_at REAL, ended_at REAL, updated_at REAL,
    progress REAL, step INTEGER, total_steps INTEGER, epoch INTEGER, eta_s REAL,
    latest TEXT, device TEXT, energy_j REAL, error TEXT,
    best TEXT,                                 -- each validation metric's best value, set at the end
    heartbeat_at REAL,                         -- stamped every few seconds by the running run's own thread
    job TEXT,                                  -- a run as a job: cluster, job id, folder, nodes, scheduler state
    stop_reason TEXT,                          -- a stopped or cancelled run: who or what ended it, in words
    sweep TEXT,                                -- a sweep's trial: the sweep's name, the trial's number, ...
    metric_seq INTEGER NOT NULL DEFAULT 0,     -- metric points added so far
    metric_stride INTEGER NOT NULL DEFAULT 1   -- keep every stride-th point (doubles when full)
);
CREATE INDEX IF NOT EXISTS runs_by_start ON runs(started_at);
CREATE TABLE IF NOT EXISTS metrics (
    run_id TEXT NOT NULL, seq INTEGER NOT NULL, t REAL, step INTEGER, data TEXT,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS stop_requests (run_id TEXT PRIMARY KEY, requested_at REAL);
CREATE TABLE IF NOT EXISTS sweep_stops (sweep TEXT PRIMARY KEY, requested_at REAL, reason TEXT);
"""
_RUN_COLUMNS = ("id", "name", "notebook", "kernel_id", "pid", "host", "status", "config",
                "started_at", "ended_at", "updated_at", "progress", "step", "total_steps",
                "epoch", "eta_s", "latest", "device", "energy_j", "error", "best", "heartbeat_at", "job", "stop_reason",
                "sweep")
_UPDATABLE = ("progress", "step", "total_steps", "epoch", "eta_s", "latest", "device", "energy_j")
# what a reopened run takes from the process that goes on with it (the rest is the run's own)
_REOPENED = ("notebook", "kernel_id", "pid", "pid_started", "host", "config", "updated_at", "total_steps", "device",
             "sweep")
_AFTER_CANCEL = "('failed', 'interrupted')"  # what a cancelled job's dying ranks report, never its end
# columns newer than the first registries
_ADDED_COLUMNS = {"best": "TEXT", "heartbeat_at": "REAL", "job": "TEXT", "stop_reason": "TEXT", "sweep": "TEXT"}


# The registry files this process has made or checked, by path, with each file's identity then: a
# run's recorder opens two Registry objects a fit, and neither checks the schema again, while a file
# removed or replaced since (a new identity) is checked again.
_checked: dict[Path, tuple[int, int] | None] = {}


def _identity(path: Path) -> tuple[int, int] | None:
    """The file's (device, inode), or None when there is none."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def json_safe(value: Any, _depth: int = 0) -> Any:
    """`value` as plain JSON: NaN/inf become None, tensors and numpy scalars their
    Python value, unknown objects their str(); browsers reject NaN in JSON."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # also turns IntEnum and friends into plain ints
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if _depth > 8:
        return str(value)  # deep or cyclic structure: stop here
    if isinstance(value, dict):
        return {str(key): json_safe(item, _depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(item, _depth + 1) for item in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy or torch scalar
        return json_safe(value.item(), _depth + 1)
    return str(value)


def _dumps(value: Any) -> str:
    return json.dumps(json_safe(value), allow_nan=False)


class Registry:
    """Runs and their metrics in `path` (default: `default_path()`), created on first use."""

    def __init__(self, path: str | os.PathLike | None = None, timeout: float = 5.0, keep_open: bool = True):
        self.path = Path(path) if path is not None else default_path()
        self.timeout = timeout  # seconds a writer waits for another writer's lock
        self.keep_open = keep_open  # one connection per thread (True) or per operation (False)
        self._ready = False
        self._local = threading.local()  # this thread's (pid, connection) when keep_open

    # ------------------------------------------------------------------ writes
    def start_run(self, name: str, *, config: dict | None = None, device: str | None = None,
                  total_steps: int | None = None, pid: int | None = None, host: str | None = None,
                  notebook: str | None = None, kernel_id: str | None = None, run_id: str | None = None,
                  started_at: float | None = None, reopen: bool = False, status: str = "running",
                  job: dict | None = None) -> str:
        """Record a new running run; returns its id (`run_id`, else a new one).

        pid/host/notebook/kernel_id default to this process's; `started_at` to now. `reopen`:
        the run `run_id` goes on (a continued fit): running again in this process, its start,
        history and counters kept; recorded anew if it was removed meanwhile. `status="queued"`
        with `job`: a job submitted to a scheduler, which becomes running when the job starts. A
        sweep's trial says so in its config (`config["sweep"]`: the sweep's name, the trial's number),
        which its row keeps in a column of its own.
        """
        run_id = run_id or uuid.uuid4().hex
        now = started_at or time.time()
        pid = os.getpid() if pid is None else pid
        row = {"id": run_id, "name": name, "notebook": notebook or os.environ.get("JPY_SESSION_NAME"),
               "kernel_id": kernel_id or current_kernel_id(), "pid": pid, "pid_started": process_start(pid),
               "host": host or socket.gethostname(), "status": status, "config": _dumps(config or {}),
               "started_at": now, "updated_at": now, "total_steps": total_steps, "device": device,
               "latest": "{}", "step": 0}
        if job is not None:
            row["job"] = _dumps(job)
        if (config or {}).get("sweep"):
            row["sweep"] = _dumps(config["sweep"])
        insert = f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})"
        if reopen:
            insert += (" ON CONFLICT(id) DO UPDATE SET status = 'running', ended_at = NULL, error = NULL, "
                       "eta_s = NULL, stop_reason = NULL, " + ", ".join(f"{key} = excluded.{key}" for key in _REOPENED))
        with self._write() as db:
            db.execute(insert, tuple(row.values()))
        return run_id

    def update(self, run_id: str, **fields: Any) -> None:
        """Set any of progress, step, total_steps, epoch, eta_s, latest (dict), device, energy_j."""
        values = _field_values(fields)
        with self._write() as db:
            _set_fields(db, run_id, values)

    def set_job(self, run_id: str, job: dict, status: str | None = None, error: str | None = None,
                stop_reason: str | None = None) -> None:
        """Merge `job` into a job's record (its scheduler state, reason, nodes); with `status`, also
        move the run there ("queued" again after a requeue, "cancelled", "failed" ...), with
        `stop_reason` (who cancelled it, in words) beside it."""
        with self._write() as db:
            row = db.execute("SELECT job FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                raise KeyError(f"no run {run_id!r} in {self.path}")
            merged = {**json.loads(row[0] or "{}"), **job}
            db.execute("UPDATE runs SET job = ?, updated_at = ? WHERE id = ?", (_dumps(merged), time.time(), run_id))
            if status is not None:
                ended = None if status in ("queued", "running") else time.time()
                # A cancel says why in words: the error its dying ranks wrote (gloo's) goes, and they
                # cannot make a cancelled run failed afterwards.
                cancel = status == "cancelled"
                db.execute("UPDATE runs SET status = ?, error = CASE WHEN ? THEN ? ELSE COALESCE(?, error) END, "
                           "ended_at = ?, stop_reason = ? WHERE id = ? "
                           f"AND NOT (status = 'cancelled' AND ? IN {_AFTER_CANCEL})",
                           (status, cancel, error, error, ended, stop_reason, run_id, status))

    def heartbeat(self, run_id: str) -> bool:
        """Stamp the run as alive now (its recorder's thread does, every few seconds); False if
        there is no such run."""
        with self._write() as db:
            found = db.execute("UPDATE runs SET heartbeat_at = ? WHERE id = ?", (time.time(), run_id)).rowcount
            _revive(db, run_id)
        return found == 1

    def add_metrics(self, run_id: str, step: int, metrics: dict) -> None:
        """Append a metric point; at most ~MAX_POINTS are kept, evenly spread, plus the newest."""
        self.add_points(run_id, [(step, metrics)])

    def add_points(self, run_id: str, points: list) -> None:
        """Append (step, metrics) points in one transaction (a recorder's second of logs in one
        write), thinned as `add_metrics` thins them."""
        with self._write() as db:
            _add_points(db, run_id, points, self.path)

    def finish(self, run_id: str, status: str, *, error: str | None = None, stop_reason: str | None = None,
               **fields: Any) -> None:
        """End a run with `status` (not "running"), `stop_reason` saying why in words when it stopped;
        `fields` as in `update` (e.g. energy_j)."""
        self.record(run_id, finish={"status": status, "error": error, "stop_reason": stop_reason, **fields})

    def record(self, run_id: str, fields: dict | None = None, points: list = (), finish: dict | None = None) -> bool:
        """A run's news in one transaction, so that a run's end lands whole or not at all: `fields`
        as in `update`, `points` as in `add_points`, and `finish` (`finish`'s arguments: `status`,
        and `error`, `stop_reason` and fields) to end the run. Returns whether a stop is requested
        for the run (never, once it has ended)."""
        ending = dict(finish or {})
        status = ending.pop("status", None)
        error, stop_reason = ending.pop("error", None), ending.pop("stop_reason", None)
        if finish is not None:
            _check_end(status)
            fields = {**(fields or {}), "eta_s": None, **ending}
        values = _field_values(fields) if fields else None
        with self._write() as db:
            if values:  # an end sets the status itself: no revival first
                _set_fields(db, run_id, values, revive=finish is None)
            if points:
                _add_points(db, run_id, points, self.path)
            if finish is not None:
                _end(db, run_id, status, error, stop_reason)  # which deletes the run's stop request
                return False
            return bool(db.execute("SELECT 1 FROM stop_requests WHERE run_id = ?", (run_id,)).fetchall())

    def request_stop(self, run_id: str) -> bool:
        """Ask a running (or queued) run to stop at its next log; False when it is neither."""
        self.get_run(run_id, with_history=False)  # first marks it failed if its process died
        with self._write() as db:
            # Conditional in one statement, so a run that ends meanwhile gets no request.
            inserted = db.execute("INSERT OR REPLACE INTO stop_requests (run_id, requested_at) "
                                  "SELECT id, ? FROM runs WHERE id = ? AND status IN ('running', 'queued')",
                                  (time.time(), run_id)).rowcount
        if inserted:
            raise_signal(self.path)  # after the commit: a run that sees the signal finds the request
        return inserted == 1

    def request_sweep_stop(self, sweep: str, reason: str) -> list[dict]:
        """Record that the sweep `sweep` is to stop (its kernel asks no more trials and stops the ones it
        runs), `reason` saying who asked, in words; returns its trials' rows (newest first)."""
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO sweep_stops (sweep, requested_at, reason) VALUES (?, ?, ?)",
                       (sweep, time.time(), reason))
        return self.sweep_runs(sweep)

    def clear_sweep_stop(self, sweep: str) -> None:
        """The sweep runs again (its cell run anew): an earlier stop of it no longer stands."""
        with self._write() as db:
            db.execute("DELETE FROM sweep_stops WHERE sweep = ?", (sweep,))

    def remove(self, run_ids: list[str]) -> list[str]:
        """Delete these runs and their metrics, except live ones; returns the ids removed.

        Live: running (or marked dead by a reader) and sending signs of life (its process on
        this host, or a heartbeat from another host fresher than STALE_AFTER_S); a row still
        marked running whose process is gone is removed. Judged in the deleting transaction,
        so no heartbeat can slip in between the judgement and the delete.
        """
        host, now, removed = socket.gethostname(), time.time(), []
        with self._write() as db:
            for run_id in run_ids:
                row = db.execute(f"SELECT {self._select()} FROM runs WHERE id = ?", (run_id,)).fetchone()
                if row is None:
                    continue
                run = self._run_dict(row)
                if (run["status"] == "running" or judged_dead(run)) and alive(run, host, now):
                    continue
                if run["status"] == "queued":
                    continue  # a job waiting for its scheduler: cancel it first
                db.execute("DELETE FROM runs WHERE id = ?", (run_id,))
                db.execute("DELETE FROM metrics WHERE run_id = ?", (run_id,))
                removed.append(run_id)
        return removed

    # ------------------------------------------------------------------ reads
    def stop_requested(self, run_id: str) -> bool:
        # One statement, so no BEGIN/COMMIT around it: the recorder asks at every log.
        with self._read(single=True) as db:
            # fetchall steps the statement to its end, which ends its read at once
            return bool(db.execute("SELECT 1 FROM stop_requests WHERE run_id = ?", (run_id,)).fetchall())

    def sweep_stops(self) -> dict[str, str]:
        """The sweeps asked to stop: each one's reason, by the sweep's name."""
        with self._read(single=True) as db:
            return dict(db.execute("SELECT sweep, reason FROM sweep_stops").fetchall())

    def sweep_runs(self, sweep: str) -> list[dict]:
        """The trials of the sweep `sweep`, newest first."""
        with self._read() as db:
            rows = db.execute(f"SELECT {self._select()} FROM runs WHERE json_extract(sweep, '$.name') = ? "
                              "ORDER BY started_at DESC, rowid DESC", (sweep,)).fetchall()
        return self._mark_dead([self._run_dict(row) for row in rows])

    def list_runs(self, limit: int = 100, series: bool = False) -> list[dict]:
        """The newest `limit` runs, newest first (runs whose process died are marked failed).

        With `series`, each running run also gets `losses`: its newest SERIES_POINTS
        (step, loss) pairs, so a poller needs no request per run.
        """
        with self._read() as db:
            rows = db.execute(f"SELECT {self._select()} FROM runs ORDER BY started_at DESC, rowid DESC "
                              "LIMIT ?", (int(limit),)).fetchall()
            runs = [self._run_dict(row) for row in rows]
            for run in runs if series else ():
                if run["status"] == "running":
                    points = db.execute("SELECT step, data FROM metrics WHERE run_id = ? ORDER BY seq DESC "
                                        "LIMIT ?", (run["id"], SERIES_POINTS)).fetchall()
                    run["losses"] = [[step, loss] for step, data in reversed(points)
                                     if isinstance(loss := json.loads(data).get("loss"), (int, float))]
        return self._mark_dead(runs)

    def get_run(self, run_id: str, with_history: bool = True) -> dict | None:
        with self._read() as db:
            row = db.execute(f"SELECT {self._select()} FROM runs WHERE id = ?", (run_id,)).fetchone()
            points = db.execute("SELECT t, step, data FROM metrics WHERE run_id = ? ORDER BY seq",
                                (run_id,)).fetchall() if row and with_history else []
        if row is None:
            return None
        run = self._mark_dead([self._run_dict(row)])[0]
        if with_history:
            run["history"] = [_point(t, step, data) for t, step, data in points]
        return run

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _select() -> str:
        return ", ".join(f"runs.{column}" for column in _RUN_COLUMNS) + \
            ", pid_started, EXISTS (SELECT 1 FROM stop_requests s WHERE s.run_id = runs.id)"

    @staticmethod
    def _run_dict(row: tuple) -> dict:
        run = dict(zip(_RUN_COLUMNS, row))
        run["config"] = json.loads(run["config"] or "{}")
        run["latest"] = json.loads(run["latest"] or "{}")
        run["best"] = json.loads(run["best"] or "{}")
        run["job"] = json.loads(run["job"]) if run["job"] else None
        run["sweep"] = json.loads(run["sweep"]) if run["sweep"] else None
        run["stop_requested"] = bool(row[-1])
        run["_pid_started"] = row[-2]
        return run

    def _mark_dead(self, runs: list[dict]) -> list[dict]:
        host, now = socket.gethostname(), time.time()
        dead = [run for run in runs if run["status"] == "running" and not alive(run, host, now)]
        if dead:
            try:
                with self._write(wait=False) as db:  # a reader never waits on another process's lock
                    for run in dead:
                        db.execute("UPDATE runs SET status = 'failed', error = ?, ended_at = ? "
                                   "WHERE id = ? AND status = 'running'",
                                   (PROCESS_DIED, last_sign(run), run["id"]))
            except RegistryLocked:
                pass  # a reader must not fail for this; the next read records it
            for run in dead:
                run.update(status="failed", error=PROCESS_DIED, ended_at=last_sign(run), eta_s=None)
        for run in runs:
            del run["_pid_started"]
        return runs

    def _write(self, wait: bool = True):
        return self._transaction(write=True, wait=wait)

    def _read(self, single: bool = False):
        return self._transaction(write=False, single=single)

    @contextlib.contextmanager
    def _transaction(self, write: bool, wait: bool = True, single: bool = False) -> Iterator[sqlite3.Connection]:
        """A transaction; with `wait=False` a held lock fails at once instead of after `timeout`.
        `single`: one read statement, which SQLite runs as a transaction of its own."""
        try:
            db = self._connection()
            if not wait:
                db.execute("PRAGMA busy_timeout = 0")
            try:
                if single:
                    yield db
                else:
                    db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                    try:
                        yield db
                        db.execute("COMMIT")
                    except BaseException:
                        if db.in_transaction:
                            db.execute("ROLLBACK")
                        raise
            finally:
                if not self.keep_open:
                    db.close()
                elif not wait:
                    db.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
        except sqlite3.DatabaseError as error:
            translated = registry_error(error, self.path, self.timeout)
            if not isinstance(translated, RegistryLocked):  # e.g. a table gone: check the file again next time
                self._ready = False
                _checked.pop(self.path, None)
            if translated is None:
                raise
            if isinstance(translated, RegistryDamaged):
                self.close()  # reopen (maybe a fresh file) next time
            raise translated from error

    def _connection(self) -> sqlite3.Connection:
        # A kept connection serves while the path still names the file it opened: a registry kept
        # for the life of a process (a kernel's recorder keeps one per file) must not write on
        # into a file removed or replaced meanwhile (one os.stat, ~3 us, a transaction).
        identity = _identity(self.path)
        if not self._ready or identity is None or _checked.get(self.path) != identity:
            self._create()
            identity = _checked.get(self.path)
        if self.keep_open:
            owner = getattr(self._local, "owner", None)
            if owner is not None and owner[0] == os.getpid():
                if owner[2] == identity:
                    return owner[1]
                owner[1].close()  # the file it had open is gone from this path
        # isolation_level=None: we issue BEGIN ourselves; timeout is SQLite's busy_timeout.
        db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
        # WAL + NORMAL: no fsync at commit. A commit is in the WAL file (the OS's cache) when COMMIT
        # returns, so a process killed right after it loses nothing; only an OS crash or power cut
        # can take back the last commits, never corrupt the file (SQLite's WAL guarantee).
        db.execute("PRAGMA synchronous=NORMAL")
        if self.keep_open:
            self._local.owner = (os.getpid(), db, identity)
        return db

    def close(self) -> None:
        """Close this thread's connection (reopened on next use)."""
        owner = getattr(self._local, "owner", None)
        self._local.owner = None
        if owner is not None and owner[0] == os.getpid():
            owner[1].close()

    def _create(self) -> None:
        identity = _identity(self.path)
        if identity is not None and _checked.get(self.path) == identity:
            self._ready = True  # this process made or checked this very file: its tables are there
            return
        if self.path.is_dir():  # SQLite would only say "unable to open database file"
            raise RegistryDamaged(self.path, "is a directory, not an SQLite file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
        try:
            problem = _schema_problem(db)  # first: another program's database is left as it is
            if problem:
                raise RegistryDamaged(self.path, problem)
            enable_wal(db, self.timeout, self.path)
            db.executescript(_SCHEMA)
            _add_missing_columns(db)
        finally:
            db.close()
        self._ready = True
        _checked[self.path] = _identity(self.path)


def _field_values(fields: dict) -> dict:
    """`update`'s fields as the runs table stores them (validated), stamped with the time."""
    unknown = set(fields) - set(_UPDATABLE)
    if unknown:
        raise TypeError(f"Registry.update() got unknown fields {sorted(unknown)}; "
                        f"expected some of {list(_UPDATABLE)}")
    values = {key: (_dumps(value) if key == "latest" else json_safe(value)) for key, value in fields.items()}
    values["updated_at"] = time.time()
    return values


def _set_fields(db: sqlite3.Connection, run_id: str, values: dict, revive: bool = True) -> None:
    assignments = ", ".join(f"{key} = ?" for key in values)
    db.execute(f"UPDATE runs SET {assignments} WHERE id = ?", (*values.values(), run_id))
    if revive:
        _revive(db, run_id)


def _add_points(db: sqlite3.Connection, run_id: str, points: list, path: Path) -> None:
    row = db.execute("SELECT metric_seq, metric_stride FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is None:
        raise KeyError(f"no run {run_id!r} in {path}")
    seq, stride = row
    (count,) = db.execute("SELECT COUNT(*) FROM metrics WHERE run_id = ?", (run_id,)).fetchone()
    now = time.time()
    for step, metrics in points:
        # The previous point was kept only as "the newest"; drop it unless on the stride.
        if seq > 0 and (seq - 1) % stride:
            count -= db.execute("DELETE FROM metrics WHERE run_id = ? AND seq = ?", (run_id, seq - 1)).rowcount
        db.execute("INSERT INTO metrics (run_id, seq, t, step, data) VALUES (?, ?, ?, ?, ?)",
                   (run_id, seq, now, json_safe(step), _dumps(metrics)))
        count += 1
        if count > MAX_POINTS:
            stride *= 2
            count -= db.execute("DELETE FROM metrics WHERE run_id = ? AND seq % ? != 0 AND seq != ?",
                                (run_id, stride, seq)).rowcount
        seq += 1
    db.execute("UPDATE runs SET metric_seq = ?, metric_stride = ? WHERE id = ?", (seq, stride, run_id))


def _check_end(status: str | None) -> None:
    ends = [s for s in STATUSES if s not in ("queued", "running")]
    if status not in ends:
        raise GpunbError(f"Cannot finish a run with status {status!r}.",
                         "use one of " + ", ".join(f"`{s}`" for s in ends) + ".")


def _end(db: sqlite3.Connection, run_id: str, status: str, error: str | None, stop_reason: str | None) -> None:
    points = db.execute("SELECT data FROM metrics WHERE run_id = ?", (run_id,)).fetchall()
    best = best_values(json.loads(data) for (data,) in points)
    # A cancelled job's ranks die of their peers' end: what they say must not undo the cancel.
    db.execute("UPDATE runs SET status = ?, error = ?, ended_at = ?, best = ?, stop_reason = ? WHERE id = ? "
               f"AND NOT (status = 'cancelled' AND ? IN {_AFTER_CANCEL})",
               (status, error, time.time(), _dumps(best), stop_reason, run_id, status))
    db.execute("DELETE FROM stop_requests WHERE run_id = ?", (run_id,))


def _revive(db: sqlite3.Connection, run_id: str) -> None:
    """A run wrongly declared dead (a long silence on another host) comes back to life."""
    db.execute("UPDATE runs SET status = 'running', error = NULL, ended_at = NULL "
               "WHERE id = ? AND status = 'failed' AND error = ?", (run_id, PROCESS_DIED))


def _add_missing_columns(db: sqlite3.Connection) -> None:
    """Bring a registry written by an older gpunb up to this schema (columns only ever get added)."""
    present = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
    for column, kind in _ADDED_COLUMNS.items():
        if column in present:
            continue
        try:
            db.execute(f"ALTER TABLE runs ADD COLUMN {column} {kind}")
        except sqlite3.OperationalError as error:
            if "duplicate column" not in str(error):  # another process added it meanwhile
                raise


def _schema_problem(db: sqlite3.Connection) -> str | None:
    """What keeps this file's tables from being a run registry, or None when they are one (tables
    not there yet, and the columns that `_add_missing_columns` adds, may be missing)."""
    kinds = dict(db.execute("SELECT name, type FROM sqlite_master"))
    for table, columns in _expected_columns().items():
        if table not in kinds:
            continue  # created with the rest of the schema
        if kinds[table] != "table":
            return f"is not a run registry gpunb can use: `{table}` is a {kinds[table]}, not a table"
        present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        missing = [c for c in columns if c not in present and not (table == "runs" and c in _ADDED_COLUMNS)]
        if missing:
            listed = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            return (f"is not a run registry gpunb can use: table `{table}` lacks column(s) {listed} "
                    "(another program's database, or a damaged one)")
    return None


@functools.lru_cache(maxsize=1)
def _expected_columns() -> dict[str, list[str]]:
    """Each table's columns as _SCHEMA makes them (read back from a database in memory)."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(_SCHEMA)
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {table: [row[1] for row in db.execute(f"PRAGMA table_info({table})")] for table in tables}
    finally:
        db.close()


def best_values(points) -> dict:
    """Each validation metric's best value over `points` (dicts): the lowest loss or error, else the highest."""
    best: dict = {}
    for point in points:
        for name, value in point.items():
            if not name.startswith("val_") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            lower = any(word in name for word in _LOWER_IS_BETTER)
            if name not in best or (value < best[name] if lower else value > best[name]):
                best[name] = value
    return best


def _point(t: float, step: int, data: str) -> dict:
    point = {"t": t, "step": step, **json.loads(data)}
    point["t"], point["step"] = t, step  # a metric named "t" or "step" must not hide the real ones
    return point
