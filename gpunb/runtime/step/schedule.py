"""The learning-rate schedule of a fit: a shorthand (`lr_schedule`) or the user's own scheduler.

`fit(..., scheduler=...)` takes, as Lightning's `lr_scheduler_config` does:

    a torch LRScheduler built on the optimizer that is trained     stepped after every optimizer step
    a factory `f(optimizer, total_steps) -> scheduler`             called once the run's length is known
    {"scheduler": either of those, "interval": "epoch"}            stepped at each epoch's end instead
    ReduceLROnPlateau (alone or in the dict, "monitor": "val_acc")  stepped with the monitored validation
                                                                    metric after each validation (default val_loss)

The schedule steps per optimizer step from the Stepper (before a checkpoint is written)
and, as a callback that runs before the checkpointer, at validation and epoch ends.
"""

from __future__ import annotations

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from gpunb.errors import GpunbError
from gpunb.runtime.step.optimizer import make_scheduler

INTERVALS = ("step", "epoch")
_KEYS = ("scheduler", "interval", "monitor")


class Schedule:
    """A torch scheduler and when to step it."""

    def __init__(self, scheduler, interval: str = "step", monitor: str = "val_loss", builtin: str | None = None):
        self.scheduler, self.interval, self.monitor = scheduler, interval, monitor
        self.builtin = builtin  # the lr_schedule shorthand it was built from, None for the user's own
        self.plateau = isinstance(scheduler, ReduceLROnPlateau)

    def after_step(self) -> None:
        if self.interval == "step" and not self.plateau:
            self.scheduler.step()

    def on_validation_end(self, state, metrics) -> None:
        if not self.plateau:
            return
        if self.monitor not in metrics:
            raise GpunbError(f"ReduceLROnPlateau monitors {self.monitor!r}, and validation gave only "
                             f"{', '.join(map(repr, sorted(metrics))) or 'nothing'}.",
                             "pass `scheduler={'scheduler': s, 'monitor': '<one of those>'}`.")
        self.scheduler.step(metrics[self.monitor])

    def on_epoch_end(self, state, metrics) -> None:
        if self.interval == "epoch" and not self.plateau:
            self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


def build_schedule(spec, optimizer, config, total_steps: int | None, val_names: tuple | None) -> Schedule | None:
    """The fit's Schedule from `fit(scheduler=spec)` or `config.lr_schedule`; None: constant rate."""
    if spec is None:
        scheduler = make_scheduler(optimizer, config.lr_schedule, total_steps, config.warmup_steps,
                                   config.min_lr_ratio)
        return None if scheduler is None else Schedule(scheduler, builtin=config.lr_schedule)
    if config.lr_schedule != "none":
        raise GpunbError(f"Both `scheduler` and `lr_schedule={config.lr_schedule!r}` were given: a run "
                         "follows one schedule.",
                         "drop `lr_schedule` (or `--lr-schedule`) to use your scheduler, or drop `scheduler`.")
    options = _options(spec)
    scheduler = options["scheduler"]
    if not isinstance(scheduler, (LRScheduler, ReduceLROnPlateau)):
        if not callable(scheduler):
            raise GpunbError(f"`scheduler` must be a torch LR scheduler or a factory "
                             f"`f(optimizer, total_steps) -> scheduler`, got a {type(scheduler).__name__}.",
                             "pass e.g. `scheduler=lambda opt, n: torch.optim.lr_scheduler.CosineAnnealingLR(opt, n)`.")
        scheduler = scheduler(optimizer, total_steps)
        if not isinstance(scheduler, (LRScheduler, ReduceLROnPlateau)):
            raise GpunbError(f"The scheduler factory returned a {type(scheduler).__name__}, not a torch LR "
                             "scheduler.", "return the scheduler from the factory, built on the optimizer it receives.")
    if scheduler.optimizer is not optimizer:
        raise GpunbError("The scheduler was built on another optimizer than the one this fit trains, so "
                         "its learning rates would never reach the model.",
                         "build it on the optimizer you pass as `optimizer=`, or pass a factory "
                         "`scheduler=lambda opt, total_steps: ...` and gpunb builds it on the right one "
                         "(also on the default AdamW).")
    schedule = Schedule(scheduler, options["interval"], options["monitor"])
    if schedule.plateau:  # refused now, not at the first validation
        if val_names is None:
            raise GpunbError("ReduceLROnPlateau steps with a validation metric, and this fit has no `val_data`.",
                             "pass `val_data`, or use a scheduler that follows the step count.")
        if schedule.monitor not in val_names:
            listed = ", ".join(f"`{n}`" for n in val_names)
            raise GpunbError(f"ReduceLROnPlateau monitors {schedule.monitor!r}, and validation produces only "
                             f"{listed}.", f"pass `scheduler={{'scheduler': s, 'monitor': '{val_names[0]}'}}`, "
                             "or add the metric to `metrics=`.")
    return schedule


def _options(spec) -> dict:
    options = {"scheduler": spec, "interval": "step", "monitor": "val_loss"}
    if not isinstance(spec, dict):
        return options
    unknown = sorted(set(spec) - set(_KEYS))
    if unknown or "scheduler" not in spec:
        raise GpunbError(f"A scheduler dict takes the keys {', '.join(map(repr, _KEYS))} ('scheduler' "
                         f"required); got {', '.join(map(repr, sorted(spec)))}.",
                         "pass e.g. `scheduler={'scheduler': s, 'interval': 'epoch'}`.")
    options.update(spec)
    if options["interval"] not in INTERVALS:
        raise GpunbError(f"A scheduler's interval must be 'step' or 'epoch', got {options['interval']!r}.",
                         "pass `{'scheduler': s, 'interval': 'epoch'}` to step it once an epoch.")
    return options
