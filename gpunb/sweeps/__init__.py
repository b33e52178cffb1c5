"""Sweeps: one training cell run as many trials, sampled and pruned by an Optuna study the kernel holds.

    space.py    gpunb.suggest: the search space declared where the cell uses it
    study.py    the study (a journal file in the sweep's folder), its sampler, pruner and direction
    trials.py   trials one after another in this process: ask, build, fit, tell; the best model kept
    parallel.py trials as jobs, K at a time, followed and pruned from the kernel; re-attached by key
    __init__    run_sweep, an unnamed sweep's name (the same cell finds its unfinished sweep), SweepFailed
    result.py   SweepResult: the trials as a table, overlaid curves, the objective per parameter

Sits below the Trainer: the Trainer and the magic hand it how to build and fit one trial.
"""

from __future__ import annotations

from gpunb.errors import GpunbError
from gpunb.sweeps.space import suggest
from gpunb.sweeps.study import SweepSettings

__all__ = ["suggest", "SweepSettings", "run_sweep"]


def run_sweep(build, fit, settings: SweepSettings, *, name: str | None = None, space: dict | None = None,
              on_trial=None, watch=(), parallel: int = 1, start=None, key: str | None = None, registry=None):
    """Run the sweep's trials; returns a SweepResult (the best trial's model trained). In this process
    one after another, or with `start` (a trial's job: `start(arguments, callbacks, trial_name, key,
    sweep=tag)` -> its Follower) as jobs, `parallel` at a time. Without a `name`, the sweep is named
    after `key` (the cell and its options; default: build's source) by `default_name`. A sweep whose
    every trial failed raises SweepFailed, naming the first failure. `registry`: the run registry its
    trials are recorded in, where a stop of the whole sweep is asked (None: not tracked, no such stop)."""
    from gpunb.runs.paths import data_dir
    from gpunb.sweeps.control import SweepStop
    from gpunb.sweeps.result import SweepResult
    from gpunb.sweeps.trials import run_trials

    name = name or default_name(key if key is not None else _source(build), settings, parallel, start is not None)
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
    if rows and all(row.state == "failed" for row in rows):
        raise SweepFailed(result)
    return result


class SweepFailed(GpunbError):
    """Every trial of the sweep failed; `sweep` is its SweepResult (each trial's error in its table)."""

    def __init__(self, sweep):
        first = min(sweep.rows, key=lambda row: row.number)
        self.sweep = sweep
        super().__init__(f"Every trial of sweep {sweep.name!r} failed ({len(sweep.rows)}); the first, trial "
                         f"{first.number}: {first.error}",
                         "fix what trial {0} says (a mistake every trial makes is in the cell or its options), "
                         "then run the cell again; each trial's error is in the exception's "
                         "`sweep.table`.".format(first.number))


def default_name(key: str, settings: SweepSettings, parallel: int, as_jobs: bool) -> str:
    """An unnamed sweep's name: `sweep-<hash of key, settings, parallel>`, so the same cell run again
    (after a kernel restart) finds its sweep. A sweep of jobs that is unfinished there (trials
    still running, or fewer than asked) is the one to go on with; a finished one, or a sweep in the
    kernel (its trials ended with the kernel), is kept as it is and the next free name is used
    (`-2`, `-3`, ...)."""
    import hashlib
    import itertools

    from gpunb.runs.paths import data_dir
    from gpunb.sweeps.study import unfinished

    digest = hashlib.sha256(f"{key}\n{settings!r}\nparallel={parallel}".encode()).hexdigest()[:10]
    for number in itertools.count(1):
        name = f"sweep-{digest}" + (f"-{number}" if number > 1 else "")
        folder = data_dir() / "sweeps" / name
        if not (folder / "study.log").exists():
            return name
        if as_jobs and unfinished(folder, name, settings.trials):
            return name


def _source(build) -> str:
    """What an unnamed sweep of `build` is named after: its source, else its qualified name."""
    import inspect

    try:
        return inspect.getsource(build)
    except (OSError, TypeError):
        return f"{getattr(build, '__module__', '')}.{getattr(build, '__qualname__', repr(build))}"


def _recorded_space(build) -> dict:
    """A grid needs the whole space before its first trial: build once (`build(None)`), answering
    every `suggest` with its default, and keep what it asked for."""
    from gpunb.sweeps.space import trial_values
    from gpunb.sweeps.trials import _free

    with trial_values(recording=True) as source:
        build(None)
    _free()
    return source.seen
