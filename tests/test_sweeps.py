"""Sweeps in this process: gpunb.suggest, the study's trials, pruning, failures and the best model back."""

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

import gpunb
from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.sweeps.space import trial_values

optuna = pytest.importorskip("optuna")  # the [sweep] extra; the test command installs it

FIT = dict(epochs=2, batch_size=32, seed=0, track=False, precision="32")


def test_outside_a_sweep_suggest_gives_the_middle_the_first_choice_or_the_default():
    assert gpunb.suggest("lr", 1e-4, 1e-2, log=True) == pytest.approx(1e-3)
    assert gpunb.suggest("dropout", 0.0, 0.5) == pytest.approx(0.25)
    width = gpunb.suggest("width", 16, 64)
    assert width == 40 and isinstance(width, int)
    assert gpunb.suggest("act", ["relu", "gelu"]) == "relu"
    assert gpunb.suggest("lr", 1e-4, 1e-2, log=True, default=3e-3) == 3e-3


@pytest.mark.parametrize("call, fix", [
    (lambda: gpunb.suggest("lr", 1e-2, 1e-4), "low must be below high"),
    (lambda: gpunb.suggest("lr", 0.0, 1.0, log=True), "above zero"),
    (lambda: gpunb.suggest("lr", 1e-3), "numeric range or a list"),
    (lambda: gpunb.suggest("act", []), "non-empty list"),
    (lambda: gpunb.suggest("act", [nn.ReLU, nn.GELU]), "map it in the cell"),
    (lambda: gpunb.suggest("width", [16, 32], 64), "choices alone"),
    (lambda: gpunb.suggest("width", 16, 64, default=128), "outside"),
])
def test_a_search_space_that_cannot_be_sampled_is_refused_with_the_fix(call, fix):
    with pytest.raises(GpunbError, match=fix) as raised:
        call()
    assert "HINT:" in str(raised.value)


def test_inside_a_trial_suggest_answers_from_the_trial_and_the_same_name_keeps_one_range():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    trial = study.ask()
    with trial_values(trial=trial) as source:
        lr = gpunb.suggest("lr", 1e-4, 1e-1, log=True)
        width = gpunb.suggest("width", [16, 32, 64])
        with pytest.raises(GpunbError, match="twice with different ranges"):
            gpunb.suggest("lr", 1e-3, 1e-1, log=True)
    assert trial.params == {"lr": lr, "width": width} and 1e-4 <= lr <= 1e-1
    assert set(source.seen) == {"lr", "width"}
    assert gpunb.suggest("width", [16, 32, 64]) == 16  # outside again: the default


def _build(trial):
    x, y = classification_data()
    lr = gpunb.suggest("lr", 1e-3, 3e-1, log=True)
    hidden = gpunb.suggest("hidden", [8, 32])
    model = mlp(hidden=hidden)
    return dict(model=model, train_data=(x[:192], y[:192]), val_data=(x[192:], y[192:]),
                loss_fn=nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(model.parameters(), lr=lr))


def test_a_sweep_runs_its_trials_and_hands_back_the_best_trials_trained_model(tmp_path):
    sweep = Trainer(**FIT).sweep(_build, trials=4, sampler="random", seed=3, name="s1")
    table = sweep.table
    assert list(table["trial"]) == [0, 1, 2, 3] and set(table["state"]) == {"complete"}
    assert {"value", "lr", "hidden", "run"} <= set(table.columns)
    values = list(table["value"])
    assert sweep.best_value == min(values) and sweep.best_trial == values.index(min(values))
    assert sweep.direction == "minimize" and sweep.monitor == "val_loss"
    assert list(table["run"]) == [f"s1-t{n}" for n in range(4)]
    # The best trial's model is the one handed back, and its weights are those of a single fit of
    # the same values with the same seed.
    best = sweep.best_params
    with trial_values(values=best):
        single = _build(None)
    result = Trainer(**FIT).fit(single["model"], single["train_data"],
                                single["val_data"], loss_fn=single["loss_fn"], optimizer=single["optimizer"])
    assert result.validations[-1]["val_loss"] == pytest.approx(sweep.best_value, rel=1e-6)
    for mine, theirs in zip(sweep.best_model.state_dict().values(), single["model"].state_dict().values()):
        assert torch.equal(mine, theirs)
    # The study is the journal in the sweep's folder: opened again, it holds the four trials.
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    again = optuna.load_study(study_name="s1", storage=JournalStorage(JournalFileBackend(sweep.folder + "/study.log")))
    assert [t.value for t in again.trials] == values
    assert "best: trial" in repr(sweep) and "<img" in sweep._repr_html_()


def test_a_poor_trial_is_pruned_at_a_validation_and_stops_at_that_step():
    def build(trial):
        x, y = classification_data()
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3 * gpunb.suggest("slow", [1.0, 1e-6]))
        return dict(model=model, train_data=(x[:192], y[:192]), val_data=(x[192:], y[192:]),
                    loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)  # 1e-6: the weights barely move

    sweep = Trainer(**FIT, val_every_steps=2).sweep(build, trials=5, sampler="random", seed=0, prune="median")
    rows = sweep.rows
    assert [r.state for r in rows[:2]] != ["pruned", "pruned"]  # the median needs trials that finished
    pruned = [r for r in rows if r.state == "pruned"]
    assert pruned, [(r.params, r.state, r.curve) for r in rows]
    assert all(r.params["slow"] == 1e-6 for r in pruned)
    assert all(r.pruned_at == r.steps and r.steps < 12 for r in pruned)  # 2 epochs of 6 steps: stopped early
    assert all(r.value is None for r in pruned)
    assert sweep.study.trials[pruned[0].number].state == optuna.trial.TrialState.PRUNED


def test_a_failing_trial_is_recorded_with_its_message_and_the_sweep_goes_on():
    def build(trial):
        arguments = _build(trial)
        if gpunb.suggest("broken", [False, True]):
            raise RuntimeError("this width does not exist")
        return arguments

    sweep = Trainer(**FIT).sweep(build, trials=6, sampler="random", seed=1)
    failed = [r for r in sweep.rows if r.state == "failed"]
    done = [r for r in sweep.rows if r.state == "complete"]
    assert failed and done and len(sweep.rows) == 6
    assert all(r.error == "RuntimeError: this width does not exist" and r.params["broken"] for r in failed)
    assert sweep.best_trial in {r.number for r in done}


def test_a_mistake_in_the_set_up_is_said_once_and_leaves_no_trial_running():
    def build(trial):
        arguments = _build(trial)
        del arguments["val_data"]
        return arguments

    with pytest.raises(GpunbError, match="validation"):
        Trainer(**FIT).sweep(build, trials=3, name="nodata", monitor="val_acc", sampler="random", seed=0)
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from gpunb.runs.paths import data_dir

    journal = JournalStorage(JournalFileBackend(str(data_dir() / "sweeps" / "nodata" / "study.log")))
    study = optuna.load_study(study_name="nodata", storage=journal)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.FAIL]


@pytest.mark.parametrize("settings, fix", [
    (dict(trials=0), "at least 1"),
    (dict(trials=2, sampler="bayes"), "tpe | random | grid"),
    (dict(trials=2, prune="hyperband"), "asha | median | none"),
    (dict(trials=2, direction="down"), "minimize | maximize"),
])
def test_bad_sweep_settings_are_refused_before_any_trial(settings, fix):
    built = []
    with pytest.raises(GpunbError, match=fix):
        Trainer(**FIT).sweep(lambda trial: built.append(trial), **settings)
    assert not built


def test_a_grid_needs_choices_and_tries_each_combination_once():
    with pytest.raises(GpunbError, match="lr is a range"):
        Trainer(**FIT).sweep(_build, trials=2, sampler="grid")

    def build(trial):
        x, y = classification_data()
        model = mlp(hidden=gpunb.suggest("hidden", [8, 32]))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=gpunb.suggest("momentum", [0.0, 0.9]))
        return dict(model=model, train_data=(x[:192], y[:192]), val_data=(x[192:], y[192:]),
                    loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)

    grid = Trainer(**FIT).sweep(build, trials=4, sampler="grid", seed=0)
    combinations = {(r.params["hidden"], r.params["momentum"]) for r in grid.rows}
    assert combinations == {(8, 0.0), (8, 0.9), (32, 0.0), (32, 0.9)}


SWEEP_CELL = """
import gpunb
torch.manual_seed(0)
width = gpunb.suggest("width", [8, 32])
model = nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=gpunb.suggest("lr", 1e-2, 3e-1, log=True))
train_data = (x[:200], y[:200])
val_data = (x[200:], y[200:])
loss_fn = nn.CrossEntropyLoss()
"""


@pytest.fixture
def ip():
    import IPython
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython() or IPython.get_ipython()
    shell.run_line_magic("load_ext", "gpunb")
    shell.user_ns.clear()
    shell.run_cell("import torch\nfrom torch import nn\ng = torch.Generator().manual_seed(0)\n"
                   "x = torch.randn(256, 10, generator=g)\ny = (x[:, 0] > 0).long()\n")
    yield shell
    shell.user_ns.clear()


def test_the_cell_runs_as_a_sweep_and_model_holds_the_best_trials_weights(ip, capsys):
    ip.run_cell_magic("gputrain", "--trials 4 --sampler random --seed 0 --epochs 2 --batch-size 20 "
                                  "--monitor val_loss --no-track", SWEEP_CELL)
    result = ip.user_ns["gputrain_result"]
    table = result.sweep.table
    assert len(table) == 4 and table["value"].notna().all()
    assert result.sweep.best_value == table["value"].min() == pytest.approx(result.final_metrics["val_loss"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("trial ")]
    assert [line.split(":")[0] for line in lines] == ["trial 0", "trial 1", "trial 2", "trial 3"]
    # `model` is the best trial's model, trained: its validation loss is the sweep's best value.
    model, x, y = ip.user_ns["model"], ip.user_ns["x"], ip.user_ns["y"]
    assert model is result.sweep.best_model
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(x[200:]), y[200:]).item()
    assert loss == pytest.approx(result.sweep.best_value, rel=1e-5)
    # The same cell without --trials trains once, with each suggest's default.
    ip.run_cell_magic("gputrain", "--epochs 1 --batch-size 20 --no-track --quiet", SWEEP_CELL)
    assert ip.user_ns["width"] == 8 and ip.user_ns["gputrain_result"].sweep is None


def test_trials_two_at_a_time_as_jobs_from_the_cell_put_the_best_trials_weights_in_model(ip):
    ip.run_cell_magic("gputrain", "--trials 4 --parallel 2 --monitor val_loss --sampler random --seed 0 --epochs 2 "
                                  "--batch-size 20 --no-track --quiet", SWEEP_CELL)
    result = ip.user_ns["gputrain_result"]
    table = result.sweep.table
    assert sorted(table["trial"]) == [0, 1, 2, 3] and table["value"].notna().all()
    model, x, y = ip.user_ns["model"], ip.user_ns["x"], ip.user_ns["y"]
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(x[200:]), y[200:]).item()
    assert loss == pytest.approx(table["value"].min(), rel=1e-5)


@pytest.mark.parametrize("line, cell, message", [
    ("--trials 2 --find-lr", SWEEP_CELL, "drop `--find-lr`"),
    ("--trials 2 --detach --no-wait", SWEEP_CELL, "drop `--no-wait`"),
    ("--trials 2 --parallel 0", SWEEP_CELL, "at least 1"),
    ("--trials 2 --sampler bayes", SWEEP_CELL, "tpe | random | grid"),
    ("--trials 2", None, "a line magic has no cell"),
])
def test_a_sweep_line_that_cannot_run_is_refused_before_the_cell_runs(ip, line, cell, message):
    from IPython.core.error import UsageError

    with pytest.raises((UsageError, GpunbError), match=message):
        if cell is None:
            ip.run_line_magic("gputrain", line)
        else:
            ip.run_cell_magic("gputrain", line, cell)
    assert "model" not in ip.user_ns


def test_a_cell_that_raises_in_its_first_trial_stops_the_sweep_with_one_message(ip):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="the cell raised while building trial 0"):
        ip.run_cell_magic("gputrain", "--trials 3 --epochs 1 --no-track", SWEEP_CELL + "\n1 / 0\n")


@pytest.fixture
def published(ip, monkeypatch):
    """What the cell publishes, as a kernel shows HTML: (data, display_id, update) per message."""
    sent = []
    monkeypatch.setenv("GPUNB_DASHBOARD", "html")
    monkeypatch.setattr(ip.display_formatter.formatters["text/html"], "enabled", True)  # as in a kernel
    monkeypatch.setattr(ip.display_pub, "publish", lambda data, metadata=None, transient=None, update=False,
                        **kw: sent.append((data, (transient or {}).get("display_id"), update)))
    return sent


def test_the_sweeps_live_view_is_one_output_re_sent_as_trials_validate_and_end(ip, published):
    sent = published
    ip.run_cell_magic("gputrain", "--trials 3 --sampler random --seed 0 --epochs 2 --batch-size 40 "
                                  "--val-every-steps 5 --no-track", SWEEP_CELL)
    ids = {display_id for _, display_id, _ in sent}
    assert len(ids) == 1 and None not in ids  # one output, updated in place
    assert [update for _, _, update in sent][:1] == [False] and all(update for _, _, update in sent[1:])
    html = [data.get("text/html", "") for data, _, _ in sent]
    assert "starting" in html[0]
    assert any("trial 1 running, step 5 of 10" in h for h in html)  # a trial's curve at its validation
    assert any("sweep: 2 of 3 trials ended" in h for h in html)
    final = sent[-1][0]
    assert final["text/plain"].startswith("SweepResult(") and "★" in final["text/html"]
    assert "<svg" not in final["text/html"] and "data:image/svg+xml;base64" in final["text/html"]


def test_the_live_view_of_trials_as_jobs_shows_the_trials_running_side_by_side(ip, published):
    """With --parallel the trials' jobs relay their events into the view: it is re-sent while two
    trials run at once (both named), and as each ends."""
    ip.run_cell_magic("gputrain", "--trials 2 --parallel 2 --sampler random --seed 0 --epochs 2 --batch-size 40 "
                                  "--val-every-steps 5 --no-track", SWEEP_CELL)
    sent = [data.get("text/html", "") for data, _, _ in published]
    assert any("sweep: 0 of 2 trials ended; trials 0, 1 running" in html for html in sent)  # their events
    assert any("sweep: 1 of 2 trials ended" in html for html in sent)
    assert sorted(ip.user_ns["gputrain_result"].sweep.table["trial"]) == [0, 1]


def _module_build(trial):
    """A build whose model class pickles by reference (a job's processes import this module)."""
    return _build(trial)


def test_trials_as_jobs_two_at_a_time_give_the_weights_of_a_single_fit_and_leave_no_process(tmp_path):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    sweep = Trainer(**FIT).sweep(_module_build, trials=4, parallel=2, sampler="random", seed=3, name="jobs2")
    table = sweep.table
    assert sorted(table["trial"]) == [0, 1, 2, 3] and set(table["state"]) == {"complete"}, sweep.rows
    in_kernel = Trainer(**FIT).sweep(_build, trials=4, sampler="random", seed=3, name="kernel4")
    assert [r.params for r in sorted(sweep.rows, key=lambda r: r.number)] == [r.params for r in in_kernel.rows]
    by_number = {r.number: r.value for r in in_kernel.rows}
    for row in sweep.rows:  # a trial as a job trains as the same trial in the kernel
        assert row.value == pytest.approx(by_number[row.number], rel=1e-5)
    assert sweep.best_trial == in_kernel.best_trial
    for mine, theirs in zip(sweep.best_model.state_dict().values(), in_kernel.best_model.state_dict().values()):
        assert torch.allclose(mine, theirs, atol=1e-6)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(left, timeout=15)  # a job's processes exit just after its result is read
    assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _slow_build(trial):
    x, y = classification_data()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3 * gpunb.suggest("slow", [1.0, 1e-6]))
    return dict(model=model, train_data=(x[:192], y[:192]), val_data=(x[192:], y[192:]),
                loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)


def test_a_trial_as_a_job_is_pruned_from_the_kernel_and_stops_at_a_step_boundary():
    # Seed 2 draws slow=1.0 for trials 0, 1 and 2, and 1e-6 for trial 3: trial 3 starts only once two
    # trials have ended (two slots), so the median pruner has two finished trials to judge it by. A
    # trial is long (1,800 steps) beside its first validation (step 20), so that the stop reaches it.
    sweep = Trainer(**(FIT | dict(epochs=300, val_every_steps=20))).sweep(
        _slow_build, trials=5, parallel=2, sampler="random", seed=2, prune="median", name="prunejobs")
    assert [r.params["slow"] for r in sorted(sweep.rows, key=lambda r: r.number)] == [1.0, 1.0, 1.0, 1e-6, 1.0]
    pruned = [r for r in sweep.rows if r.state == "pruned"]
    assert [r.number for r in pruned] == [3], [(r.number, r.params, r.state) for r in sweep.rows]
    assert all(r.params["slow"] == 1e-6 and r.steps < 1800 for r in pruned)  # 300 epochs of 6 steps: stopped early
    assert all(sweep.study.trials[r.number].state.name == "PRUNED" for r in pruned)
    assert {r.state for r in sweep.rows if r.params["slow"] == 1.0} == {"complete"}


RESTARTED = """
import os, sys
sys.path.insert(0, {tests!r})
from test_sweeps import FIT, _module_build
os.environ["GPUNB_HOME"] = {home!r}  # the test's (importing the tests' helpers sets one of their own)
from gpunb import Trainer
Trainer(**(FIT | dict(epochs=200, track=True))).sweep(_module_build, trials=3, parallel=2, sampler="random",
                                                      seed=5, name="restarted")
"""


def test_a_sweep_whose_kernel_died_follows_its_running_trials_again_when_run_again(gpunb_home):
    """The kernel holding a sweep of jobs dies with two trials running; running the sweep again
    follows those two trials' jobs (no new job for them) and asks only the third trial."""
    import os
    import subprocess
    import sys
    import time

    from gpunb.runs import Registry

    tests = os.path.dirname(__file__)
    kernel = subprocess.Popen([sys.executable, "-c", RESTARTED.format(tests=tests, home=str(gpunb_home))])
    registry = Registry(gpunb_home / "runs.sqlite")
    deadline = time.monotonic() + 240
    rows = []
    while time.monotonic() < deadline and len(rows) < 2:  # both first trials' jobs are submitted
        time.sleep(0.2)
        rows = [r for r in registry.list_runs() if r["name"].startswith("restarted-t")]
    kernel.kill()  # the kernel dies; its trials' jobs go on
    kernel.wait()
    assert len(rows) >= 2 and {"queued", "running"} & {r["status"] for r in rows}, rows  # killed mid-trial
    sweep = Trainer(**(FIT | dict(epochs=200, track=True))).sweep(_module_build, trials=3, parallel=2,
                                                                  sampler="random", seed=5, name="restarted")
    assert sorted(r.number for r in sweep.rows) == [0, 1, 2] and {r.state for r in sweep.rows} == {"complete"}
    runs = [r for r in registry.list_runs() if r["name"].startswith("restarted-t")]
    assert sorted(r["name"] for r in runs) == ["restarted-t0", "restarted-t1", "restarted-t2"]  # none twice
    assert {r["id"] for r in rows} <= {r["id"] for r in runs}  # the first two are the jobs started before
    params = [r.params for r in sorted(sweep.rows, key=lambda r: r.number)]
    assert params[2] not in params[:2]  # the third trial is a new draw, not the first one again
    assert len(sweep.study.trials) == 3 and all(t.state.name == "COMPLETE" for t in sweep.study.trials)


@pytest.mark.parametrize("gpu_in_use", [False, True])
def test_between_trials_memory_is_collected_only_where_a_gpu_holds_it(monkeypatch, gpu_in_use):
    """A full collection between trials returns a GPU's memory (cycles, then the allocator's cache);
    on the CPU reference counting frees a trial's tensors, and a collection costs a trial 0.1-0.2 s."""
    import gc

    collected, emptied = [], []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(a) or 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: gpu_in_use)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    sweep = Trainer(**FIT).sweep(_build, trials=3, sampler="random", seed=0, name="free")
    assert len(sweep.rows) == 3
    assert len(collected) == (3 if gpu_in_use else 0)  # after each trial (the fit empties the cache too)
    assert len(emptied) >= len(collected) and bool(emptied) == gpu_in_use
