"""A sweep in the run registry: each trial's row says which sweep and trial it is (in the kernel and as a
job), the server groups them into one card, and a stop of the whole sweep (gpunb.stop, the server's
route) asks no more trials and stops the running ones at a step boundary, their checkpoints kept."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest
from test_sweeps import FIT, _module_build
from tornado.httpclient import HTTPClientError

import gpunb
from gpunb import Trainer
from gpunb.runs import Registry
from gpunb.runs.sweep_cards import sweep_card

pytest.importorskip("optuna")
pytest_plugins = ("pytest_jupyter.jupyter_server",)

TOKEN = "gpunb-test-token"
TRACKED = FIT | dict(track=True)


def _tag(name: str, trial: int, trials: int = 4, monitor: str = "val_loss", direction: str = "minimize") -> dict:
    return {"name": name, "trial": trial, "trials": trials, "monitor": monitor, "direction": direction}


def _trial_row(registry: Registry, name: str, trial: int, status: str, *, value: float | None = None,
               stop_reason: str | None = None, **tag) -> str:
    """A trial's row as its recorder writes it (this process stands in for a live run)."""
    run_id = registry.start_run(f"{name}-t{trial}", config={"sweep": _tag(name, trial, **tag)}, total_steps=100)
    if value is not None:
        registry.update(run_id, latest={"val_loss": value, "loss": value})
    if status != "running":
        registry.finish(run_id, status, stop_reason=stop_reason)
    return run_id


# --------------------------------------------------------------------- the registry's column
def test_an_older_registry_gains_the_sweep_column_and_the_sweep_stops(tmp_path):
    path = tmp_path / "runs.sqlite"
    with sqlite3.connect(path) as db:  # the schema before `sweep`
        db.execute("CREATE TABLE runs (id TEXT PRIMARY KEY, name TEXT, notebook TEXT, kernel_id TEXT, "
                   "pid INTEGER, pid_started REAL, host TEXT, status TEXT NOT NULL, config TEXT, "
                   "started_at REAL, ended_at REAL, updated_at REAL, progress REAL, step INTEGER, "
                   "total_steps INTEGER, epoch INTEGER, eta_s REAL, latest TEXT, device TEXT, energy_j REAL, "
                   "error TEXT, best TEXT, heartbeat_at REAL, job TEXT, stop_reason TEXT, "
                   "metric_seq INTEGER NOT NULL DEFAULT 0, metric_stride INTEGER NOT NULL DEFAULT 1)")
        db.execute("CREATE TABLE stop_requests (run_id TEXT PRIMARY KEY, requested_at REAL)")
        db.execute("INSERT INTO runs (id, name, status, started_at) VALUES ('a', 'old', 'completed', 1.0)")
    registry = Registry(path)
    assert registry.get_run("a")["sweep"] is None
    trial = _trial_row(registry, "s", 0, "running")
    assert registry.get_run(trial)["sweep"] == _tag("s", 0)
    assert [run["id"] for run in registry.sweep_runs("s")] == [trial]
    assert registry.sweep_stops() == {}
    registry.request_sweep_stop("s", "the sweep was stopped from the sidebar")
    assert registry.sweep_stops() == {"s": "the sweep was stopped from the sidebar"}
    registry.clear_sweep_stop("s")
    assert registry.sweep_stops() == {}


def test_trials_in_the_kernel_record_their_sweep_and_number(gpunb_home):
    Trainer(**TRACKED).sweep(_module_build, trials=2, sampler="random", seed=3, name="kept")
    runs = {run["name"]: run for run in Registry().list_runs()}
    assert set(runs) == {"kept-t0", "kept-t1"}
    for number in (0, 1):
        assert runs[f"kept-t{number}"]["sweep"] == _tag("kept", number, trials=2)
        assert runs[f"kept-t{number}"]["status"] == "completed"


# --------------------------------------------------------------------- the sweep's card
def test_a_sweeps_card_counts_its_trials_and_names_the_best_and_each_trials_state(tmp_path):
    registry = Registry(tmp_path / "runs.sqlite")
    _trial_row(registry, "s", 0, "completed", value=0.5)
    best = _trial_row(registry, "s", 1, "completed", value=0.25)
    _trial_row(registry, "s", 2, "stopped", value=0.9, stop_reason="pruned by the sweep at step 4 (val_loss=0.9)")
    running = _trial_row(registry, "s", 3, "running", value=0.1)
    card = sweep_card("s", registry.sweep_runs("s"))
    assert (card["trials"], card["done"], card["state"], card["monitor"]) == (4, 3, "running", "val_loss")
    assert card["best"] == {"trial": 1, "value": 0.25, "id": best}  # the running trial's 0.1 is no value yet
    assert [(t["trial"], t["state"], t["value"]) for t in card["runs"]] == [
        (0, "complete", 0.5), (1, "complete", 0.25), (2, "pruned", None), (3, "running", None)]
    registry.request_stop(running)
    stopping = sweep_card("s", registry.sweep_runs("s"), "the sweep was stopped from the sidebar")
    assert stopping["state"] == "stopping" and stopping["runs"][3]["state"] == "stopping"
    registry.finish(running, "stopped", stop_reason="stopped from the sidebar")
    assert sweep_card("s", registry.sweep_runs("s"), "the sweep was stopped")["state"] == "stopped"
    assert sweep_card("s", registry.sweep_runs("s"))["state"] == "completed"


def test_a_maximized_objectives_best_is_the_highest(tmp_path):
    registry = Registry(tmp_path / "runs.sqlite")
    for trial, acc in enumerate([0.7, 0.9, 0.8]):
        run_id = registry.start_run(f"m-t{trial}", config={"sweep": _tag("m", trial, 3, "val_acc", "maximize")})
        registry.update(run_id, latest={"val_acc": acc})
        registry.finish(run_id, "completed")
    card = sweep_card("m", registry.sweep_runs("m"))
    assert card["best"]["trial"] == 1 and card["state"] == "completed"


# --------------------------------------------------------------------- the server
@pytest.fixture
def jp_server_config(jp_server_config, gpunb_home):
    return {"ServerApp": {"jpserver_extensions": {"gpunb": True}, "allow_unauthenticated_access": False},
            "IdentityProvider": {"token": TOKEN}}


async def _api(jp_fetch, method: str, *parts: str):
    response = await jp_fetch("gpunb", "api", *parts, method=method, body=b"{}" if method == "POST" else None)
    return response.code, json.loads(response.body)


async def test_the_server_lists_each_sweep_as_one_card_with_its_trials(jp_fetch, gpunb_home):
    registry = Registry(gpunb_home / "runs.sqlite")
    alone = registry.start_run("alone")
    trials = [_trial_row(registry, "lr search", 0, "completed", value=0.4),
              _trial_row(registry, "lr search", 1, "running")]
    code, body = await _api(jp_fetch, "GET", "runs")
    assert code == 200 and {run["id"] for run in body["runs"]} == {alone, *trials}  # the runs as before
    (card,) = body["sweeps"]
    assert (card["name"], card["trials"], card["done"], card["state"]) == ("lr search", 4, 1, "running")
    assert [t["id"] for t in card["runs"]] == trials and card["best"]["value"] == 0.4


async def test_the_servers_sweep_stop_asks_the_sweep_and_its_running_trials(jp_fetch, gpunb_home):
    registry = Registry(gpunb_home / "runs.sqlite")
    done = _trial_row(registry, "lr search", 0, "completed", value=0.4)
    running = _trial_row(registry, "lr search", 1, "running")
    code, body = await _api(jp_fetch, "POST", "sweeps", "lr search", "stop")
    assert (code, body) == (202, {"sweep": "lr search", "stop_requested": True})
    assert registry.sweep_stops() == {"lr search": "the sweep was stopped from the sidebar"}
    assert registry.get_run(running, with_history=False)["stop_requested"]
    assert not registry.get_run(done, with_history=False)["stop_requested"]
    (card,) = (await _api(jp_fetch, "GET", "runs"))[1]["sweeps"]
    assert card["state"] == "stopping"
    with pytest.raises(HTTPClientError) as unknown:
        await _api(jp_fetch, "POST", "sweeps", "nothing", "stop")
    assert unknown.value.code == 404
    registry.finish(running, "stopped")
    with pytest.raises(HTTPClientError) as ended:
        await _api(jp_fetch, "POST", "sweeps", "lr search", "stop")
    assert ended.value.code == 409
    with pytest.raises(HTTPClientError) as anonymous:
        await jp_fetch("gpunb", "api", "sweeps", "lr search", "stop", method="POST", body=b"{}",
                       headers={"Authorization": ""})
    assert anonymous.value.code == 403


# --------------------------------------------------------------------- stopping a sweep
class _StopTheSweepAt:
    """A callback of every trial: at `step` of the first trial, `gpunb.stop(<the sweep>)`, as the
    sidebar or another kernel would."""

    def __init__(self, name: str, step: int):
        self.name, self.step, self.trial, self.answer = name, step, None, None

    def on_step_end(self, state) -> None:
        if self.answer is None and state.step == self.step:
            self.answer = gpunb.stop(self.name)


def test_gpunb_stop_of_a_sweep_in_the_kernel_stops_its_trial_with_a_checkpoint_and_asks_no_more(tmp_path):
    stopper = _StopTheSweepAt("halt", 3)
    sweep = Trainer(**(TRACKED | dict(epochs=50, checkpoint_dir=str(tmp_path / "ckpt")))).sweep(
        _module_build, trials=3, sampler="random", seed=3, name="halt", callbacks=[stopper])
    assert stopper.answer == "stopping"
    (row,) = sweep.rows  # no second trial asked
    assert row.state == "stopped" and 3 <= row.steps < 50 * 6
    assert len(sweep.study.trials) == 1 and sweep.best_model is None
    (run,) = Registry().sweep_runs("halt")
    assert run["status"] == "stopped" and run["step"] == row.steps
    assert list((tmp_path / "ckpt").rglob("*.pt")), "the stopped trial keeps a checkpoint"
    assert gpunb.stop("halt") == "ended"  # nothing left running


def test_a_stop_asked_between_two_trials_in_the_kernel_asks_no_next_trial(gpunb_home):
    answers = []
    sweep = Trainer(**TRACKED).sweep(_module_build, trials=3, sampler="random", seed=3, name="between",
                                     on_trial=lambda row: answers.append(gpunb.stop("between")))
    assert answers == ["stopping"]  # as the first trial ended, none running: recorded for the loop
    assert [r.state for r in sweep.rows] == ["complete"] and len(sweep.study.trials) == 1
    assert sweep.best_model is not None  # the trial that completed is the sweep's best
    assert gpunb.stop("between") == "ended"


class _AskTheSweepStopOnlyAt(_StopTheSweepAt):
    """At `step`, the sweep's stop recorded and nothing else: as when it is asked while the trial's
    row does not exist yet, so that no stop of the run itself reaches it."""

    def on_step_end(self, state) -> None:
        if self.answer is None and state.step == self.step:
            self.answer = Registry().request_sweep_stop(self.name, "the sweep was stopped from the sidebar")


def test_a_trial_in_the_kernel_stops_at_a_step_once_its_sweeps_stop_is_recorded(gpunb_home, monkeypatch):
    from gpunb.sweeps import control

    monkeypatch.setattr(control, "READ_EVERY_S", 0.0)  # the trial's steps read the registry at every step
    asker = _AskTheSweepStopOnlyAt("race", 3)
    sweep = Trainer(**(TRACKED | dict(epochs=50))).sweep(_module_build, trials=2, sampler="random", seed=3,
                                                       name="race", callbacks=[asker])
    (row,) = sweep.rows
    assert (row.state, row.steps) == ("stopped", 3)  # read at that step's end (the sweep's callback comes after)
    assert row.error == "the sweep was stopped from the sidebar"
    (run,) = Registry().sweep_runs("race")
    assert (run["status"], run["stop_reason"]) == ("stopped", "the sweep was stopped from the sidebar")


def test_gpunb_stop_of_a_sweep_of_jobs_stops_its_trials_with_checkpoints_and_leaves_no_process(tmp_path):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    registry, answers = Registry(), []
    asked = threading.Event()

    def stop_when_both_train():
        # Decided by the trials' rows: both trials' jobs have started training.
        while not asked.is_set():
            runs = registry.sweep_runs("halted jobs")
            if len(runs) == 2 and all(r["status"] == "running" and (r["step"] or 0) >= 2 for r in runs):
                asked.set()
                answers.append(gpunb.stop("halted jobs"))
            asked.wait(0.1)

    watcher = threading.Thread(target=stop_when_both_train, daemon=True)
    watcher.start()
    try:
        sweep = Trainer(**(TRACKED | dict(epochs=300))).sweep(_module_build, trials=4, parallel=2,
                                                              sampler="random", seed=3, name="halted jobs")
    finally:
        asked.set()
        watcher.join()
    assert answers == ["stopping"]
    assert sorted(r.number for r in sweep.rows) == [0, 1] and {r.state for r in sweep.rows} == {"stopped"}
    assert len(sweep.study.trials) == 2  # no third trial asked
    runs = registry.sweep_runs("halted jobs")
    assert {r["status"] for r in runs} == {"stopped"} and all(r["step"] < 300 * 6 for r in runs)
    assert sorted(r["sweep"]["trial"] for r in runs) == [0, 1]  # a job's row says its sweep and trial too
    assert all(r["job"] for r in runs)
    for run in runs:  # each stopped trial keeps its checkpoint in its job's folder
        assert list(Path(run["job"]["folder"]).rglob("*.pt")), run["name"]
    # The trials' processes exit once they have handed back their weights (a moment after the result).
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(left, timeout=60)
    assert not alive


def test_a_stop_of_the_sweep_asked_before_its_cell_runs_again_no_longer_stands(gpunb_home):
    registry = Registry()
    registry.request_sweep_stop("again", "the sweep was stopped from the sidebar")
    sweep = Trainer(**TRACKED).sweep(_module_build, trials=2, sampler="random", seed=3, name="again")
    assert [r.state for r in sweep.rows] == ["complete", "complete"]
    assert registry.sweep_stops() == {}


# --------------------------------------------------------------------- the notebook's stop button
class _InterruptOnce:
    """Presses the kernel's stop button (SIGINT to this process) once, at the first log from step 3."""

    def __init__(self):
        self.pressed, self.trial = False, None

    def on_log(self, state, row) -> None:
        if row["step"] >= 3 and not self.pressed:
            import os
            import signal

            self.pressed = True
            os.kill(os.getpid(), signal.SIGINT)


def test_the_kernels_stop_button_in_a_sweep_in_the_kernel_stops_its_trial_with_a_checkpoint(tmp_path):
    sweep = Trainer(**(TRACKED | dict(epochs=50, log_every=1, checkpoint_dir=str(tmp_path / "ckpt")))).sweep(
        _module_build, trials=3, sampler="random", seed=3, name="pressed", callbacks=[_InterruptOnce()])
    (row,) = sweep.rows  # no second trial asked
    assert row.state == "stopped" and row.steps < 50 * 6 and len(sweep.study.trials) == 1
    (run,) = Registry().sweep_runs("pressed")
    assert run["status"] == "interrupted" and run["step"] == row.steps
    assert list((tmp_path / "ckpt").rglob("*.pt")), "the stopped trial keeps a checkpoint"


_PRESSER = []  # the one presser every trial's follower shares: the button is pressed once


def _build_pressing_stop(trial):
    """A trial whose follower, in the kernel, presses the stop button as the first job logs step 3."""
    return {**_module_build(trial), "callbacks": _PRESSER}


def test_the_kernels_stop_button_in_a_sweep_of_jobs_stops_its_trials_with_checkpoints(gpunb_home, monkeypatch):
    monkeypatch.setattr(f"{__name__}._PRESSER", [_InterruptOnce()])
    sweep = Trainer(**(TRACKED | dict(epochs=300, log_every=1))).sweep(
        _build_pressing_stop, trials=4, parallel=2, sampler="random", seed=3, name="pressed jobs")
    assert sorted(r.number for r in sweep.rows) == [0, 1] and {r.state for r in sweep.rows} == {"stopped"}
    assert len(sweep.study.trials) == 2  # no third trial asked
    for run in Registry().sweep_runs("pressed jobs"):
        assert run["status"] == "stopped" and run["step"] < 300 * 6
        assert list(Path(run["job"]["folder"]).rglob("*.pt")), run["name"]
