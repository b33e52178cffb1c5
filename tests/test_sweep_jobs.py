"""A sweep's trials as jobs from the cell: on Slurm (`--cluster slurm`, a requeued trial resumes
exactly as the same trial, a poor one is pruned) and on this machine with `--detach`.

Every test ends with no process of its jobs left (test_jobs's `no_leftovers` fixture)."""

import json
import os
import sys
import time

import cloudpickle
import pytest
import torch
from conftest import classification_data, mlp
from test_jobs import assert_resumed_from_the_newest_checkpoint, no_leftovers, weights_equal  # noqa: F401
from torch import nn

from gpunb import Trainer
from gpunb.runs import Registry

optuna = pytest.importorskip("optuna")
pytest.importorskip("submitit")

# The jobs import nothing from the tests (pytest's sys.path is not theirs): SlowLoss travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# One parameter: a random sampler seeded 2 draws slow=1.0 for trials 0, 1 and 2 and 1e-6 (the
# weights barely move) for trial 3. Two at a time, trial 3 starts once two trials have completed,
# so the median pruner has two finished trials to judge it by, and prunes it at its first validation.
CELL = """
import gpunb
slow = gpunb.suggest("slow", [1.0, 1e-6])
model = mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=0.3 * slow)
train_data, val_data = (x[:128], y[:128]), (x[128:], y[128:])
callbacks = [watch.trial()]
loss_fn = SlowLoss(**watch.hold())
"""
# Validations every 4 steps, checkpoints every 8. Trial 0's first start holds in step 22 until it is
# requeued, which the kernel does once it has seen step 20: the job resumes from the checkpoint of
# step 16 (of two) and validates again at step 20, which the kernel has seen (one point each).
STEPS, VALIDATE, CHECKPOINT, REQUEUE_AT = 100, 4, 8, 20
LINE = (f"--trials 4 --parallel 2 --sampler random --seed 2 --prune median --monitor val_loss --name sl "
        f"--max-steps {STEPS} --val-every-steps {VALIDATE} --checkpoint-every {CHECKPOINT} --log-every 4 "
        "--batch-size 16 --accelerator cpu --quiet")


class SlowLoss(nn.CrossEntropyLoss):
    """The same numbers, 0.1 s a step: a trial trains while a stop travels. With `marker`: the first
    start of the job (no marker yet) holds in training step `hold_at` until it is requeued."""

    def __init__(self, marker=None, hold_at=None):
        super().__init__()
        self.marker, self.hold_at, self.calls = marker, hold_at, 0

    def forward(self, output, target):
        time.sleep(0.1)
        if torch.is_grad_enabled():  # a training step (validation runs without gradients)
            self.calls += 1
            if self.calls == self.hold_at and self.marker and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                time.sleep(120)  # the requeue ends this process; the test fails if it never comes
        return super().forward(output, target)


class Trials:
    """Kernel side: each trial's JobResult (on_fit_end), by run name; `requeue(job)` is run once, when
    trial `requeue_run`'s rows reach step `at`."""

    def __init__(self, requeue=None, requeue_run=None, at=None, marker=None):
        self.requeue, self.requeue_run, self.at, self.marker = requeue, requeue_run, at, marker
        self.results, self.requeued, self.built = {}, None, 0

    def trial(self):
        return _TrialWatch(self)

    def hold(self) -> dict:
        """SlowLoss's arguments for the trial the cell builds now: the first (trial 0) holds in its
        first start until it is requeued, once the kernel has seen step `at`."""
        self.built += 1
        return dict(marker=self.marker, hold_at=self.at + 2) if self.built == 1 and self.marker else {}


class _TrialWatch:
    def __init__(self, trials):
        self.trials, self.job = trials, None

    def on_job_state(self, state, job):
        self.job = job

    def on_log(self, state, row):
        trials = self.trials
        if trials.requeued is None and self.job["name"] == trials.requeue_run and row["step"] >= trials.at:
            trials.requeued = (self.job["id"], row["step"])
            trials.requeue(self.job)

    def on_fit_end(self, state):
        self.trials.results[self.job["name"]] = state.result


def events_of(folder) -> list[dict]:
    with open(os.path.join(folder, "events.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def single_fit(slow, **settings):
    """One uninterrupted fit in this process of the trial's values, as the cell builds it."""
    x, y = classification_data(n=192)
    model = mlp()
    Trainer(**settings, track=False).fit(model, (x[:128], y[:128]), (x[128:], y[128:]), loss_fn=nn.CrossEntropyLoss(),
                                         optimizer=torch.optim.SGD(model.parameters(), lr=0.3 * slow))
    return model


def _set_up(ip, trials):
    ip.run_cell("x, y = classification_data(n=192)")
    ip.user_ns.update(SlowLoss=SlowLoss, watch=trials)


@pytest.mark.slurm
def test_a_sweep_on_slurm_resumes_a_requeued_trial_as_the_same_trial_and_prunes_a_poor_one(ip, slurm_cluster, tmp_path):
    trials = Trials(lambda job: slurm_cluster.run(["scontrol", "requeue", job["id"]]), "sl-t0", REQUEUE_AT,
                    marker=str(tmp_path / "held"))
    _set_up(ip, trials)
    ip.run_cell_magic("gputrain", f"{LINE} --cluster slurm --partition {slurm_cluster.partition} --slurm time=30",
                      CELL)
    sweep = ip.user_ns["gputrain_result"].sweep
    rows = {r.number: r for r in sweep.rows}
    assert sorted(rows) == [0, 1, 2, 3] and len(sweep.study.trials) == 4, sweep.rows  # no trial asked anew
    assert [rows[n].params["slow"] for n in range(4)] == [1.0, 1.0, 1.0, 1e-6]
    # The requeued trial: the same Slurm job (its id kept), followed on, resumed from the newest
    # checkpoint written before the requeue, told once as complete.
    requeued = trials.results["sl-t0"]
    job_id, at = trials.requeued
    assert requeued.job["id"] == job_id and requeued.status == "completed" and requeued.steps == STEPS
    kinds = [line["event"] for line in events_of(requeued.job["folder"])]
    assert kinds.count("job_started") == 2 and kinds.count("job_done") == 1
    assert_resumed_from_the_newest_checkpoint(requeued)
    assert requeued.resumed_from["step"] == 16 and at == REQUEUE_AT
    assert kinds.count("on_validation_end") == STEPS // VALIDATE + 1  # step 20's validation, again after the resume
    assert rows[0].state == "complete" and rows[0].steps == STEPS and rows[0].value is not None
    assert sweep.study.trials[0].state.name == "COMPLETE" and sweep.study.trials[0].value == rows[0].value
    runs = [r for r in Registry().list_runs() if r["name"].startswith("sl-t")]
    assert sorted(r["name"] for r in runs) == ["sl-t0", "sl-t1", "sl-t2", "sl-t3"]  # one job per trial
    run = next(r for r in runs if r["name"] == "sl-t0")
    assert (run["id"], run["job"]["id"], run["job"]["cluster"]) == (requeued.job["run_id"], job_id, "slurm")
    assert run["status"] == "completed"
    for each in runs:  # every trial's job ended (the pruned one too, at its stop): none left in Slurm's queue
        slurm_cluster.wait_for_state(each["job"]["id"], "COMPLETED", timeout=30)
    curve = [step for step, _ in rows[0].curve]  # validations replayed after the resume are not drawn twice
    assert curve == sorted(set(curve)) and curve[-1] == STEPS, rows[0].curve
    # Its weights are those of one uninterrupted fit of its values.
    settings = dict(max_steps=STEPS, val_every_steps=VALIDATE, batch_size=16, seed=2, accelerator="cpu")
    alone = single_fit(1.0, **settings)
    assert weights_equal(requeued.model, alone)
    # The poor trial: pruned at its first validation, stopped at a step boundary long before its end.
    pruned = rows[3]
    assert (pruned.state, pruned.pruned_at, pruned.value) == ("pruned", VALIDATE, None), sweep.rows
    assert VALIDATE <= pruned.steps < STEPS and sweep.study.trials[3].state.name == "PRUNED"
    assert trials.results["sl-t3"].status == "stopped"
    assert {rows[n].state for n in (1, 2)} == {"complete"}
    # The best trial's model is back in `model`, trained.
    assert sweep.best_trial in (0, 1, 2) and ip.user_ns["model"] is sweep.best_model
    assert weights_equal(ip.user_ns["model"], alone)


def test_a_validation_replayed_after_a_resume_is_one_point_of_the_trials_curve():
    from types import SimpleNamespace

    from gpunb.sweeps.trials import Curve, TrialRow

    row = TrialRow(0, {}, "running")
    curve = Curve(row, "val_loss")
    for step in (4, 8, 12, 8, 12, 16):  # resumed from the checkpoint at step 4 after validating at 8 and 12
        curve.on_validation_end(SimpleNamespace(step=step), {"val_loss": 1.0 / step})
    assert row.curve == [(4, 0.25), (8, 0.125), (12, 1 / 12), (16, 0.0625)]


DETACHED_CELL = """
import gpunb
model = mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=gpunb.suggest("lr", 1e-2, 3e-1, log=True))
train_data, val_data = (x[:128], y[:128]), (x[128:], y[128:])
loss_fn = nn.CrossEntropyLoss()
"""


def test_detach_runs_a_sweeps_trials_as_jobs_on_this_machine_one_at_a_time(ip):
    ip.run_cell("x, y = classification_data(n=192)")
    ip.run_cell_magic("gputrain", "--trials 2 --detach --sampler random --seed 0 --max-steps 8 --batch-size 16 "
                                  "--accelerator cpu --name det --quiet", DETACHED_CELL)
    sweep = ip.user_ns["gputrain_result"].sweep
    assert sorted(r.number for r in sweep.rows) == [0, 1] and {r.state for r in sweep.rows} == {"complete"}
    runs = {r["name"]: r for r in Registry().list_runs() if r["name"].startswith("det-t")}
    assert sorted(runs) == ["det-t0", "det-t1"] and {r["job"]["cluster"] for r in runs.values()} == {"local"}
    # --parallel 1 by default: the second trial's job starts after the first one's ended.
    first, second = (events_of(runs[name]["job"]["folder"]) for name in ("det-t0", "det-t1"))
    ended = max(line["t"] for line in first if line["event"] == "job_done")
    assert min(line["t"] for line in second if line["event"] == "job_started") > ended
    assert ip.user_ns["model"] is sweep.best_model and sweep.best_value == min(r.value for r in sweep.rows)


def test_a_sweep_on_slurm_gives_each_trials_job_the_options_of_a_single_slurm_run(ip, monkeypatch):
    from IPython.core.error import UsageError

    from gpunb.errors import GpunbError
    from gpunb.jobs import submit

    sent = []

    def refuse(config, entry, args, *, key, registry):
        sent.append((config, key))
        raise GpunbError("The job could not be submitted: this test's sbatch refuses it.", "none.")

    monkeypatch.setattr(submit, "submit", refuse)
    with pytest.raises(UsageError, match="this test's sbatch refuses it"):
        ip.run_cell_magic("gputrain", "--trials 3 --parallel 2 --cluster slurm --nodes 2 --partition gpu "
                                      "--slurm time=30 --slurm mem=4G --max-steps 4 --name opts --quiet",
                          "x, y = classification_data(n=64)\n" + DETACHED_CELL)
    (config, key), = sent  # the first trial's submission fails the sweep: a set-up mistake fails every trial
    assert (config.cluster, config.nodes, config.name, key) == ("slurm", 2, "opts-t0", "sweep:opts:trial:0")
    assert config.slurm == {"partition": "gpu", "time": "30", "mem": "4G"}


@pytest.mark.parametrize("line, fix", [("--no-wait", "drop `--no-wait`"), ("--resubmit", "drop `--resubmit`")])
def test_a_sweep_of_jobs_refuses_what_it_cannot_follow_before_the_cell_runs(ip, line, fix):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match=fix) as refused:
        ip.run_cell_magic("gputrain", f"--trials 2 --cluster slurm {line}", "ran = True\n" + DETACHED_CELL)
    assert "HINT:" in str(refused.value) and "ran" not in ip.user_ns
