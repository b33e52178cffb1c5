"""Sweeps: one training cell run as many trials, sampled and pruned by an Optuna study the kernel holds.

    space.py    gpunb.suggest: the search space declared where the cell uses it
    study.py    the study (a journal file in the sweep's folder), its sampler, pruner and direction
    trials.py   trials one after another in this process: ask, build, fit, tell; the best model kept
    parallel.py trials as jobs, K at a time, followed and pruned from the kernel; re-attached by key
    result.py   SweepResult: the trials as a table, overlaid curves, the objective per parameter

Sits below the Trainer: the Trainer and the magic hand it how to build and fit one trial.
"""

from __future__ import annotations

import time

from gpunb.sweeps.space import suggest
from gpunb.sweeps.study import SweepSettings

__all__ = ["suggest", "SweepSettings", "run_sweep"]


def run_sweep(build, fit, settings: SweepSettings, *, name: str | None = None, space: dict | None = None,
              on_trial=None, watch=(), parallel: int = 1, start=None, registry=None):
    """Run the sweep's trials; returns a SweepResult (the best trial's model trained). In this process
    one after another, or with `start` (a trial's job: `start(arguments, callbacks, trial_name, key,
    sweep=tag)` -> its Follower) as jobs, `parallel` at a time. `registry`: the run registry its trials
    are recorded in, where a stop of the whole sweep is asked (None: not tracked, no such stop)."""
    from gpunb.runs.paths import data_dir
    from gpunb.sweeps.control import SweepStop
    from gpunb.sweeps.result import SweepResult
    from gpunb.sweeps.trials import run_trials

    name = name or time.strftime("sweep-%Y%m%d-%H%M%S")
    folder = data_dir() / "sweeps" / name
    if settings.sampler == "grid" and space is None:
        space = _recorded_space(build)
    stop = SweepStop(name, registry)
    stop.clear()  # the cell run again goes on with the sweep
    if start is not None:
        from gpunb.sweeps.parallel import run_trial_jobs

        rows, study, best = run_trial_jobs(build, start, settings.check(), folder, name, parallel, space=space,
                                           on_trial=on_trial, stop=stop)
    else:
        rows, study, best = run_trials(build, fit, settings.check(), folder, name, space=space,
                                       on_trial=on_trial, watch=(*watch, stop), stop=stop)
    result = SweepResult(name, str(folder), settings.monitor, settings.resolved_direction(), rows, study)
    if best is not None:
        result.best_trial, result.best_result = best[0].number, best[2]
        result.best_model = best[1]
    return result


def _recorded_space(build) -> dict:
    """A grid needs the whole space before its first trial: build once (`build(None)`), answering
    every `suggest` with its default, and keep what it asked for."""
    from gpunb.sweeps.space import trial_values
    from gpunb.sweeps.trials import _free

    with trial_values(recording=True) as source:
        build(None)
    _free()
    return source.seen
