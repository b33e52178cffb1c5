"""A sweep's faults: a failed trial is recorded with its message and the sweep goes on (in the
kernel and as jobs); the first trial's build raising is said at once; a sweep whose every trial
failed ends with one error; an unnamed sweep is found again by its cell while it is unfinished;
a kernel restart mid-sweep re-attaches; following a job creates nothing in the working directory."""

import os
import signal

import pytest
import torch
from conftest import classification_data, mlp
from test_jobs import no_leftovers  # noqa: F401 (a fixture)
from torch import nn

import gpunb
from gpunb import Trainer
from gpunb.errors import GpunbError

optuna = pytest.importorskip("optuna")  # the [sweep] extra; the test command installs it

FIT = dict(epochs=2, batch_size=32, seed=0, track=False, precision="32")
OOM = "Out of memory even with a micro-batch of 1 sample."


class Faulty(nn.Module):
    """An MLP whose forward fails as `kind` says: "raises" an error; "oom" runs out of memory at any
    batch (torch's OOM error, which no smaller micro-batch recovers); "dies" kills its process."""

    def __init__(self, kind: str, net: nn.Module):
        super().__init__()
        self.kind, self.net = kind, net

    def forward(self, x):
        if self.kind == "raises":
            raise RuntimeError("this layer is broken")
        if self.kind == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.kind == "dies":
            os.kill(os.getpid(), signal.SIGKILL)  # as the system's OOM killer ends a process
        return self.net(x)


def faulty_build(trial):
    kind = gpunb.suggest("kind", KINDS)
    if kind == "unbuildable":
        raise ValueError("no model of this kind")
    x, y = classification_data()
    model = Faulty(kind, mlp())
    return dict(model=model, train_data=(x[:192], y[:192]), val_data=(x[192:], y[192:]),
                loss_fn=nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


KINDS = ["ok", "raises", "oom", "unbuildable", "dies"]  # the first: suggest's default (a grid builds it once first)


def grid_seed(name: str, choices: list, first, second=None) -> tuple:
    """A seed whose grid tries `first` first (and `second` second); and the grid's order."""
    from gpunb.sweeps.space import Dimension
    from gpunb.sweeps.study import SweepSettings, grid_of

    for seed in range(200):
        settings = SweepSettings(len(choices), sampler="grid", seed=seed)
        order = [point[name] for point in grid_of({name: Dimension(name, choices=tuple(choices))}, settings)]
        if order[0] == first and (second is None or order[1] == second):
            return seed, order
    raise AssertionError("no seed orders the grid so")


def kinds(only: list):
    """faulty_build over `only` of the kinds."""
    KINDS[:] = only


@pytest.fixture(autouse=True)
def all_kinds():
    saved = list(KINDS)
    yield
    KINDS[:] = saved


def failures(sweep) -> dict:
    return {row.params["kind"]: row.error for row in sweep.rows if row.state == "failed"}


def test_in_the_kernel_a_trial_that_raises_runs_out_of_memory_or_does_not_build_is_recorded_and_the_sweep_goes_on():
    from gpunb.config import TrainConfig
    from gpunb.notebook.sweep_cell import trial_line

    kinds(["ok", "raises", "oom", "unbuildable"])
    seed, order = grid_seed("kind", KINDS, first="raises")  # a fit that fails first is no mistake in the cell
    sweep = Trainer(**FIT).sweep(faulty_build, trials=4, sampler="grid", seed=seed, name="faults")
    assert [row.params["kind"] for row in sweep.rows] == order
    assert failures(sweep) == {"raises": "RuntimeError: this layer is broken", "oom": OOM,
                               "unbuildable": "ValueError: no model of this kind"}
    ok = next(row for row in sweep.rows if row.params["kind"] == "ok")
    assert ok.state == "complete" and ok.value is not None and sweep.best_trial == ok.number
    assert isinstance(sweep.best_model, Faulty) and sweep.best_model.kind == "ok"
    states = {trial.number: trial.state.name for trial in sweep.study.trials}
    assert states == {row.number: "COMPLETE" if row is ok else "FAIL" for row in sweep.rows}
    table = sweep.table
    assert list(table[table["state"] == "failed"]["error"]) == [r.error for r in sweep.rows if r is not ok]
    lines = [trial_line(row, TrainConfig()) for row in sweep.rows]
    assert f"trial {order.index('oom')}: failed (kind=oom): {OOM}" in lines


def test_the_first_trials_build_raising_is_a_mistake_in_the_cell_said_at_once():
    kinds(["ok", "unbuildable"])
    seed, _ = grid_seed("kind", KINDS, first="unbuildable")
    with pytest.raises(ValueError, match="no model of this kind"):
        Trainer(**FIT).sweep(faulty_build, trials=2, sampler="grid", seed=seed, name="firstbuild")
    from gpunb.runs.paths import data_dir
    from gpunb.sweeps.study import SweepSettings, open_study

    study = open_study(data_dir() / "sweeps" / "firstbuild", "firstbuild", SweepSettings(2))
    assert [trial.state.name for trial in study.trials] == ["FAIL", "WAITING"]  # told failed; the next never asked


def test_a_sweep_whose_every_trial_failed_ends_with_one_error_naming_the_first_failure():
    from gpunb.sweeps import SweepFailed

    kinds(["raises", "oom"])
    seed, order = grid_seed("kind", KINDS, first="oom")
    with pytest.raises(SweepFailed) as raised:
        Trainer(**FIT).sweep(faulty_build, trials=2, sampler="grid", seed=seed, name="allfail")
    assert str(raised.value).startswith(f"Every trial of sweep 'allfail' failed (2); the first, trial 0: {OOM}\n"
                                        "HINT: fix what trial 0 says")
    assert list(raised.value.sweep.table["state"]) == ["failed", "failed"]


WIDTH_CELL = """
import gpunb
torch.manual_seed(0)
width = gpunb.suggest("width", [8, -1, 16])  # -1: nn.Linear refuses it
model = nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train_data, val_data = (x[:64], y[:64]), (x[64:], y[64:])
loss_fn = nn.CrossEntropyLoss()
"""


def test_a_later_trial_whose_cell_raises_for_its_values_is_recorded_and_model_holds_the_best(ip, capsys):
    seed, order = grid_seed("width", [8, -1, 16], first=8, second=-1)
    ip.run_cell_magic("gputrain", f"--trials 3 --sampler grid --seed {seed} --epochs 1 --batch-size 16 --no-track",
                      WIDTH_CELL)
    sweep = ip.user_ns["gputrain_result"].sweep
    assert [(row.params["width"], row.state) for row in sweep.rows] == [(8, "complete"), (-1, "failed"),
                                                                        (16, "complete")]
    error = sweep.rows[1].error
    assert error.startswith("the cell raised while building trial 1 (RuntimeError: ") and "negative dimension" in error
    out = capsys.readouterr().out
    assert f"trial 1: failed (width=-1): {error}" in out.splitlines()
    assert ip.user_ns["model"] is sweep.best_model and sweep.best_params["width"] in (8, 16)
    assert sweep.study.trials[1].state.name == "FAIL"


def test_an_unnamed_sweep_of_jobs_is_found_again_while_unfinished_and_a_finished_one_is_not():
    from gpunb.runs.paths import data_dir
    from gpunb.sweeps import default_name
    from gpunb.sweeps.study import SweepSettings, open_study

    settings = SweepSettings(2, sampler="random", seed=0)
    name = default_name("the cell", settings, 2, as_jobs=True)
    assert name.startswith("sweep-") and name == default_name("the cell", settings, 2, as_jobs=True)
    assert name != default_name("another cell", settings, 2, as_jobs=True)
    assert name != default_name("the cell", SweepSettings(3, sampler="random", seed=0), 2, as_jobs=True)
    study = open_study(data_dir() / "sweeps" / name, name, settings)
    running = study.ask()
    assert default_name("the cell", settings, 2, as_jobs=True) == name  # a trial runs: re-attach
    assert default_name("the cell", settings, 1, as_jobs=False) != name  # in the kernel: nothing to follow
    assert default_name("the cell", settings, 2, as_jobs=False) == f"{name}-2"
    study.tell(running, 1.0)
    assert default_name("the cell", settings, 2, as_jobs=True) == name  # 1 of 2: goes on
    last = study.ask()
    assert default_name("the cell", settings, 2, as_jobs=True) == name  # all asked, one still running
    study.tell(last, 0.5)
    assert default_name("the cell", settings, 2, as_jobs=True) == f"{name}-2"  # finished: a new sweep


def test_a_grid_sweep_whose_points_wait_in_its_study_is_unfinished_until_they_are_asked():
    from gpunb.runs.paths import data_dir
    from gpunb.sweeps.space import Dimension
    from gpunb.sweeps.study import SweepSettings, open_study, unfinished

    settings = SweepSettings(2, sampler="grid", seed=0)
    folder = data_dir() / "sweeps" / "grid"
    study = open_study(folder, "grid", settings, {"width": Dimension("width", choices=(8, 16))})
    assert [trial.state.name for trial in study.trials] == ["WAITING", "WAITING"]
    assert unfinished(folder, "grid", 2)
    for _ in range(2):
        study.tell(study.ask(), 1.0)
    assert not unfinished(folder, "grid", 2)


def test_an_unnamed_sweep_run_again_in_the_kernel_is_a_new_sweep_not_the_old_one_empty(ip):
    line = "--trials 2 --sampler random --seed 0 --epochs 1 --batch-size 16 --no-track --quiet"
    cell = WIDTH_CELL.replace("[8, -1, 16]", "[8, 16]")
    ip.run_cell_magic("gputrain", line, cell)
    first = ip.user_ns["gputrain_result"].sweep
    ip.run_cell_magic("gputrain", line, cell)
    second = ip.user_ns["gputrain_result"].sweep
    assert second.name == f"{first.name}-2" and first.name.startswith("sweep-")
    assert len(first.rows) == len(second.rows) == 2
    assert [row.params for row in first.rows] == [row.params for row in second.rows]  # the same seed, anew


@pytest.fixture
def shipped_by_value():
    """Faulty travels to a job's processes by value: they cannot import the tests' modules."""
    import sys

    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_trials_as_jobs_that_raise_run_out_of_memory_die_or_do_not_build_are_recorded_and_the_sweep_goes_on(
        shipped_by_value, no_leftovers):  # noqa: F811
    seed, order = grid_seed("kind", KINDS, first="ok")
    sweep = Trainer(**FIT).sweep(faulty_build, trials=5, parallel=2, sampler="grid", seed=seed, name="jobfaults")
    assert sorted(row.params["kind"] for row in sweep.rows) == sorted(KINDS)
    found = failures(sweep)
    assert found.pop("raises") == "The job failed: RuntimeError: this layer is broken"
    assert found.pop("oom") == OOM
    assert found.pop("unbuildable") == "ValueError: no model of this kind"
    died = found.pop("dies")  # killed: no error of its own, only its end
    assert died.startswith("The job ended (") and "without a result or an error from gpunb" in died
    assert not found
    ok = next(row for row in sweep.rows if row.params["kind"] == "ok")
    assert ok.state == "complete" and sweep.best_trial == ok.number and sweep.best_model.kind == "ok"
    assert sorted(t.state.name for t in sweep.study.trials) == ["COMPLETE"] + ["FAIL"] * 4
    assert len(sweep.study.trials) == 5


def test_following_a_job_with_a_csv_logger_creates_nothing_in_the_working_directory(tmp_path, monkeypatch,
                                                                                     no_leftovers):  # noqa: F811
    from gpunb.config import TrainConfig
    from gpunb.loggers import make_loggers

    cwd = tmp_path / "notebooks"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    make_loggers(TrainConfig(loggers=("csv",)))  # checked: ./gpunb_logs could be written
    assert not os.listdir(cwd)
    x, y = classification_data(n=64)
    result = Trainer(cluster="local", loggers=("csv",), max_steps=4, batch_size=16, track=False,
                     name="logged").fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    assert result.status == "completed"
    assert not os.listdir(cwd)  # the job's logs are in its folder, and nothing was made here
    assert list((tmp_path / "gpunb-home").rglob("logs/logged-1/metrics.csv"))
    Trainer(loggers=("csv",), max_steps=2, batch_size=16, track=False, name="here").fit(
        mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    assert (cwd / "gpunb_logs" / "here-1" / "metrics.csv").exists()  # a fit in the kernel still logs here


# The kernel-restart test's cell: each build appends the trial's width to BUILT (the kernel built
# a trial), and each trial's loss waits, from its 4th call on, while the HOLD file exists (saying
# so once per process in HELD.<pid>): the trials are mid-run for as long as the test needs.
RESTART_OPTIONS = "--trials 3 --parallel 2 --sampler random --seed 5 --epochs 2 --batch-size 16 --monitor val_loss"
RESTART_CELL = """import os, time
import torch, gpunb
from torch import nn
g = torch.Generator().manual_seed(0)
x = torch.randn(128, 10, generator=g)
y = (x[:, 0] > 0).long()
train_data, val_data = (x[:96], y[:96]), (x[96:], y[96:])
torch.manual_seed(0)
width = gpunb.suggest("width", [8, 16, 32])
with open(os.environ["BUILT"], "a") as built:
    built.write(f"{width}\\n")
model = nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=gpunb.suggest("lr", 1e-2, 3e-1, log=True))
class HeldLoss(nn.CrossEntropyLoss):
    calls = 0
    def forward(self, output, target):
        self.calls += 1
        while self.calls > 3 and os.path.exists(os.environ["HOLD"]):
            open(os.environ["HELD"] + f".{os.getpid()}", "a").close()
            time.sleep(0.05)
        return super().forward(output, target)
loss_fn = HeldLoss()"""
RESTART_REPORT = """sweep = gputrain_result.sweep
with torch.no_grad():
    loss = nn.functional.cross_entropy(model(val_data[0]), val_data[1]).item()
print(sweep.name, sorted(r.number for r in sweep.rows), sorted({r.state for r in sweep.rows}),
      len(sweep.study.trials), model is sweep.best_model, abs(loss - sweep.best_value) < 1e-5)"""


def test_a_kernel_restart_mid_sweep_leaves_the_trials_running_and_the_same_cell_re_attaches(tmp_path, gpunb_home,
                                                                                          no_leftovers):  # noqa: F811
    """As JupyterLab restarts a kernel (jupyter_client's restart_kernel) while a `--parallel 2` sweep
    without a name has two trials training; the same cell run in the new kernel follows those two
    trials' jobs (no new trial or job for them), runs the third, and puts the best model in `model`."""
    pytest.importorskip("jupyter_client")
    from test_jobs_kernel import kernel, restarted_client, run, wait_for

    from gpunb.runs import Registry

    hold, held, built = tmp_path / "hold", tmp_path / "held", tmp_path / "built"
    hold.touch()
    env = {**os.environ, "GPUNB_HOME": str(gpunb_home), "GPUNB_DASHBOARD": "text", "HOLD": str(hold),
           "HELD": str(held), "BUILT": str(built)}
    holding = lambda: len(list(tmp_path.glob("held.*")))  # noqa: E731 - the trials' processes held
    builds = lambda: built.read_text().split() if built.exists() else []  # noqa: E731
    manager, client = kernel(env)
    try:
        run(client, "%load_ext gpunb")
        client.execute(f"%%gputrain {RESTART_OPTIONS}\n{RESTART_CELL}")  # submits two trials, follows them
        wait_for(lambda: holding() >= 2, "both first trials to train")
        registry = Registry(gpunb_home / "runs.sqlite")
        before = {r["name"]: r["id"] for r in registry.list_runs()}
        assert len(before) == 2 and len(builds()) == 2, (before, builds())
        client.stop_channels()
        manager.restart_kernel()  # SIGINT, shutdown_request, then a new kernel
        client = restarted_client(manager)
        folders = list((gpunb_home / "jobs").iterdir())
        assert len(folders) == 2 and not [f for f in folders if (f / "stop").exists()], "the restart stopped a trial"
        assert holding() == 2  # still training (held), not ended
        run(client, "%load_ext gpunb")
        reply = client.execute(f"%%gputrain {RESTART_OPTIONS}\n{RESTART_CELL}")
        wait_for(lambda: len(builds()) >= 4, "the new kernel to build the two running trials again")
        hold.unlink()  # the trials go on; the third takes a freed slot
        assert client.get_shell_msg(timeout=300)["parent_header"]["msg_id"] == reply
        report = run(client, RESTART_REPORT).split()
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    name, *rest = report
    assert " ".join(rest) == "[0, 1, 2] ['complete'] 3 True True", report
    runs = {r["name"]: r["id"] for r in registry.list_runs()}
    assert sorted(runs) == [f"{name}-t0", f"{name}-t1", f"{name}-t2"]  # no trial asked or run twice
    assert all(runs[trial] == run_id for trial, run_id in before.items())  # the same jobs, followed
    assert len(list((gpunb_home / "jobs").iterdir())) == 3 and len(builds()) == 5
