"""A sweep's trials as jobs, K at a time, followed from the kernel (`--parallel K`).

Each trial is an ordinary job of gpunb (jobs/): built in the kernel from the cell with the
trial's values, shipped, trained in processes of its own, its events relayed into a mirror
here. The kernel alone holds the study: the trials report their monitored value through
their events, the kernel asks the pruner, and a pruned trial is asked to stop at its next
step (its checkpoint kept), so a trial of several ranks prunes like a single one. A freed
slot takes the next trial at once.

A trial's job has a key made of the sweep's name and the trial's number: running the cell
again (after a kernel restart) finds the study's running trials' jobs and follows them
instead of asking new ones. The kernel's interrupt stops the running trials at their next
step and asks no more; a second one cancels them; a kernel shutting down leaves them running.

A trial that fails is recorded failed and its slot takes the next trial: its job raised (an
error, an OOM the runtime could not recover) or died, or its build raised for its values. The
first trial this run of the cell builds raising is raised at once (trials.py says why).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpunb.sweeps.control import trial_tag
from gpunb.sweeps.space import trial_values
from gpunb.sweeps.study import SweepSettings, asked, open_study
from gpunb.sweeps.trials import Curve, Pruning, TrialRow, better, build_trial, failed, tell, trial_value

POLL_S = 0.1  # how often the running trials' events are read


@dataclass
class _Running:
    trial: object  # the Optuna trial (a FrozenTrial when re-attached)
    row: TrialRow
    follower: object  # jobs.follow.Follower
    pruning: Pruning
    arguments: dict
    started: float


def trial_key(name: str, number: int) -> str:
    return f"sweep:{name}:trial:{number}"


def run_trial_jobs(build, start, settings: SweepSettings, folder, name: str, parallel: int, *,
                   space: dict | None = None, on_trial=None, stop=None):
    """Run the sweep's trials as jobs, `parallel` at a time; returns (rows, study, best) as run_trials.

    `start(arguments, callbacks, trial_name, key)` submits (or finds) one trial's job and returns
    its Follower. `stop`: a SweepStop; once asked, the running trials stop and no more are asked."""
    from gpunb.jobs.interrupts import KernelInterrupts

    study = open_study(folder, name, settings.check(), space)
    running = [_reattach(study, frozen, build, start, settings, name) for frozen in _running_trials(study)]
    to_ask = max(0, settings.trials - len(asked(study.trials)))
    rows, best, stopping = [], None, False

    def ended(row: TrialRow) -> None:
        rows.append(row)
        if on_trial is not None:
            on_trial(row)

    with KernelInterrupts() as interrupts:
        while running or (to_ask and not stopping):
            if stop is not None and stop.stops(entry.follower for entry in running):  # before any ask
                stopping = True
            while to_ask and not stopping and len(running) < parallel:
                started = _start(study.ask(), build, start, settings, name, first=not (rows or running))
                to_ask -= 1
                if isinstance(started, _Running):
                    running.append(started)
                else:  # its build failed: told failed, and the slot takes the next trial
                    ended(started)
            stopping = _interrupts(interrupts, running) or stopping
            if stopping is None:  # the kernel shuts down: the jobs go on, a re-run follows them
                return rows, study, None
            for entry in list(running):
                result = _poll(entry, settings)
                if result is not None:
                    running.remove(entry)
                    tell(study, entry.trial, entry.row)
                    ended(entry.row)
                    if result is not True and (best is None or better(entry.row, best[0], settings)):
                        best = (entry.row, entry.arguments["model"], result)
            time.sleep(POLL_S)
    return rows, study, best


def _running_trials(study) -> list:
    from optuna.trial import TrialState

    return [frozen for frozen in study.trials if frozen.state == TrialState.RUNNING]


def _start(trial, build, start, settings: SweepSettings, name: str, first: bool):
    """The trial's job, submitted: its _Running; or its row, failed, when its build or submission
    raised (raised instead when it is the `first` this run builds: a mistake every trial would make)."""
    row = TrialRow(trial.number, {}, "running", run_name=f"{name}-t{trial.number}")
    try:
        arguments = build_trial(trial, build, settings)
        row.params = dict(trial.params)
        return _submitted(trial, row, arguments, start, settings, name)
    except BaseException as error:
        tell(trial.study, trial, failed(row, trial, error))  # no trial is left "running" in the study
        if first or not isinstance(error, Exception):
            raise
        return row


def _reattach(study, frozen, build, start, settings: SweepSettings, name: str) -> _Running:
    """A trial the study still holds as running: its job, found by its key, followed again; its
    objects built from the cell with the trial's own values (the weights come back into them)."""
    from optuna.trial import Trial

    row = TrialRow(frozen.number, dict(frozen.params), "running", run_name=f"{name}-t{frozen.number}")
    with trial_values(values=frozen.params):
        arguments = build(_FixedTrial(frozen))
    return _submitted(Trial(study, frozen._trial_id), row, arguments, start, settings, name,
                      reported=frozen.intermediate_values)


def _submitted(trial, row, arguments, start, settings, name: str, reported=()) -> _Running:
    pruning = Pruning(trial, settings.monitor, reported)
    follower = start(arguments, [pruning, Curve(row, settings.monitor)], row.run_name, trial_key(name, row.number),
                     sweep=trial_tag(name, row.number, settings))
    pruning.stop = follower.stop  # a job stops at its next step through its stop file
    return _Running(trial, row, follower, pruning, arguments, time.perf_counter())


def _poll(entry: _Running, settings: SweepSettings):
    """None while the trial's job runs; at its end: its result when it completed, else True."""
    row = entry.row
    try:
        result = entry.follower.poll()
    except Exception as error:  # noqa: BLE001 - its job raised or died: recorded, and the sweep goes on
        failed(row, entry.trial, error).seconds = time.perf_counter() - entry.started
        return True
    if result is None:
        return None
    row.steps, row.seconds = result.steps, time.perf_counter() - entry.started
    if entry.pruning.pruned_at is not None:
        row.state, row.pruned_at = "pruned", entry.pruning.pruned_at
        return True
    if result.status != "completed":
        row.state, row.error = "stopped", result.stop_reason or result.status
        return True
    row.value = trial_value(result, entry.arguments, settings.monitor)
    if row.value is None:
        row.state, row.error = "failed", f"the run measured no {settings.monitor}"
        return True
    row.state = "complete"
    return result


def _interrupts(interrupts, running) -> bool | None:
    """The kernel's interrupts that stand: the first stops the running trials, a second cancels them;
    None when the kernel shuts down."""
    if interrupts.shutting_down():
        return None
    pressed = interrupts.due()
    if pressed >= 2:
        for entry in running:
            entry.follower.cancel("the sweep was cancelled from the notebook")
        return True
    if pressed == 1:
        for entry in running:
            if not entry.follower.stop_asked:
                entry.follower.stop("the sweep was stopped from the notebook")
        return True
    return False


class _FixedTrial:
    """What `build(trial)` receives for a re-attached trial: its number and values."""

    def __init__(self, frozen):
        self.number, self.params = frozen.number, dict(frozen.params)
