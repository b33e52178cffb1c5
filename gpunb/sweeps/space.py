"""`gpunb.suggest`: a cell declares its search space where it uses it (define-by-run).

    lr = gpunb.suggest("lr", 1e-4, 1e-1, log=True)
    width = gpunb.suggest("width", [64, 128, 256])

Outside a sweep each call returns its default (the middle of the range, the first choice, or
`default=`), so the same cell trains once as it is. Inside a sweep it asks the trial being built:
an Optuna trial when the kernel's study samples, or the fixed values of a trial that runs again
(a requeued job, a re-attached sweep). Nothing here imports Optuna.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

from gpunb.errors import GpunbError

_CHOICE_TYPES = (bool, int, float, str, type(None))  # what Optuna stores for a categorical


@dataclass(frozen=True)
class Dimension:
    """One parameter of the search space: a range (low, high, log, integer) or choices."""

    name: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False
    choices: tuple | None = None
    default: object = None

    @property
    def middle(self):
        if self.choices is not None:
            return self.choices[0]
        middle = math.sqrt(self.low * self.high) if self.log else (self.low + self.high) / 2
        return round(middle) if self.integer else middle

    def ask(self, trial):
        """This dimension's value from an Optuna trial (define-by-run)."""
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.integer:
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.log)

    def describe(self) -> str:
        if self.choices is not None:
            return f"{self.name} in {list(self.choices)}"
        return f"{self.name} in [{self.low:g}, {self.high:g}]" + (" (log)" if self.log else "")


class _Source:
    """Where suggestions come from while a trial's cell runs: an Optuna trial or fixed values."""

    def __init__(self, trial=None, values: dict | None = None, recording: bool = False):
        self.trial, self.values, self.recording = trial, dict(values or {}), recording
        self.seen: dict[str, Dimension] = {}

    def value(self, dimension: Dimension):
        known = self.seen.get(dimension.name)
        if known is not None and known != dimension:
            raise GpunbError(f"gpunb.suggest({dimension.name!r}, ...) is called twice with different ranges: "
                             f"{known.describe()} and {dimension.describe()}.",
                             "give each parameter one range, or use two names.")
        self.seen[dimension.name] = dimension
        if self.trial is not None:
            return dimension.ask(self.trial)
        if self.recording:  # learning the space (a grid's): the value the cell gets outside a sweep
            return dimension.default if dimension.default is not None else dimension.middle
        if dimension.name not in self.values:
            raise GpunbError(f"this trial has no value for {dimension.name!r}: the cell asks for a parameter "
                             "the sweep did not sample (the cell changed since the sweep began).",
                             "run the cell as it was when the sweep began, or start a new sweep.")
        return self.values[dimension.name]


_active: _Source | None = None  # the trial whose cell runs now (a kernel builds one trial at a time)


@contextmanager
def trial_values(trial=None, values: dict | None = None, recording: bool = False):
    """While the block runs, `suggest` answers from `trial` (Optuna), from fixed `values`, or
    (`recording`) with its defaults.

    Yields the source; its `seen` then maps each name the cell asked for to its Dimension."""
    global _active
    previous, _active = _active, _Source(trial, values, recording)
    try:
        yield _active
    finally:
        _active = previous


def suggest(name: str, low, high=None, *, log: bool = False, default=None):
    """A hyperparameter of a sweep: a value from `[low, high]` (ints give ints), or one of `low` as a list.

    Outside a sweep it returns `default`, or else the middle of the range (the geometric middle
    with `log=True`) or the first choice, so the cell trains once as written.
    """
    dimension = dimension_of(name, low, high, log, default)
    if _active is None:
        return dimension.default if dimension.default is not None else dimension.middle
    return _active.value(dimension)


def dimension_of(name, low, high, log, default) -> Dimension:
    """The Dimension a `suggest` call describes, refused with the fix when it cannot be sampled."""
    if not isinstance(name, str) or not name:
        raise GpunbError(f"gpunb.suggest needs a parameter name first, got {name!r}.",
                         "e.g. `gpunb.suggest('lr', 1e-4, 1e-1, log=True)`.")
    if isinstance(low, (list, tuple)):
        return _choices(name, tuple(low), high, log, default)
    if high is None or isinstance(low, bool) or not all(isinstance(v, (int, float)) for v in (low, high)):
        raise GpunbError(f"gpunb.suggest({name!r}, {low!r}, {high!r}) needs a numeric range or a list of choices.",
                         f"e.g. `gpunb.suggest({name!r}, 1e-4, 1e-1, log=True)` or "
                         f"`gpunb.suggest({name!r}, [64, 128, 256])`.")
    if not low < high:
        raise GpunbError(f"gpunb.suggest({name!r}, {low!r}, {high!r}): the range is empty (low must be below high).",
                         f"e.g. `gpunb.suggest({name!r}, {min(low, high)!r}, {max(low, high)!r})`.")
    if log and low <= 0:
        raise GpunbError(f"gpunb.suggest({name!r}, {low!r}, {high!r}, log=True): a log range must be above zero.",
                         "give a positive low (e.g. 1e-5), or drop `log=True`.")
    integer = isinstance(low, int) and isinstance(high, int)
    if default is not None and not low <= default <= high:
        raise GpunbError(f"gpunb.suggest({name!r}, ...): default={default!r} is outside [{low}, {high}].",
                         "give a default inside the range, or none (the middle of the range).")
    return Dimension(name, low, high, log=log, integer=integer, default=default)


def _choices(name, choices, high, log, default) -> Dimension:
    if high is not None or log:
        raise GpunbError(f"gpunb.suggest({name!r}, [...]) takes choices alone: no high and no log.",
                         f"e.g. `gpunb.suggest({name!r}, {list(choices)!r})`.")
    if not choices or not all(isinstance(c, _CHOICE_TYPES) for c in choices):
        raise GpunbError(f"gpunb.suggest({name!r}, {list(choices)!r}): choices must be a non-empty list of "
                         "numbers, strings, booleans or None (what a study can store).",
                         "choose by a name and map it in the cell, e.g. "
                         "`act = {'relu': nn.ReLU, 'gelu': nn.GELU}[gpunb.suggest('act', ['relu', 'gelu'])]`.")
    if default is not None and default not in choices:
        raise GpunbError(f"gpunb.suggest({name!r}, ...): default={default!r} is not one of {list(choices)!r}.",
                         "give one of the choices as the default, or none (the first choice).")
    return Dimension(name, choices=choices, default=default)
