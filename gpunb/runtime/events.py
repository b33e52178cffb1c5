"""The events a training run emits, and the state every callback receives.

Callbacks are plain objects: the runtime looks up a method named after each event
with `getattr` and calls it with the run's `RunState` (no base class to inherit).

    on_fit_start(state)            after set-up, before the first step
    on_step_end(state)             after every optimizer step (keep it cheap: no syncs)
    on_log(state, metrics)         every `log_every` steps, with host-side floats
    on_validation_end(state, metrics)  at epoch ends, or every val_every_steps steps (before on_step_end)
    on_epoch_end(state, metrics)
    on_checkpoint(state, path)     after a checkpoint is written
    on_fit_end(state)              always last on success or interrupt; state.result is set
    on_exception(state, error)     when fit raises; on_fit_end is not called then

Any hook may call `state.request_stop(reason)`: the loop stops cleanly at the next
step boundary (in multi-process runs: at the next log interval, on every rank at the
same step), writing a checkpoint when a directory is set.

`on_train_batch_end`, the old name of `on_step_end`, is still called for callbacks that
define it (and not `on_step_end`), with a DeprecationWarning once per callback class.
"""

from __future__ import annotations

import warnings
from typing import Any

from gpunb.runtime.run_state import RunState

EVENTS = (
    "on_fit_start",
    "on_step_end",
    "on_log",
    "on_validation_end",
    "on_epoch_end",
    "on_checkpoint",
    "on_fit_end",
    "on_exception",
)


# The state every callback receives: the run's own (runtime/run_state.py), under the name
# callbacks have known it by.
FitState = RunState


_OLD_NAMES = {"on_step_end": "on_train_batch_end"}
_warned: set = set()  # callback classes already told about their old hook name


class Callbacks:
    """Calls an event on each callback that defines it, in order.

    Each event's hooks are looked up once, at its first call, so that an event no callback
    defines (often `on_step_end`, after every optimizer step) costs one dict lookup.
    """

    def __init__(self, callbacks=()):
        self.callbacks = list(callbacks)
        self._hooks: dict = {}  # event -> the bound hooks to call, in order

    def run_first(self, callback) -> None:
        """Put `callback` before all others (a checkpoint is written before others hear of the step)."""
        self.callbacks.insert(0, callback)
        self._hooks.clear()

    def add(self, callback) -> None:
        self.callbacks.append(callback)
        self._hooks.clear()

    def remove(self, callback) -> None:
        """Stop calling `callback` (also from within one of its own hooks); absent: nothing."""
        if callback in self.callbacks:
            self.callbacks.remove(callback)
            self._hooks.clear()

    def call(self, event: str, *args: Any) -> None:
        hooks = self._hooks.get(event)
        if hooks is None:
            hooks = self._hooks[event] = self._lookup(event)
        for hook in hooks:
            hook(*args)

    def _lookup(self, event: str) -> tuple:
        assert event in EVENTS, event
        hooks = []
        for callback in self.callbacks:
            hook = getattr(callback, event, None)
            if hook is None and event in _OLD_NAMES:
                hook = _old_hook(callback, event)
            if hook is not None:
                hooks.append(hook)
        return tuple(hooks)


def _old_hook(callback, event: str):
    """The hook under its old name, with a DeprecationWarning the first time per class."""
    old = _OLD_NAMES[event]
    hook = getattr(callback, old, None)
    if hook is not None and type(callback) not in _warned:
        _warned.add(type(callback))
        code = getattr(hook, "__code__", None)  # point at the user's def, so a notebook shows it
        warnings.warn_explicit(f"{type(callback).__name__}.{old} is deprecated: name the hook {event} "
                               f"(called after every optimizer step, as {old} was).", DeprecationWarning,
                               filename=code.co_filename if code else __file__,
                               lineno=code.co_firstlineno if code else 1,
                               module=type(callback).__module__)
    return hook
