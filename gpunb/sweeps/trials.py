"""A sweep's trials in this process, one after another: ask the study, build, fit, tell.

Each trial is an ordinary fit (its own registry row, named after the sweep and the trial),
built afresh by `build(trial)` under the trial's values, so `gpunb.suggest` in the user's
code answers for that trial. The kernel is the study's only writer. A trial is pruned at a
validation by the study's pruner and stops at the next step boundary (with its checkpoint
when the run keeps them). The best trial's model is kept (on the CPU while later trials train)
and handed back at the end; every other trial's objects are freed before the next one is built.

A trial that fails is told failed (`TrialState.FAIL`), its row says why, and the sweep goes
on: its fit raised, ran out of memory beyond what the runtime recovers, or its job died; or
its build raised for its values (a width the model refuses). Only the first trial a sweep
builds is different: its build raising is a mistake in the cell that every trial would make,
raised at once (the trial told failed, no trial left running).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from gpunb.errors import GpunbError
from gpunb.runtime.validation.monitor import Monitor
from gpunb.sweeps.control import trial_tag
from gpunb.sweeps.space import trial_values
from gpunb.sweeps.study import SweepSettings, open_study


class Pruning:
    """Reports the monitored value at each validation; asks the run to stop when the pruner says so."""

    def __init__(self, trial, monitor: str, reported=()):
        self.trial, self.monitor = trial, monitor
        self.reported = set(reported)  # steps the study has a value for (a re-attached trial's replayed events)
        self.pruned_at: int | None = None
        self.stop = None  # how the trial is asked to stop (None: the run's own state; a job: its stop file)

    def on_validation_end(self, state, metrics) -> None:
        value = metrics.get(self.monitor)
        if value is None or self.pruned_at is not None or state.step in self.reported:
            return
        self.reported.add(state.step)
        self.trial.report(float(value), state.step)
        if self.trial.should_prune():
            self.pruned_at = state.step
            (self.stop or state.request_stop)(f"pruned by the sweep at step {state.step} ({self.monitor}={value:.4g})")


@dataclass
class TrialRow:
    """One trial as the sweep's table shows it."""

    number: int
    params: dict
    state: str  # "running", then "complete", "pruned", "failed" or "stopped" (the user stopped the sweep)
    value: float | None = None
    pruned_at: int | None = None
    steps: int = 0
    seconds: float = 0.0
    run_name: str | None = None
    error: str | None = None
    curve: list = field(default_factory=list, repr=False)  # (step, monitored value) at each validation


def run_trials(build, fit, settings: SweepSettings, folder, name: str, *, space: dict | None = None,
               on_trial=None, watch=(), stop=None):
    """Run `settings.trials` trials one after another; returns (rows, study, best).

    `build(trial)` -> fit's arguments (model, train_data, ...); `fit(arguments, callbacks, trial_name)` -> TrainResult.
    `on_trial(row)`: called as each trial ends. `watch`: callbacks that every trial's fit calls too,
    told of each trial as it starts (`announce`: a live view of the sweep).
    `best`: (row, model, result) of the best completed trial, or None when none completed.
    `stop`: a SweepStop; once asked, no trial is asked any more (one of `watch` stops the running one).
    """
    study = open_study(folder, name, settings.check(), space)
    rows, best = [], None
    for _ in range(settings.trials):
        if stop is not None and stop.asked():
            break
        trial = study.ask()
        try:
            row, kept = _one_trial(trial, build, fit, settings, name, first=not rows, watch=watch, stop=stop)
        except BaseException:
            tell(study, trial, TrialRow(trial.number, {}, "failed"))  # no trial is left "running"
            raise
        tell(study, trial, row)
        rows.append(row)
        if on_trial is not None:
            on_trial(row)
        if row.state == "stopped":  # the user stopped the sweep: its trial kept its checkpoint
            break
        if kept is not None and (best is None or better(row, best[0], settings)):
            best = (row, *kept, _device_of(kept[0]))
            best[1].to("cpu")  # the best so far waits on the CPU: later trials get the device's memory
        kept = None
        _free()  # the finished trial's model, optimizer and batches go before the next is built
    if best is not None and best[3] is not None:
        best[1].to(best[3])
    return rows, study, best and best[:3]


def _one_trial(trial, build, fit, settings: SweepSettings, name: str, first: bool, watch=(), stop=None):
    """Build and fit one trial; its row, and (model, result) when it completed."""
    started = time.perf_counter()
    row = TrialRow(trial.number, {}, "running", run_name=f"{name}-t{trial.number}")
    announce(watch, row)
    pruning = Pruning(trial, settings.monitor)
    try:
        arguments = build_trial(trial, build, settings)
    except Exception as error:  # noqa: BLE001 - a later trial's values may not build: recorded
        if first:  # the first build: a mistake in the cell, which every trial would make
            raise
        return failed(row, trial, error, started), None
    row.params = dict(trial.params)
    try:
        result = fit(arguments, [pruning, Curve(row, settings.monitor), *watch], row.run_name,
                     sweep=trial_tag(name, trial.number, settings))
    except Exception as error:  # noqa: BLE001 - a trial that fails is recorded and the sweep goes on
        return failed(row, trial, error, started), None
    row.steps, row.seconds = result.steps, time.perf_counter() - started
    if pruning.pruned_at is not None:
        row.state, row.pruned_at = "pruned", pruning.pruned_at
        return row, None
    if result.interrupted or (result.stop_reason and stop is not None and stop.asked()):  # the sweep's stop
        row.state, row.error = "stopped", result.stop_reason or "stopped"
        return row, None
    row.value = trial_value(result, arguments, settings.monitor)
    if row.value is None:
        produced = [k for k in (result.validations or [{}])[-1] if k.startswith("val_")]
        Monitor(settings.monitor).check_produced(produced or None, "The sweep")
    row.state = "complete"
    return row, (arguments["model"], result)


def announce(watch, row: TrialRow) -> None:
    """The watchers of the sweep (its live view) hear of a trial that starts: `trial_started(row)`,
    where a watcher has it (several may run at once: the row says which)."""
    for watcher in watch:
        started = getattr(watcher, "trial_started", None)
        if started is not None:
            started(row)


def build_trial(trial, build, settings: SweepSettings) -> dict:
    """The trial's fit arguments, built by `build(trial)` under the trial's values."""
    with trial_values(trial=trial):
        arguments = build(trial)
    if arguments.get("val_data") is None:  # the objective is a validation metric
        Monitor(settings.monitor).check_produced(None, "The sweep")
    return arguments


def failed(row: TrialRow, trial, error: BaseException, started: float | None = None) -> TrialRow:
    """The row of a trial that failed and why: gpunb's own errors by what happened (a job's error
    without the job's traceback), others by their type and message."""
    row.state, row.params = "failed", dict(trial.params)
    row.error = error.what if isinstance(error, GpunbError) else f"{type(error).__name__}: {error}"
    if started is not None:
        row.seconds = time.perf_counter() - started
    return row


class Curve:
    """The monitored value at each validation, for the sweep's overlaid curves."""

    def __init__(self, row: TrialRow, monitor: str):
        self.row, self.monitor = row, monitor

    def on_validation_end(self, state, metrics) -> None:
        # A requeued trial's job goes on from its checkpoint and validates again at steps already
        # drawn (the same values: it resumes exactly); each step is one point.
        if metrics.get(self.monitor) is not None and all(step != state.step for step, _ in self.row.curve):
            self.row.curve.append((state.step, float(metrics[self.monitor])))


def trial_value(result, arguments: dict, monitor: str) -> float | None:
    """The monitored value of the weights the trial ends with (with restore_best: of its best)."""
    if result.restored_best and result.best_monitor == monitor:
        return result.best_value
    last = result.validations[-1] if result.validations else None
    if last is not None and last.get("step") == result.steps and last.get(monitor) is not None:
        return float(last[monitor])
    val_data = arguments.get("val_data")
    if val_data is None:
        return None
    value = result.evaluate(val_data).get(monitor)  # the final weights were not validated yet
    return None if value is None else float(value)


def tell(study, trial, row: TrialRow) -> None:
    from optuna.trial import TrialState

    if row.state == "complete":
        study.tell(trial, row.value)
    elif row.state == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, state=TrialState.FAIL)


def better(row: TrialRow, best: TrialRow, settings: SweepSettings) -> bool:
    if settings.resolved_direction() == "minimize":
        return row.value < best.value
    return row.value > best.value


def _device_of(model):
    for tensor in model.parameters():
        return tensor.device
    return None


def _free() -> None:
    """A finished trial's GPU memory back before the next trial is built: its cycles collected and
    the allocator's cache emptied. Without a GPU in use, nothing: reference counting frees its
    tensors as their last reference goes, and a full collection costs 0.1-0.2 s a trial in a
    kernel full of objects (Optuna's own `gc_after_trial` is off by default for that reason)."""
    import torch

    if torch.cuda.is_initialized():  # this process has used a GPU
        gc.collect()
        torch.cuda.empty_cache()
