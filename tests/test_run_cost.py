"""What tracking a fit in the run registry costs the fit, pinned without timing: the record is
whole and on disk when `fit` returns (written by the fit itself, not left to the writer's thread),
no writer when tracking is off, one schema check per registry file and process, one writer thread
kept between fits, and a run's end that a locked registry held back is still written at exit; and
what a fit no longer does: open a connection after the process's first fit, read this process's
start time again, revive or read back a run it is ending, or fsync a commit."""

from __future__ import annotations

import multiprocessing
import sqlite3
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch
from test_runs import _until
from torch import nn

from gpunb import Trainer
from gpunb.config import TrainConfig
from gpunb.runs import Registry, RunRecorder, recorder, threads
from gpunb.runs import registry as registry_module


def _fit(track: bool, **options):
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    return Trainer(max_steps=12, epochs=100, batch_size=16, log_every=4, track=track, compile=False,
                   **options).fit(nn.Linear(4, 2), (x, y), loss_fn=nn.CrossEntropyLoss())


def _row(path, run_id) -> dict:
    # A connection of its own: what any other process would read once `fit` has returned.
    with sqlite3.connect(path) as db:
        db.row_factory = sqlite3.Row
        run = dict(db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone())
        run["steps"] = [step for (step,) in db.execute("SELECT step FROM metrics WHERE run_id = ? ORDER BY seq",
                                                       (run_id,))]
    return run


def test_a_tracked_fit_is_recorded_whole_when_it_returns_even_if_the_writers_thread_never_ran(
        gpunb_home, monkeypatch):
    # The writer's thread never runs here (as on a loaded machine that leaves it off a core): the fit
    # creates the row and writes its logs and its end itself, before it returns.
    monkeypatch.setattr("gpunb.runs.writer.run_in_thread", lambda work, name: None)
    _fit(track=True)
    path = gpunb_home / "runs.sqlite"
    with sqlite3.connect(path) as db:
        (run_id,) = db.execute("SELECT id FROM runs").fetchone()
    run = _row(path, run_id)
    assert (run["status"], run["step"], run["progress"]) == ("completed", 12, 1.0)
    assert run["ended_at"] is not None and run["steps"][-1] == 12 and 4 in run["steps"]


@pytest.mark.parametrize("error, status", [(KeyboardInterrupt(), "interrupted"), (ValueError("bad batch"), "failed")])
def test_a_fit_that_dies_before_its_row_was_made_is_still_recorded_with_its_end(tmp_path, monkeypatch, error, status):
    # The row is made lazily, by the writer's thread; here that thread never runs before the fit dies.
    monkeypatch.setattr("gpunb.runs.writer.run_in_thread", lambda work, name: None)
    from gpunb.runtime.events import FitState

    registry = Registry(tmp_path / "runs.sqlite")
    state = FitState(config=TrainConfig(name="dies"), model=None, optimizer=None, device="cpu", run_name="dies",
                     total_steps=10)
    rec = RunRecorder(registry)
    rec.on_fit_start(state)
    state.step = 3
    rec.on_log(state, {"loss": 0.5})
    rec.on_exception(state, error)
    run = registry.get_run(state.registry_run)
    assert (run["status"], run["step"], [p["step"] for p in run["history"]]) == (status, 3, [3])


def test_an_untracked_fit_starts_no_writer_and_makes_no_registry(gpunb_home, monkeypatch):
    def no_writer(*args, **kwargs):
        raise AssertionError("a writer was made for an untracked fit")

    monkeypatch.setattr(recorder, "RunWriter", no_writer)
    monkeypatch.setattr(registry_module.Registry, "_connection", no_writer)
    _fit(track=False)
    assert not (gpunb_home / "runs.sqlite").exists()


def test_a_registry_file_is_checked_once_a_process_and_again_once_replaced(tmp_path, monkeypatch):
    checks = []
    real = registry_module._schema_problem
    monkeypatch.setattr(registry_module, "_schema_problem", lambda db: (checks.append(1), real(db))[1])
    path = tmp_path / "runs.sqlite"
    Registry(path).start_run("a")
    Registry(path).list_runs()  # a recorder's second Registry on the same file, or the next fit's
    assert len(checks) == 1
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:  # another program's database, moved in its place
        db.execute("CREATE TABLE runs (x)")
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"runs.sqlite{suffix}").unlink(missing_ok=True)
    other.replace(path)
    with pytest.raises(registry_module.RegistryDamaged, match="lacks column"):
        Registry(path).list_runs()
    assert len(checks) == 2


def test_a_registry_whose_tables_went_is_made_again_at_the_next_use(tmp_path):
    path = tmp_path / "runs.sqlite"
    registry = Registry(path)
    registry.start_run("a")
    with sqlite3.connect(path) as db:  # the same file (same inode), its tables dropped
        db.executescript("DROP TABLE runs; DROP TABLE metrics; DROP TABLE stop_requests;")
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        registry.list_runs()
    assert Registry(path).list_runs() == [] and registry.list_runs() == []


def _recorded_run(registry: Registry, name: str) -> RunRecorder:
    from gpunb.runtime.events import FitState

    state = FitState(config=TrainConfig(name=name), model=None, optimizer=None, device="cpu", run_name=name,
                     total_steps=10)
    rec = RunRecorder(registry)
    rec.on_fit_start(state)
    assert rec.flush(10)
    state.step, state.result = 10, SimpleNamespace(interrupted=False, energy_j=None)
    rec.on_fit_end(state)
    return rec


def test_the_next_fit_writes_on_the_thread_the_last_one_left(tmp_path, monkeypatch):
    registry = Registry(tmp_path / "runs.sqlite")
    _recorded_run(registry, "first")
    _until(lambda: threads._idle)  # its thread waits for the next run

    class NoNewThread:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a new thread was started")

    monkeypatch.setattr(threads, "threading", SimpleNamespace(Thread=NoNewThread, Lock=threading.Lock,
                                                              current_thread=threading.current_thread))
    rec = _recorded_run(registry, "second")
    assert registry.get_run(rec.writer.run_id)["status"] == "completed"


def _child_records(path: str) -> None:
    rec = _recorded_run(Registry(path), "child")
    sys.exit(0 if Registry(path).get_run(rec.writer.run_id)["status"] == "completed" else 1)


def test_a_forked_child_does_not_hand_its_run_to_its_parents_threads(tmp_path):
    registry = Registry(tmp_path / "runs.sqlite")
    _recorded_run(registry, "parent")
    _until(lambda: threads._idle)
    child = multiprocessing.get_context("fork").Process(target=_child_records, args=(str(registry.path),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert registry.list_runs()[0]["name"] == "child"


def test_a_runs_end_that_a_locked_registry_held_back_past_its_fit_is_written_at_exit(tmp_path):
    path = tmp_path / "runs.sqlite"
    script = textwrap.dedent(f"""
        import sqlite3, threading, time
        from types import SimpleNamespace
        from gpunb.config import TrainConfig
        from gpunb.runtime.events import FitState
        from gpunb.runs import Registry, RunRecorder, recorder

        recorder.FINISH_WAIT_S = 0.1
        registry = Registry({str(path)!r}, timeout=0.05)
        state = FitState(config=TrainConfig(name="exit"), model=None, optimizer=None, device="cpu",
                         run_name="exit", total_steps=10)
        rec = RunRecorder(registry)
        rec.on_fit_start(state)
        assert rec.flush(10)
        holder = sqlite3.connect({str(path)!r}, isolation_level=None, check_same_thread=False)
        holder.execute("BEGIN IMMEDIATE")  # someone holds the write lock past the fit's end
        state.step, state.result = 10, SimpleNamespace(interrupted=False, energy_j=None)
        rec.on_fit_end(state)
        assert not rec.writer.finished.is_set()
        print(rec.writer.run_id, flush=True)
        # released while the interpreter exits: only a wait at exit lets the writer's (daemon) thread write it
        threading.Thread(target=lambda: (time.sleep(0.5), holder.execute("ROLLBACK")), daemon=True).start()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    run = Registry(path).get_run(done.stdout.strip())
    assert (run["status"], run["step"]) == ("completed", 10)
    assert "waiting up to" in done.stderr  # says why the exit waits


class _Traced:
    """Counts the registry's new connections (those of the training thread, this one, apart) and keeps
    each statement the training thread runs."""

    def __init__(self, monkeypatch):
        self.main = threading.get_ident()
        self.reset()
        connect = sqlite3.connect

        def traced(*args, **kwargs):
            self.connections += 1
            self.main_connections += threading.get_ident() == self.main
            db = connect(*args, **kwargs)
            db.set_trace_callback(lambda sql: self.statements.append(sql) if threading.get_ident() == self.main
                                  else None)
            return db

        monkeypatch.setattr(registry_module.sqlite3, "connect", traced)

    def reset(self) -> None:
        self.connections, self.main_connections, self.statements = 0, 0, []


def test_a_fit_after_the_first_opens_no_connection_to_the_registry(gpunb_home, monkeypatch):
    # An open and its first read of the schema cost ~0.3 ms; a fit made two (the writer's thread, the
    # training thread's stop reads and end). The process keeps one Registry per file, and with it
    # each thread's connection: the training thread's, and the writer's on its kept thread.
    traced, registries = _Traced(monkeypatch), []
    real = recorder.RunWriter
    monkeypatch.setattr(recorder, "RunWriter", lambda registry, *args, **kwargs: (
        registries.append(registry), real(registry, *args, **kwargs))[1])
    _fit(track=True)
    # The training thread connects at its first stop read or its run's end, unless the writer's
    # thread happened to be writing at each: connected here, as a longer fit would have.
    recorder.kept_registry(gpunb_home / "runs.sqlite", timeout=0.0).stop_requested("none")
    assert traced.main_connections == 1
    _until(lambda: threads._idle)  # the next fit's writer runs on a kept thread
    traced.reset()
    _fit(track=True)
    assert traced.main_connections == 0
    assert registries[0] is registries[1]  # the writer's thread finds its connection kept in it
    assert traced.connections <= 1  # (one only when the kept thread was another fit's)
    runs = Registry(gpunb_home / "runs.sqlite").list_runs()
    assert [run["status"] for run in runs] == ["completed", "completed"]


def test_a_registry_file_removed_between_fits_is_made_again_and_records_the_next_fit(gpunb_home):
    # The kept connections must not write on into the file the path no longer names.
    _fit(track=True)
    _until(lambda: threads._idle)
    for suffix in ("", "-wal", "-shm"):
        (gpunb_home / f"runs.sqlite{suffix}").unlink(missing_ok=True)
    _fit(track=True)
    runs = Registry(gpunb_home / "runs.sqlite").list_runs()
    assert [(run["status"], run["step"]) for run in runs] == [("completed", 12)]


def test_a_fits_end_runs_no_revival_and_no_stop_read_and_opens_nothing(gpunb_home, monkeypatch):
    # The writer's thread never runs: the fit writes its row, logs and end itself (the statements
    # counted are all of them). An end sets the status itself, and deletes the stop request it
    # would have read back.
    monkeypatch.setattr("gpunb.runs.writer.run_in_thread", lambda work, name: None)
    traced = _Traced(monkeypatch)
    _fit(track=True)
    traced.reset()
    _fit(track=True)
    sql = traced.statements
    assert traced.main_connections == 0 and not [s for s in sql if s.startswith("PRAGMA")]
    assert sql.count("BEGIN IMMEDIATE") == 2  # the row, then the logs and the end: nothing else
    assert not [s for s in sql if "FROM stop_requests WHERE" in s and s.startswith("SELECT")]
    assert not [s for s in sql if s.startswith("UPDATE runs SET status = 'running'")]  # registry._revive
    assert [s for s in sql if s.startswith("UPDATE runs SET status =")]  # the end, on this thread


def test_the_registry_commits_without_an_fsync_in_wal_mode(gpunb_home):
    # WAL + synchronous=NORMAL: a commit is in the WAL file (the OS's cache) when COMMIT returns, so a
    # process killed after `fit` returns loses nothing, without an fsync per commit (FULL's).
    _fit(track=True)
    db = recorder.kept_registry(gpunb_home / "runs.sqlite", timeout=0.0)._connection()  # the training thread's
    assert db.execute("PRAGMA synchronous").fetchone() == (1,)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_runs_row_asks_psutil_for_this_processs_start_once(tmp_path, monkeypatch):
    from gpunb.runs import liveness

    asked = []
    real = liveness.psutil.Process
    monkeypatch.setattr(liveness.psutil, "Process", lambda pid: (asked.append(pid), real(pid))[1])
    registry = Registry(tmp_path / "runs.sqlite")
    first = registry.start_run("a")
    before = len(asked)
    second = registry.start_run("b")
    assert len(asked) == before
    assert registry.get_run(first)["status"] == registry.get_run(second)["status"] == "running"


def test_the_stop_request_is_read_once_a_step_when_an_epoch_ends_at_a_log(tmp_path, monkeypatch):
    from gpunb.runtime.events import FitState

    registry = Registry(tmp_path / "runs.sqlite")
    state = FitState(config=TrainConfig(name="reads"), model=None, optimizer=None, device="cpu", run_name="reads",
                     total_steps=10)
    rec = RunRecorder(registry)
    rec.on_fit_start(state)
    assert rec.flush(10)  # the row exists: the training thread reads stop requests from now on
    reads = []
    real = rec._reader.stop_requested
    monkeypatch.setattr(rec._reader, "stop_requested", lambda run_id: (reads.append(state.step), real(run_id))[1])
    state.step = 4
    rec.on_log(state, {"loss": 0.5})
    rec.on_epoch_end(state, {"val_loss": 0.4})  # the same step: no second read
    assert reads == [4]
    registry.request_stop(state.registry_run)
    state.step = 8
    rec.on_log(state, {"loss": 0.3})
    assert reads == [4, 8] and state.stop_reason == "stopped from the sidebar"
    state.result = SimpleNamespace(interrupted=False, energy_j=None)
    rec.on_fit_end(state)
    assert registry.get_run(state.registry_run)["status"] == "stopped"


def test_a_log_reads_the_registry_for_a_stop_only_after_a_request_was_made(tmp_path, monkeypatch):
    # Each log looks at the registry's stop signal (one os.stat); it reads the registry (~0.1 ms in a
    # fit) at its first log and then only after a request, any run's, and the stop lands at that log.
    from gpunb.runtime.events import FitState

    registry = Registry(tmp_path / "runs.sqlite")
    other = registry.start_run("other")
    state = FitState(config=TrainConfig(name="looks"), model=None, optimizer=None, device="cpu", run_name="looks",
                     total_steps=100)
    rec = RunRecorder(registry)
    rec.on_fit_start(state)
    assert rec.flush(10)
    reads = []
    real = rec._reader.stop_requested
    monkeypatch.setattr(rec._reader, "stop_requested", lambda run_id: (reads.append(state.step), real(run_id))[1])

    def log_at(*steps):
        for state.step in steps:
            rec.on_log(state, {"loss": 1.0})

    log_at(2, 4, 6)
    assert reads == [2]  # the first: a request may have come before the fit
    assert registry.request_stop(other)
    log_at(8, 10)
    assert reads == [2, 8] and state.stop_reason is None  # another run's request: read, and not this run's
    assert registry.request_stop(state.registry_run)
    log_at(12)
    assert reads == [2, 8, 12] and state.stop_reason == "stopped from the sidebar"
    state.result = SimpleNamespace(interrupted=False, energy_j=None)
    rec.on_fit_end(state)
    assert registry.get_run(state.registry_run)["status"] == "stopped"
