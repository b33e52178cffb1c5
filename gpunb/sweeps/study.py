"""The sweep's Optuna study: held by the kernel, its only writer, in a journal file in the sweep's folder.

Optuna's FAQ warns against SQLite with parallel writers; here there is one writer (the
kernel asks and tells for every trial), and the journal file (`JournalFileBackend`) is
plain appended lines that a re-run of the cell opens again to go on with the same study.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from gpunb.errors import GpunbError

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("asha", "median", "none")
DIRECTIONS = ("minimize", "maximize")


@dataclass(frozen=True)
class SweepSettings:
    """How a sweep samples, prunes and judges its trials (the magic's --trials, --prune, ...)."""

    trials: int
    sampler: str = "tpe"
    prune: str = "none"
    direction: str | None = None  # None: from the monitor ("val_acc" is maximized, "val_loss" minimized)
    seed: int | None = None
    monitor: str = "val_loss"

    def check(self) -> "SweepSettings":
        if not isinstance(self.trials, int) or self.trials < 1:
            raise GpunbError(f"a sweep needs a number of trials of at least 1, got {self.trials!r}.",
                             "e.g. `--trials 16` (Trainer.sweep(..., trials=16)).")
        _one_of("sampler", self.sampler, SAMPLERS)
        _one_of("prune", self.prune, PRUNERS)
        if self.direction is not None:
            _one_of("direction", self.direction, DIRECTIONS)
        return self

    def resolved_direction(self) -> str:
        from gpunb.runtime.validation.monitor import default_mode

        if self.direction is not None:
            return self.direction
        return "maximize" if default_mode(self.monitor) == "max" else "minimize"


def _one_of(what: str, value, allowed: tuple) -> None:
    if value not in allowed:
        shown = " | ".join(allowed)
        raise GpunbError(f"{what} must be one of {shown}, got {value!r}.", f"e.g. `--{what} {allowed[0]}`.")


def optuna_module():
    """Optuna, or the one message that says how to get it."""
    try:
        import optuna
    except ImportError:
        raise GpunbError("sweeps use Optuna, which is not installed.",
                         "`pip install gpunb[sweep]` (or `pip install optuna`).") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep's table says what each trial did
    return optuna


def open_study(folder: Path, name: str, settings: SweepSettings, space: dict | None = None):
    """The study in `folder/study.log`: created, or loaded when a sweep of this name began before."""
    optuna = optuna_module()
    grid = grid_of(space or {}, settings) if settings.sampler == "grid" else None
    folder.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(study_name=name, storage=_storage(folder), load_if_exists=True,
                                direction=settings.resolved_direction(), sampler=_sampler(optuna, settings),
                                pruner=_pruner(optuna, settings.prune))
    if grid and not study.trials:
        for point in grid:
            study.enqueue_trial(point)
    elif study.trials and settings.seed is not None:
        # A sweep run again goes on with its study; a sampler seeded as before would draw its first
        # trials again. Seeded by the trials it has, it goes on deterministically with new ones.
        study.sampler = _sampler(optuna, dataclasses.replace(settings, seed=settings.seed + len(study.trials)))
    return study


def unfinished(folder: Path, name: str, trials: int) -> bool:
    """Whether the sweep in `folder` has trials still running, or fewer than `trials`."""
    optuna = optuna_module()
    try:
        held = optuna.load_study(study_name=name, storage=_storage(folder)).trials
    except KeyError:  # a folder without the study (its first trial never asked)
        return True
    return len(asked(held)) < trials or any(t.state == optuna.trial.TrialState.RUNNING for t in held)


def asked(trials: list) -> list:
    """The trials asked for so far (a grid's points wait in the study until they are)."""
    from optuna.trial import TrialState

    return [trial for trial in trials if trial.state != TrialState.WAITING]


def _storage(folder: Path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

    path = str(folder / "study.log")
    # The kernel is the study's only writer and holds its lock for one append: a lock older than a
    # few seconds was left by a kernel that died writing, and is taken over (3 s: the least Optuna advises).
    return JournalStorage(JournalFileBackend(path, lock_obj=JournalFileSymlinkLock(path, grace_period=3)))


def _sampler(optuna, settings: SweepSettings):
    if settings.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=settings.seed)
    return optuna.samplers.RandomSampler(seed=settings.seed)  # a grid's points are queued ahead of it


def grid_of(space: dict, settings: SweepSettings) -> list[dict]:
    """Every combination of the choices, in an order shuffled by the seed (Optuna's GridSampler
    stops the study from inside `tell` when its grid runs out, which ask-and-tell cannot take,
    so the points are queued as trials instead)."""
    import itertools
    import random

    ranges = [d.name for d in space.values() if d.choices is None]
    if ranges:
        raise GpunbError(f"--sampler grid tries every combination of choices, and {', '.join(ranges)} "
                         "is a range.", "give it choices (`gpunb.suggest('lr', [1e-3, 3e-3, 1e-2])`), "
                         "or use `--sampler tpe` or `random`.")
    names = list(space)
    points = [dict(zip(names, values)) for values in itertools.product(*(space[n].choices for n in names))]
    if settings.trials > len(points):
        raise GpunbError(f"--trials {settings.trials} and the grid has {len(points)} combinations.",
                         f"ask for at most `--trials {len(points)}`, or add choices.")
    random.Random(settings.seed).shuffle(points)
    return points


def _pruner(optuna, prune: str):
    if prune == "asha":
        return optuna.pruners.SuccessiveHalvingPruner()
    if prune == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    return optuna.pruners.NopPruner()
