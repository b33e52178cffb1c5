"""gpunb.runs: the SQLite run registry, the RunRecorder callback and the notebook views."""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import sqlite3
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from conftest import charts_in

from gpunb.config import TrainConfig
from gpunb.errors import GpunbError
from gpunb.runs import Registry, RunRecorder, compare, default_path, prune, recorder, remove, runs
from gpunb.runs import liveness
from gpunb.runs import registry as registry_module
from gpunb.runs import writer as writer_module
from gpunb.runs.journal import enable_wal

RUN_KEYS = {"id", "name", "notebook", "kernel_id", "pid", "host", "status", "config", "started_at",
            "ended_at", "updated_at", "progress", "step", "total_steps", "epoch", "eta_s", "latest",
            "device", "energy_j", "error", "best", "heartbeat_at", "stop_requested", "job", "stop_reason",
            "sweep"}


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GPUNB_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def registry(home) -> Registry:
    return Registry()


# ---------------------------------------------------------------------- location and schema
def test_registry_lives_in_gpunb_home_and_is_created_on_first_use(home):
    reg = Registry()
    assert reg.path == home / "runs.sqlite" == default_path()
    assert not reg.path.exists()
    reg.list_runs()
    assert reg.path.exists()
    with sqlite3.connect(reg.path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_switching_to_wal_retries_while_another_process_creates_the_file():
    class Busy:  # "database is locked" comes at once here, not after busy_timeout
        def __init__(self, failures):
            self.failures, self.calls = failures, 0

        def execute(self, sql):
            if "sqlite_master" in sql:
                return SimpleNamespace(fetchone=lambda: None)  # being created: no tables yet
            self.calls += 1
            if self.calls <= self.failures:
                raise sqlite3.OperationalError("database is locked")
            return SimpleNamespace(fetchone=lambda: ("wal",))

    twice = Busy(failures=2)
    enable_wal(twice, timeout=5.0)
    assert twice.calls == 3
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        enable_wal(Busy(failures=10**6), timeout=0.05)


def _without_wal(answer):
    """A sqlite3.connect whose connections answer the switch to WAL as a network file system does."""
    class NoWal(sqlite3.Connection):
        def execute(self, sql, *args):
            if sql == "PRAGMA journal_mode=WAL":
                if isinstance(answer, Exception):
                    raise answer
                return super().execute("SELECT ?", (answer,))
            return super().execute(sql, *args)

    real = sqlite3.connect
    return lambda *args, **kwargs: real(*args, factory=NoWal, **kwargs)


@pytest.mark.parametrize("answer", ["delete", sqlite3.OperationalError("disk I/O error"),
                                    sqlite3.OperationalError("locking protocol")])
def test_a_file_system_without_wal_gets_a_rollback_journal_and_one_warning(home, monkeypatch, answer):
    monkeypatch.setattr(registry_module.sqlite3, "connect", _without_wal(answer))
    monkeypatch.setattr("gpunb.runs.journal._warned_no_wal", set())
    with pytest.warns(UserWarning, match="cannot use SQLite's WAL journal") as caught:
        reg = Registry()
        run_id = reg.start_run("on-nfs")
        reg.add_metrics(run_id, 1, {"loss": 1.0})
        Registry().list_runs()  # a second registry object on the same file: no second warning
    assert len(caught) == 1
    assert "GPUNB_HOME" in str(caught[0].message) and str(reg.path) in str(caught[0].message)
    assert reg.get_run(run_id)["name"] == "on-nfs"
    monkeypatch.undo()
    with sqlite3.connect(reg.path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)


def test_an_unrelated_error_while_switching_to_wal_is_not_hidden(home, monkeypatch):
    monkeypatch.setattr(registry_module.sqlite3, "connect", _without_wal(sqlite3.OperationalError("no such thing")))
    with pytest.raises(sqlite3.OperationalError, match="no such thing"):
        Registry().list_runs()


@pytest.mark.parametrize("platform, env, expected", [
    ("linux", {"XDG_DATA_HOME": "xdg"}, "xdg/gpunb"),
    ("linux", {}, "home/.local/share/gpunb"),
    ("darwin", {"XDG_DATA_HOME": "xdg"}, "home/Library/Application Support/gpunb"),
    ("win32", {"APPDATA": "roaming"}, "roaming/gpunb"),
    ("win32", {}, "home/AppData/Roaming/gpunb"),
])
def test_registry_defaults_to_the_platform_data_dir(tmp_path, monkeypatch, platform, env, expected):
    # No jupyter_core involved: the core install has none, and the server asks the same function.
    from gpunb.runs import paths

    for name in ("GPUNB_HOME", "XDG_DATA_HOME", "APPDATA", "JUPYTER_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter"))  # ignored
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path / value))
    monkeypatch.setattr(paths.sys, "platform", platform)
    monkeypatch.setattr(paths.Path, "home", classmethod(lambda cls: tmp_path / "home"))
    assert default_path() == tmp_path / expected / "runs.sqlite"
    monkeypatch.setenv("GPUNB_HOME", str(tmp_path / "mine"))  # GPUNB_HOME wins everywhere
    assert default_path() == tmp_path / "mine" / "runs.sqlite"


def test_a_registry_an_earlier_gpunb_kept_in_jupyters_data_dir_stays_in_use(tmp_path, monkeypatch):
    from gpunb.runs import paths

    for name in ("GPUNB_HOME", "APPDATA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(paths.sys, "platform", "linux")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter"))
    assert default_path() == tmp_path / "data" / "gpunb" / "runs.sqlite"  # none anywhere: the new place
    earlier = tmp_path / "jupyter" / "gpunb" / "runs.sqlite"
    earlier.parent.mkdir(parents=True)
    earlier.touch()
    assert default_path() == earlier  # its runs stay listed
    new = tmp_path / "data" / "gpunb" / "runs.sqlite"
    new.parent.mkdir(parents=True)
    new.touch()
    assert default_path() == new  # once the new one exists it wins


def test_a_run_round_trips_as_json(registry, monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/train.ipynb")
    run_id = registry.start_run("mnist", config={"lr": 1e-3}, device="cuda:0", total_steps=100)
    registry.update(run_id, step=10, epoch=0, progress=0.1, eta_s=42.0, latest={"loss": 0.5})
    run = registry.get_run(run_id)
    assert set(run) == RUN_KEYS | {"history"}
    assert len(run_id) == 32 and int(run_id, 16) >= 0
    assert run["notebook"] == "/home/me/train.ipynb" and run["pid"] == os.getpid()
    assert run["kernel_id"] is None  # not in a kernel
    assert (run["status"], run["step"], run["latest"], run["config"]) == ("running", 10, {"loss": 0.5}, {"lr": 1e-3})
    registry.finish(run_id, "completed", energy_j=1234.5)
    run = registry.list_runs()[0]
    assert set(run) == RUN_KEYS
    assert (run["status"], run["energy_j"], run["eta_s"]) == ("completed", 1234.5, None)
    assert run["ended_at"] >= run["started_at"]
    json.dumps(run, allow_nan=False)


def test_kernel_id_comes_from_the_connection_file(registry, monkeypatch):
    connect = ModuleType("ipykernel.connect")
    connect.get_connection_file = lambda: "/run/user/1/jupyter/runtime/kernel-1f2e-33.json"
    monkeypatch.setitem(sys.modules, "ipykernel", ModuleType("ipykernel"))
    monkeypatch.setitem(sys.modules, "ipykernel.connect", connect)
    assert registry.get_run(registry.start_run("in-kernel"))["kernel_id"] == "1f2e-33"

    def not_a_kernel():
        raise RuntimeError("app not specified, and not in a running Kernel")

    connect.get_connection_file = not_a_kernel
    assert registry.get_run(registry.start_run("plain"))["kernel_id"] is None


def test_json_safety_of_config_and_metrics(registry):
    np = pytest.importorskip("numpy")  # imported here: the spawned writers import this module
    config = {"nan": math.nan, "inf": -math.inf, "tuple": (1, 2), "set": {3}, "path": Path("/x"),
              "fraction": Fraction(1, 3), "np": np.float32(0.5), "nested": {1: [np.int64(7)]}}
    run_id = registry.start_run("odd", config=config)
    registry.add_metrics(run_id, np.int64(3), {"loss": math.nan, "acc": np.float64(0.25), "step": -1})
    registry.update(run_id, latest={"loss": math.inf})
    run = registry.get_run(run_id)
    text = json.dumps(run, allow_nan=False)  # raises on NaN/inf or unknown objects
    assert run["config"] == {"nan": None, "inf": None, "tuple": [1, 2], "set": [3], "path": "/x",
                             "fraction": "1/3", "np": 0.5, "nested": {"1": [7]}}
    assert run["history"][0]["step"] == 3 and run["history"][0]["loss"] is None
    assert run["history"][0]["acc"] == 0.25 and run["latest"] == {"loss": None}
    assert "NaN" not in text


def test_bad_calls_say_what_to_do(registry):
    run_id = registry.start_run("x")
    with pytest.raises(GpunbError, match="HINT: use one of `completed`"):
        registry.finish(run_id, "done")
    with pytest.raises(TypeError, match="unknown fields \\['loss'\\]"):
        registry.update(run_id, loss=1.0)
    with pytest.raises(KeyError):
        registry.add_metrics("0" * 32, 1, {"loss": 1.0})


# ---------------------------------------------------------------------- downsampling
def test_metrics_are_thinned_evenly_and_keep_the_newest(registry, monkeypatch):
    monkeypatch.setattr(registry_module, "MAX_POINTS", 20)
    run_id = registry.start_run("long")
    for step in range(1000):
        registry.add_metrics(run_id, step, {"loss": 1.0 / (step + 1)})
    steps = [point["step"] for point in registry.get_run(run_id)["history"]]
    assert 10 <= len(steps) <= 21
    assert steps[0] == 0 and steps[-1] == 999
    assert len({b - a for a, b in zip(steps, steps[1:-1])}) == 1  # even spacing before the newest point


# ---------------------------------------------------------------------- stop requests
def test_stop_requests_only_reach_running_runs(registry):
    run_id = registry.start_run("x")
    assert registry.stop_requested(run_id) is False
    assert registry.request_stop(run_id) is True
    assert registry.stop_requested(run_id) is True and registry.get_run(run_id)["stop_requested"] is True
    registry.finish(run_id, "stopped")
    assert registry.stop_requested(run_id) is False  # cleared with the run
    assert registry.request_stop(run_id) is False
    assert registry.request_stop("f" * 32) is False


# ---------------------------------------------------------------------- stale runs
def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_run_whose_process_died_is_reported_failed(registry):
    dead = registry.start_run("dead", pid=_dead_pid())
    alive = registry.start_run("alive")
    by_name = {run["name"]: run for run in registry.list_runs()}
    assert (by_name["dead"]["status"], by_name["dead"]["error"]) == ("failed", "process died")
    assert by_name["alive"]["status"] == "running"
    with sqlite3.connect(registry.path) as db:  # written back, not only reported
        assert db.execute("SELECT status FROM runs WHERE id = ?", (dead,)).fetchone() == ("failed",)
    assert registry.get_run(alive)["status"] == "running"


def test_a_reused_pid_is_not_mistaken_for_the_run(registry):
    run_id = registry.start_run("reused")
    with sqlite3.connect(registry.path) as db:
        db.execute("UPDATE runs SET pid_started = pid_started - 3600 WHERE id = ?", (run_id,))
    assert registry.get_run(run_id)["status"] == "failed"


def test_runs_on_other_hosts_die_of_silence_and_come_back_when_they_write(registry):
    quiet = registry.start_run("quiet", host="elsewhere")
    recent = registry.start_run("recent", host="elsewhere")
    with sqlite3.connect(registry.path) as db:
        db.execute("UPDATE runs SET updated_at = updated_at - ? WHERE id = ?",
                   (registry_module.STALE_AFTER_S + 1, quiet))
    assert registry.get_run(quiet)["status"] == "failed"
    assert registry.get_run(recent)["status"] == "running"
    registry.update(quiet, step=5)  # it was only slow
    run = registry.get_run(quiet)
    assert (run["status"], run["error"], run["ended_at"]) == ("running", None, None)


# ---------------------------------------------------------------------- concurrency
def _writer(path: str, name: str, start, errors) -> None:
    try:
        reg = Registry(path)
        start.wait(30)  # all three processes go at once
        run_id = reg.start_run(name, total_steps=300)
        for step in range(300):
            reg.update(run_id, step=step, progress=step / 300, latest={"loss": 1.0 / (step + 1)})
            reg.add_metrics(run_id, step, {"loss": 1.0 / (step + 1)})
        reg.finish(run_id, "completed")
    except Exception as error:  # reported to the parent, which fails the test
        errors.put(f"{name}: {error!r}")


def test_two_writer_processes_and_a_reader_never_see_a_locked_database(tmp_path):
    path = str(tmp_path / "runs.sqlite")  # a fresh file: both writers also race to create it
    spawn = multiprocessing.get_context("spawn")
    start, errors = spawn.Barrier(3), spawn.Queue()
    writers = [spawn.Process(target=_writer, args=(path, name, start, errors)) for name in ("a", "b")]
    for process in writers:
        process.start()
    start.wait(30)
    reader, reads = Registry(path), 0
    while any(process.is_alive() for process in writers):
        try:
            for run in reader.list_runs():
                reader.get_run(run["id"])
            reads += 1
        except sqlite3.Error as error:
            errors.put(f"reader: {error!r}")
    for process in writers:
        process.join(30)
    problems = []
    while not errors.empty():
        problems.append(errors.get())
    assert problems == [] and [p.exitcode for p in writers] == [0, 0]
    done = {run["name"]: run for run in reader.list_runs()}
    assert sorted(done) == ["a", "b"] and reads > 0
    for run in done.values():
        assert (run["status"], run["step"]) == ("completed", 299)
        assert [p["step"] for p in reader.get_run(run["id"])["history"]] == list(range(300))


# ---------------------------------------------------------------------- RunRecorder
class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(recorder, "_now", fake)
    return fake


def _state(**overrides):
    # Imported here: gpunb.runtime loads torch, which the spawned writers need not pay for.
    from gpunb.runtime.events import FitState

    values = {"config": TrainConfig(name="demo", transforms=(abs,)), "model": None, "optimizer": None,
              "device": "cuda:0", "run_name": "demo", "total_steps": 100}
    return FitState(**(values | overrides))


def _recorded(registry: Registry, state) -> dict:
    return registry.get_run(state.registry_run)


def test_recorder_creates_the_row_at_fit_start(registry, clock):
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    assert rec.flush(10)
    run = _recorded(registry, state)
    assert (run["name"], run["status"], run["device"], run["total_steps"]) == ("demo", "running", "cuda:0", 100)
    assert run["config"]["transforms"] == ["abs"] and run["config"]["batch_size"] == 64


def test_recorder_writes_at_most_once_a_second(registry, clock, monkeypatch):
    writes = []  # the fields of each write
    real_record = registry.record
    monkeypatch.setattr(registry, "record", lambda run_id, fields, *a: (writes.append(fields),
                                                                        real_record(run_id, fields, *a))[1])
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    for step in range(1, 51):  # fifty logs within the same second
        state.step = step
        rec.on_log(state, {"loss": 1.0 / step})
        clock.now += 0.01
    assert rec.flush(10)
    assert len(writes) == 1 and writes[0]["step"] == 1  # the first log is always written
    assert [p["step"] for p in _recorded(registry, state)["history"]] == [1]
    clock.now += 1.0
    state.step = 51
    rec.on_log(state, {"loss": 0.01})
    assert rec.flush(10)
    run = _recorded(registry, state)
    steps = [p["step"] for p in run["history"]]
    # Still one write a second, but the rows logged in between are kept (thinned), not lost.
    assert len(writes) == 2 and steps[0] == 1 and steps[-1] == 51
    assert 10 <= len(steps) <= 1 + recorder.POINTS_PER_WRITE and steps == sorted(set(steps))
    assert run["latest"] == {"loss": 0.01} and run["progress"] == 0.51


def test_recorder_writes_the_runtimes_eta_counted_down(registry, clock):
    # One ETA, the runtime's (runtime/eta.py): the sidebar gets what the dashboard shows.
    state, rec = _state(step=10), RunRecorder(registry)
    rec.on_fit_start(state)
    state.eta = (80.0, time.time() - 2.0)  # estimated 2 s ago
    rec.on_log(state, {"loss": 1.0})
    assert rec.flush(10)
    assert _recorded(registry, state)["eta_s"] == pytest.approx(78.0, abs=0.5)


def test_stop_request_round_trip(registry, clock):
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    state.step = 1
    rec.on_log(state, {"loss": 1.0})
    assert rec.flush(10) and state.stop_reason is None
    assert registry.request_stop(state.registry_run) is True
    clock.now += 1.5
    state.step = 2
    rec.on_log(state, {"loss": 0.9})
    assert state.stop_reason == "stopped from the sidebar"
    state.result = SimpleNamespace(interrupted=False, energy_j=99.0)
    rec.on_fit_end(state)
    assert rec.flush(10)  # the end is written in the background (fit waits 2 s at most)
    run = _recorded(registry, state)
    assert (run["status"], run["energy_j"], run["stop_requested"]) == ("stopped", 99.0, False)
    assert run["stop_reason"] == "stopped from the sidebar"  # the sidebar's card says why


def test_a_long_log_interval_still_gets_heartbeats_and_stop_checks(registry, clock):
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    assert rec.flush(10)
    registry.request_stop(state.registry_run)
    _until(lambda: rec.writer.stop_requested)
    clock.now += recorder.HEARTBEAT_S
    state.step = 7
    rec.on_step_end(state)
    assert rec.flush(10)
    assert state.stop_reason == "stopped from the sidebar" and _recorded(registry, state)["step"] == 7


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_writer_whose_fit_never_reported_its_end_ends_the_run_as_failed(registry, clock):
    import gc

    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    writer, run_id = rec.writer, state.registry_run
    assert writer.flush(10)
    del rec  # the fit raised past its callbacks: the recorder is gone, its on_fit_end never ran
    gc.collect()
    assert writer.finished.wait(10)
    run = registry.get_run(run_id)
    assert (run["status"], run["error"]) == ("failed", writer_module.ABANDONED)


def test_a_live_run_removed_by_another_host_is_recorded_again(registry, clock, monkeypatch):
    monkeypatch.setattr(writer_module, "HEARTBEAT_EVERY_S", 0.1)
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    assert rec.flush(10)
    run_id = rec.run_id
    with sqlite3.connect(registry.path) as db:  # a host that took it for dead removed it
        db.execute("DELETE FROM runs WHERE id = ?", (run_id,))
    assert registry.get_run(run_id, with_history=False) is None
    _until(lambda: registry.get_run(run_id, with_history=False) is not None)
    state.result = SimpleNamespace(interrupted=False, energy_j=None)
    rec.on_fit_end(state)
    assert rec.flush(10) and registry.get_run(run_id)["status"] == "completed"


@pytest.mark.parametrize("interrupted, reason, status", [
    (False, None, "completed"), (True, "interrupted", "interrupted"), (True, "loss is NaN", "stopped")])
def test_final_status(registry, clock, interrupted, reason, status):
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    state.step = 100
    rec.on_log(state, {"loss": 1.0})
    clock.now += 0.1
    rec.on_log(state, {"loss": 0.25})  # throttled, but flushed at the end
    state.stop_reason = reason
    state.result = SimpleNamespace(interrupted=interrupted, energy_j=None)
    rec.on_fit_end(state)
    assert rec.flush(10)  # the end is written in the background (fit waits 2 s at most)
    run = _recorded(registry, state)
    assert (run["status"], run["latest"], run["progress"]) == (status, {"loss": 0.25}, 1.0)
    assert run["history"][-1]["loss"] == 0.25 and run["ended_at"] is not None
    assert run["stop_reason"] == reason


def test_an_exception_is_recorded_as_failed_with_its_first_line(registry, clock):
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    rec.on_exception(state, ValueError("shapes do not match\n  long traceback detail"))
    assert rec.flush(10)  # the end is written in the background (fit waits 2 s at most)
    run = _recorded(registry, state)
    assert (run["status"], run["error"]) == ("failed", "ValueError: shapes do not match")


def test_only_rank_zero_records_and_only_when_tracking(registry, clock):
    for state in (_state(rank=1), _state(config=TrainConfig(track=False))):
        rec = RunRecorder(registry)
        rec.on_fit_start(state)
        rec.on_log(state, {"loss": 1.0})
        state.result = SimpleNamespace(interrupted=False, energy_j=None)
        rec.on_fit_end(state)
        assert state.registry_run is None
    assert registry.list_runs() == []


def test_registry_failures_never_break_training(tmp_path, clock, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    state, rec = _state(), RunRecorder(Registry(blocker / "runs.sqlite"))
    with caplog.at_level(logging.WARNING, logger="gpunb.runs.recorder"):
        rec.on_fit_start(state)
        rec.on_log(state, {"loss": 1.0})
        state.result = SimpleNamespace(interrupted=False, energy_j=None)
        rec.on_fit_end(state)
    assert state.stop_reason is None and rec.writer.finished.is_set()  # gave up at the end
    assert len(caplog.records) == 1 and "could not write to the run registry" in caplog.text


def _hold_write_lock(path) -> sqlite3.Connection:
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # e.g. someone browsing the file with a write lock
    return holder


def test_a_locked_registry_never_delays_training_and_the_run_is_recorded_when_it_clears(home, caplog):
    registry = Registry(timeout=0.05)
    registry.list_runs()  # the file exists
    holder = _hold_write_lock(registry.path)
    state, rec = _state(), RunRecorder(registry)
    with caplog.at_level(logging.WARNING, logger="gpunb.runs.recorder"):
        started = time.perf_counter()
        rec.on_fit_start(state)
        state.step = 1
        rec.on_log(state, {"loss": 1.0})
        hooks_took = time.perf_counter() - started
        assert not rec.flush(0.5)  # nothing could be written yet
        assert registry.get_run(state.registry_run) is None
        holder.execute("ROLLBACK")
        holder.close()
        assert rec.flush(10)
    assert hooks_took < 1.0  # the hooks only hand data to the writer thread (a held lock used to stall them for seconds)
    run = registry.get_run(state.registry_run)
    assert (run["status"], run["step"], [p["step"] for p in run["history"]]) == ("running", 1, [1])
    assert len(caplog.records) == 1 and "is locked by another process" in caplog.text


def test_the_end_of_a_run_is_written_in_the_background_if_the_lock_outlasts_the_fit(home, caplog, monkeypatch):
    monkeypatch.setattr(recorder, "FINISH_WAIT_S", 0.1)
    registry = Registry(timeout=0.05)
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    assert rec.flush(10)
    holder = _hold_write_lock(registry.path)
    state.step, state.result = 100, SimpleNamespace(interrupted=False, energy_j=None)
    with caplog.at_level(logging.WARNING, logger="gpunb.runs.recorder"):
        rec.on_fit_end(state)  # returns after FINISH_WAIT_S
        assert not rec.writer.finished.is_set()
        assert registry.get_run(state.registry_run)["status"] == "running"
        holder.execute("ROLLBACK")
        holder.close()
        assert rec.writer.flush(10)
    run = registry.get_run(state.registry_run)
    assert (run["status"], run["step"]) == ("completed", 100)
    assert len(caplog.records) == 1 and "as soon as the registry is free" in caplog.text


def test_a_damaged_registry_is_named_with_the_way_to_recover(home, clock, caplog):
    from gpunb.runs import RegistryDamaged

    home.mkdir()
    path = home / "runs.sqlite"
    path.write_bytes(b"this is not an SQLite file " * 100)
    with pytest.raises(RegistryDamaged, match="run registry .*runs.sqlite is damaged") as error:
        runs()
    assert error.value.path == path and f"mv '{path}' '{path}.damaged'" in str(error.value)
    state, rec = _state(), RunRecorder()  # training goes on with one warning
    with caplog.at_level(logging.WARNING, logger="gpunb.runs.recorder"):
        rec.on_fit_start(state)
        rec.on_log(state, {"loss": 1.0})
        state.result = SimpleNamespace(interrupted=False, energy_j=None)
        rec.on_fit_end(state)
    assert state.stop_reason is None and len(caplog.records) == 1 and "is damaged" in caplog.text
    path.rename(home / "runs.sqlite.damaged")  # the recovery the message gives
    assert repr(runs()) == "No runs recorded yet."


@pytest.mark.parametrize("foreign", [
    "directory",
    "CREATE TABLE runs (x INTEGER)",  # another program's table of the same name
    "CREATE TABLE metrics (x INTEGER)",
    "CREATE VIEW runs AS SELECT 1 AS id",
])
def test_a_registry_that_is_a_directory_or_another_programs_database_is_named_with_the_way_to_recover(
        home, foreign):
    from gpunb.runs import RegistryDamaged

    path = home / "runs.sqlite"
    if foreign == "directory":
        path.mkdir(parents=True)
    else:
        home.mkdir()
        with sqlite3.connect(path) as db:
            db.execute(foreign)
        tables_before = path.read_bytes()
    for call in (lambda: runs(), lambda: Registry().start_run("x")):
        with pytest.raises(RegistryDamaged, match=r"run registry .*runs.sqlite (is a directory|is not a run registry)"
                                                  r"(.|\n)*HINT: move it aside") as error:
            call()
        assert error.value.path == path and f"mv '{path}' '{path}.damaged'" in str(error.value)
    if foreign != "directory":
        assert path.read_bytes() == tables_before  # another program's database is left as it was
    path.rename(home / "runs.sqlite.damaged")  # the recovery the message gives
    assert repr(runs()) == "No runs recorded yet."


@pytest.mark.parametrize("journal", ["wal", "delete"])  # delete: where WAL cannot work (NFS, Lustre)
def test_reading_runs_never_waits_for_another_process_holding_the_write_lock(home, journal):
    registry = Registry()  # the default wait for a writer's lock (5 s)
    dead = registry.start_run("orphan", pid=2**22 + 12345)  # no such process: a read marks it failed
    registry.close()
    with sqlite3.connect(registry.path) as db:
        assert db.execute(f"PRAGMA journal_mode={journal}").fetchone() == (journal,)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        f"db = sqlite3.connect({str(registry.path)!r}, isolation_level=None)\n"
        "db.execute('BEGIN IMMEDIATE')\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        started = time.perf_counter()
        (run,) = runs()  # a fresh Registry, as `gpunb.runs()` makes
        took = time.perf_counter() - started
    finally:
        holder.kill()
        holder.wait()
    assert took < 2.0  # hang-type bound: it used to wait out the 5 s busy timeout (to mark the dead run; to
    # switch a rollback-journal file to WAL)
    assert (run["id"], run["status"], run["error"]) == (dead, "failed", "process died")
    runs()  # the lock is free: this read writes the verdict down
    with sqlite3.connect(registry.path) as db:
        assert db.execute("SELECT status FROM runs WHERE id = ?", (dead,)).fetchone() == ("failed",)


def test_runs_read_under_a_held_write_lock_and_explain_a_lock_that_blocks_reads(home):
    from gpunb.runs import RegistryLocked

    registry = Registry(timeout=0.1)
    run_id = registry.start_run("orphan", pid=2**22 + 12345)  # no such process: failed when read
    holder = _hold_write_lock(registry.path)
    (run,) = runs(registry=registry)  # WAL: readers go on; marking it failed waits for the next read
    assert (run["id"], run["status"]) == (run_id, "failed")
    holder.execute("ROLLBACK")
    registry.close()
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")  # a holder that shuts readers out too
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("UPDATE runs SET step = 1")
    with pytest.raises(RegistryLocked, match=r"(?s)runs.sqlite is locked: .*more than 0.1 s.*try again"):
        runs(registry=registry)
    holder.execute("ROLLBACK")
    holder.close()


# ---------------------------------------------------------------------- views
@pytest.fixture
def two_runs(registry, monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield _make_runs(registry)
    monkeypatch.delenv("TZ")
    time.tzset()


def _make_runs(registry: Registry) -> tuple[str, str]:
    base = registry.start_run("base<line>", device="cuda:0", total_steps=100)
    for step in range(0, 101, 10):
        registry.add_metrics(base, step, {"loss": 2.0 / (step + 1)})
    registry.update(base, step=100, latest={"loss": 0.0198})
    registry.finish(base, "completed")
    fast = registry.start_run("fast", device="cuda:1", total_steps=1000)
    for step in range(0, 50, 10):
        registry.add_metrics(fast, step, {"loss": 1.0 - step / 100})
    registry.update(fast, step=40, latest={"loss": 0.6})
    with sqlite3.connect(registry.path) as db:  # fixed times, so the text is exact
        db.execute("UPDATE runs SET started_at = 1700000000, updated_at = 1700000065.4, "
                   "ended_at = 1700000065.4 WHERE id = ?", (base,))
        db.execute("UPDATE runs SET started_at = 1700003600, updated_at = 1700007512 WHERE id = ?", (fast,))
    return base, fast


def test_runs_table_text_is_exact_and_stable(two_runs, registry):
    table = runs(registry=registry)
    assert repr(table) == (
        "name        status     started           duration  steps     last loss  device\n"
        "----------  ---------  ----------------  --------  --------  ---------  ------\n"
        "fast        running    2023-11-14 23:13  1h 05m    40/1,000  0.6        cuda:1\n"
        "base<line>  completed  2023-11-14 22:13  1m 05s    100       0.0198     cuda:0")
    assert repr(runs(registry=registry)) == repr(table)
    assert len(table) == 2 and table[0]["name"] == "fast"


def test_runs_table_html_escapes_names(two_runs, registry):
    page = runs(registry=registry)._repr_html_()
    assert "base&lt;line&gt;" in page and "<line>" not in page
    assert page.count("<tr") == 3 and "completed" in page


def test_runs_default_to_gpunb_home_and_say_when_empty(registry):
    assert repr(runs()) == "No runs recorded yet." and "No runs" in runs()._repr_html_()


def test_compare_overlays_curves(two_runs, registry):
    _, fast = two_runs
    chart = compare("base<line>", fast[:8], registry=registry)
    assert repr(chart) == (
        "loss by step\n"
        "run         points  first  min     max  final   steps\n"
        "----------  ------  -----  ------  ---  ------  -----\n"
        "base<line>  11      2      0.0198  2    0.0198  0-100\n"
        "fast        5       1      0.6     1    0.6     0-40")
    markup = chart._repr_html_()
    assert markup.startswith("<img") and "<svg" not in markup  # an image: kept by untrusted front ends
    (svg,) = charts_in(markup)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert svg.count("<polyline") == 2 and "base&lt;line&gt;" in svg and "(log)" in svg  # 2 .. 0.0198
    assert markup == compare("base<line>", fast[:8], registry=registry)._repr_html_()


def test_compare_a_metric_nobody_logged(two_runs, registry):
    chart = compare("fast", metric="val_acc", registry=registry)
    assert "No val_acc values recorded" in "".join(charts_in(chart._repr_html_()))
    assert repr(chart).splitlines()[-1].split() == ["fast", "0", "-", "-", "-", "-", "-"]


def test_compare_explains_unknown_names(registry):
    with pytest.raises(GpunbError, match="No run named 'nope'.*\nHINT: `gpunb.runs.runs\\(\\)` lists"):
        compare("nope", registry=registry)
    with pytest.raises(GpunbError, match="needs at least one run"):
        compare(registry=registry)


def test_gpunb_runs_is_callable_even_after_the_package_is_imported():
    import gpunb
    import gpunb.runs  # binds the subpackage on `gpunb`

    assert isinstance(gpunb.runs(), gpunb.runs.RunTable)
    assert gpunb.compare is gpunb.runs.compare


def test_a_stop_request_is_seen_at_the_next_log_interval_even_between_writes(registry, clock):
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    state.step = 1
    rec.on_log(state, {"loss": 1.0})  # the first log: written
    assert rec.flush(10)
    registry.request_stop(rec.run_id)
    clock.now += 0.1  # well inside the one-second write throttle
    state.step = 2
    rec.on_log(state, {"loss": 0.9})
    assert state.stop_reason == "stopped from the sidebar"
    assert rec.flush(10) and registry.get_run(rec.run_id)["step"] == 1  # inside the throttle: no write


# ---------------------------------------------------------------------- best values, series, removal
def test_finish_records_each_validation_metrics_best_value(registry):
    run_id = registry.start_run("val")
    for step, loss, acc in [(1, 0.9, 0.5), (2, 0.4, 0.8), (3, 0.6, 0.7)]:
        registry.add_metrics(run_id, step, {"loss": loss, "val_loss": loss, "val_acc": acc, "val_err": 1 - acc})
    assert registry.get_run(run_id)["best"] == {}  # set at the end
    registry.finish(run_id, "completed")
    assert registry.get_run(run_id)["best"] == {"val_loss": 0.4, "val_acc": 0.8, "val_err": pytest.approx(0.2)}


def test_an_older_registry_gains_the_new_column(home):
    home.mkdir()
    path = home / "runs.sqlite"
    with sqlite3.connect(path) as db:  # the schema before `best`
        db.execute("CREATE TABLE runs (id TEXT PRIMARY KEY, name TEXT, notebook TEXT, kernel_id TEXT, "
                   "pid INTEGER, pid_started REAL, host TEXT, status TEXT NOT NULL, config TEXT, "
                   "started_at REAL, ended_at REAL, updated_at REAL, progress REAL, step INTEGER, "
                   "total_steps INTEGER, epoch INTEGER, eta_s REAL, latest TEXT, device TEXT, energy_j REAL, "
                   "error TEXT, metric_seq INTEGER NOT NULL DEFAULT 0, metric_stride INTEGER NOT NULL DEFAULT 1)")
        db.execute("INSERT INTO runs (id, name, status, started_at) VALUES ('a' , 'old', 'completed', 1.0)")
    (run,) = Registry().list_runs()
    assert (run["name"], run["best"], run["heartbeat_at"]) == ("old", {}, None)
    assert Registry().heartbeat("a") and Registry().get_run("a")["heartbeat_at"] == pytest.approx(time.time(), abs=60)


def test_list_runs_can_carry_the_newest_losses_of_running_runs(registry, monkeypatch):
    monkeypatch.setattr(registry_module, "SERIES_POINTS", 3)
    running = registry.start_run("running")
    done = registry.start_run("done")
    for step in range(5):
        registry.add_metrics(running, step, {"loss": 1.0 / (step + 1)} if step != 3 else {"val_acc": 0.5})
        registry.add_metrics(done, step, {"loss": 1.0})
    registry.finish(done, "completed")
    by_name = {run["name"]: run for run in registry.list_runs(series=True)}
    assert by_name["running"]["losses"] == [[2, 1 / 3], [4, 0.2]]  # the newest 3 points, losses only
    assert "losses" not in by_name["done"] and "losses" not in registry.list_runs()[0]


def test_remove_deletes_finished_runs_by_name_or_id(registry):
    base = registry.start_run("base")
    registry.add_metrics(base, 1, {"loss": 1.0})
    registry.finish(base, "completed")
    live = registry.start_run("live")
    with pytest.raises(GpunbError, match=rf"Cannot remove 'live' \(process {os.getpid()} on this host\): still "
                                         "running.*\nHINT: stop it first"):
        remove("live", registry=registry)
    with pytest.raises(GpunbError, match="No run named 'nope'"):
        remove("base", "nope", registry=registry)  # refused before anything is removed
    assert registry.get_run(base) is not None
    with pytest.raises(GpunbError, match="needs at least one run"):
        remove(registry=registry)
    assert remove("base", registry=registry) == 1
    assert [run["id"] for run in registry.list_runs()] == [live]
    with sqlite3.connect(registry.path) as db:
        assert db.execute("SELECT COUNT(*) FROM metrics WHERE run_id = ?", (base,)).fetchone() == (0,)


def test_prune_keeps_the_newest_and_the_recent_finished_runs_and_every_running_one(registry):
    day = 86400
    ids = {}
    for name, age_days in [("a", 40), ("b", 20), ("c", 10), ("d", 1)]:
        ids[name] = registry.start_run(name, started_at=time.time() - age_days * day)
        registry.finish(ids[name], "completed")
    ids["old-live"] = registry.start_run("old-live", started_at=time.time() - 50 * day)
    names = lambda: sorted(run["name"] for run in registry.list_runs())  # noqa: E731
    with pytest.warns(UserWarning, match=rf"prune\(\) kept 'old-live' \(process {os.getpid()} on this host\): "
                                         "still running.*HINT: stop it first"):
        assert prune(older_than_days=30, registry=registry) == 1 and names() == ["b", "c", "d", "old-live"]
    assert prune(keep=2, registry=registry) == 1 and names() == ["c", "d", "old-live"]
    with pytest.warns(UserWarning, match="kept 'old-live'"):
        assert prune(keep=5, older_than_days=5, registry=registry) == 1 and names() == ["d", "old-live"]
    with pytest.raises(GpunbError, match="needs `older_than_days`, `keep`, or both"):
        prune(registry=registry)
    with pytest.raises(GpunbError, match="must be >= 0"):
        prune(keep=-1, registry=registry)


def test_one_duration_format_for_progress_eta_and_the_run_table():
    from gpunb.render import format_duration as in_progress_line
    from gpunb.units import format_duration

    assert in_progress_line is format_duration
    assert [format_duration(s) for s in (0, 4.6, 59.4, 65, 725, 3600, 3725.0, 90061)] == \
        ["0s", "5s", "59s", "1m 05s", "12m 05s", "1h 00m", "1h 02m", "25h 01m"]


def test_the_stop_check_never_waits_for_a_registry_that_shuts_readers_out(home, clock):
    registry = Registry(timeout=0.05, keep_open=False)  # no connection stays open: the holder can lock all out
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    assert rec.flush(10)
    registry.request_stop(rec.run_id)
    holder = sqlite3.connect(registry.path, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("UPDATE runs SET step = 1")
    try:
        started = time.perf_counter()
        state.step = 1
        rec.on_log(state, {"loss": 1.0})  # the write waits in the writer thread; the read fails at once
        took = time.perf_counter() - started
        assert state.stop_reason is None
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert took < 1.0  # never the lock holder's seconds
    assert rec.flush(10)
    clock.now += 0.1
    rec.on_log(state, {"loss": 0.9})
    assert state.stop_reason == "stopped from the sidebar"


# ---------------------------------------------------------------------- liveness across hosts
@pytest.fixture
def hostname(monkeypatch) -> list:
    """The host name this process reports (item 0), switchable mid-test to play another host."""
    name = ["gpu-a"]
    monkeypatch.setattr(registry_module.socket, "gethostname", lambda: name[0])
    return name


def test_a_run_in_a_long_step_stays_alive_for_a_prune_from_another_host(registry, hostname, monkeypatch):
    # A step longer than the staleness window; the run's own thread stamps its heartbeat meanwhile.
    monkeypatch.setattr(liveness, "STALE_AFTER_S", 1.0)
    monkeypatch.setattr(writer_module, "HEARTBEAT_EVERY_S", 0.1, raising=False)
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    state.step = 1
    rec.on_log(state, {"loss": 1.0})
    assert rec.flush(10)
    time.sleep(1.5)  # the long step: the training thread calls nothing
    hostname[0] = "gpu-b"  # another host, sharing the registry (home on NFS)
    with pytest.warns(UserWarning, match=r"prune\(\) kept 'demo' \(on host gpu-a, last heartbeat 0 s ago\): "
                                         "still running"):
        assert prune(older_than_days=0, keep=0, registry=Registry(registry.path)) == 0
    assert registry.get_run(state.registry_run)["status"] == "running"
    with pytest.raises(GpunbError, match=r"Cannot remove 'demo' \(on host gpu-a, last heartbeat \d s ago\)"):
        remove("demo", registry=Registry(registry.path))
    state.step = 2  # training goes on, and its record with it
    rec.on_log(state, {"loss": 0.5})
    state.result = SimpleNamespace(interrupted=False, energy_j=None)
    rec.on_fit_end(state)
    assert rec.flush(10)
    run = registry.get_run(state.registry_run)
    assert (run["status"], [p["step"] for p in run["history"]]) == ("completed", [1, 2])


def test_the_heartbeat_is_stamped_by_the_writer_thread_only_while_nothing_else_is_written(registry, monkeypatch):
    monkeypatch.setattr(writer_module, "HEARTBEAT_EVERY_S", 0.05, raising=False)
    beats = []
    real = registry.heartbeat
    monkeypatch.setattr(registry, "heartbeat",
                        lambda run_id: beats.append((run_id, threading.current_thread().name)) or real(run_id))
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    assert rec.flush(10)
    deadline = time.monotonic() + 10
    while len(beats) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(beats) == {(rec.run_id, f"gpunb-run-{rec.run_id[:8]}")} and len(beats) >= 3  # the writer's thread
    registry.request_stop(rec.run_id)  # a heartbeat also brings a stop request in
    deadline = time.monotonic() + 10
    while not rec.writer.stop_requested and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rec.writer.stop_requested
    state.result = SimpleNamespace(interrupted=False, energy_j=None)
    rec.on_fit_end(state)
    assert rec.flush(10) and rec.writer.finished.is_set()
    count = len(beats)
    time.sleep(0.3)
    assert len(beats) == count  # a finished run's thread has ended: no more heartbeats


def test_remove_keeps_a_run_taken_for_dead_whose_heartbeat_is_fresh_and_says_why(registry, hostname):
    run_id = registry.start_run("slow", host="gpu-a")
    with sqlite3.connect(registry.path) as db:  # judged dead by a host whose clock runs ahead
        db.execute("UPDATE runs SET status = 'failed', error = 'process died', heartbeat_at = ? WHERE id = ?",
                   (time.time(), run_id))
    hostname[0] = "gpu-b"
    assert registry.remove([run_id]) == []  # judged again in the deleting transaction
    with pytest.warns(UserWarning, match=r"remove\(\) kept 'slow' \(on host gpu-a, last heartbeat 0 s ago\)"):
        assert remove("slow", registry=registry) == 0
    assert registry.heartbeat(run_id) and registry.get_run(run_id)["status"] == "running"  # it was alive
    assert registry.heartbeat("0" * 32) is False  # no such run
    with sqlite3.connect(registry.path) as db:  # silent for longer than the window: now it goes
        db.execute("UPDATE runs SET updated_at = 0, heartbeat_at = 0 WHERE id = ?", (run_id,))
    assert registry.get_run(run_id)["status"] == "failed"
    assert registry.remove([run_id]) == [run_id] and registry.get_run(run_id) is None


def test_a_stop_request_lands_at_the_next_step_however_long_the_log_interval(registry, clock):
    # The writer's thread reads the request within STOP_POLL_S; the step only reads an attribute.
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    state.step = 1
    rec.on_log(state, {"loss": 1.0})
    assert rec.flush(10)
    registry.request_stop(state.registry_run)
    deadline = time.monotonic() + 10
    while state.stop_reason is None and time.monotonic() < deadline:
        state.step += 1  # steps without a log, within the same second of the fake clock
        rec.on_step_end(state)
        time.sleep(0.01)
    assert state.stop_reason == "stopped from the sidebar"
    assert time.monotonic() < deadline - 10 + 3.0  # a few polls, even on a loaded machine


def test_a_stop_whose_signal_cannot_be_written_still_lands_with_the_runs_next_write(registry, monkeypatch):
    # The signal's file is a directory here, so appending to it fails: the request is in the
    # registry all the same, the logs see no signal, and the writer's next write (once a second)
    # reads the request back.
    from gpunb.runs.stop_signal import signal_path

    signal_path(registry.path).mkdir(parents=True)
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    assert rec.flush(10)  # the row exists
    reads = []
    real = rec._reader.stop_requested
    monkeypatch.setattr(rec._reader, "stop_requested", lambda run_id: (reads.append(state.step), real(run_id))[1])
    for state.step in (1, 2):
        rec.on_log(state, {"loss": 1.0})
    assert rec.flush(10)
    assert registry.request_stop(state.registry_run) and registry.stop_requested(state.registry_run)
    state.step = 3
    rec.on_log(state, {"loss": 1.0})
    assert reads == [1]  # the first log's read; no signal since, so no read at the third
    deadline = time.monotonic() + 10
    while state.stop_reason is None and time.monotonic() < deadline:
        state.step += 1
        rec.on_log(state, {"loss": 1.0})  # logs every 20 ms: the writer's polls wait, its writes read
        time.sleep(0.02)
    assert state.stop_reason == "stopped from the sidebar"
    assert time.monotonic() < deadline - 10 + 4.0  # about one write's second, even on a loaded machine
    state.result = SimpleNamespace(interrupted=False, energy_j=None)
    rec.on_fit_end(state)
    assert registry.get_run(state.registry_run)["status"] == "stopped"


def test_remove_deletes_a_run_still_marked_running_whose_process_is_gone(registry):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    run_id = registry.start_run("orphan", pid=child.pid)  # no reader marked it dead yet
    assert registry.remove([run_id]) == [run_id]


def test_the_writer_leaves_the_stop_poll_to_a_training_thread_that_logs_often(registry, monkeypatch):
    import threading

    polls = []
    read = Registry.stop_requested

    def counted(self, run_id):
        if threading.current_thread().name.startswith("gpunb-run") and run_id == rec.run_id:
            polls.append(time.monotonic())  # this run's writer (other tests' may still be polling)
        return read(self, run_id)

    monkeypatch.setattr(Registry, "stop_requested", counted)
    state, rec = _state(), RunRecorder(registry)
    rec.on_fit_start(state)
    assert rec.flush(10)
    polls.clear()
    until = time.monotonic() + 1.3
    while time.monotonic() < until:  # logs every 50 ms, within the write throttle after the first
        state.step += 1
        rec.on_log(state, {"loss": 1.0})
        time.sleep(0.05)
    logging = len(polls)
    polls.clear()
    time.sleep(1.3)  # no logs: the writer's thread polls again, every STOP_POLL_S
    assert logging <= 3 and len(polls) >= 2, (logging, len(polls))  # only after its writes, then polls
    state.result = SimpleNamespace(interrupted=False, energy_j=None)
    rec.on_fit_end(state)

def test_a_job_is_recorded_queued_then_runs_in_the_same_row(registry):
    run_id = registry.start_run("job", run_id="b" * 32, status="queued",
                                job={"cluster": "slurm", "id": "42", "state": "PENDING", "reason": "Priority"})
    assert registry.request_stop(run_id) and registry.stop_requested(run_id)  # a queued job can be stopped
    run = registry.get_run(run_id)
    assert run["status"] == "queued" and run["job"]["reason"] == "Priority"
    registry.start_run("job", run_id=run_id, reopen=True)  # the job started: its recorder goes on in the row
    registry.set_job(run_id, {"state": "RUNNING", "reason": None})
    run = registry.get_run(run_id)
    assert run["status"] == "running" and run["job"] == {"cluster": "slurm", "id": "42", "state": "RUNNING",
                                                         "reason": None}
    registry.set_job(run_id, {"state": "CANCELLED"}, status="cancelled")
    run = registry.get_run(run_id)
    assert run["status"] == "cancelled" and run["ended_at"] is not None
