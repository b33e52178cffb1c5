"""Validation passes: at epoch ends (`val_every` epochs) or every `val_every_steps` optimizer steps,
and once more at the end of a run whose last pass is older than its last step (as Lightning
validates at the end of training), so that best checkpoints, `restore_best` and early stopping
judge the final weights too. A setting that can never fire is named before training.

Each pass appends a row (step, epoch, val_*, elapsed_s) to `state.validations`, then
callbacks hear `on_validation_end`. A pass at step s runs before anything else hears of
step s (on_step_end, its checkpoints), so a checkpoint saved at step s already holds it:
a run resumed from there neither repeats it nor skips it.
"""

from __future__ import annotations

import contextlib
import warnings

from gpunb.runtime.validation.sums import validation_pass


def every_steps(run) -> int | None:
    """Optimizer steps between passes within epochs, or None (passes at epoch ends only)."""
    return run.config.val_every_steps if run.val_feed is not None else None


def due_at_epoch_end(run) -> bool:
    """At an epoch's end: every `val_every` epochs, and at the end of training when the last
    pass is older than the last step (a run that reaches its end, not one stopped early)."""
    config, state = run.config, run.state
    if run.val_feed is None:
        return False
    if config.val_every_steps is None and (state.epoch + 1) % config.val_every == 0:
        return True
    last_epoch = state.epoch + 1 >= run.plan.epoch_limit or (state.total_steps is not None
                                                            and state.step >= state.total_steps)
    return last_epoch and not state.should_stop and not validated_at_last_step(state)


def validated_at_last_step(state) -> bool:
    return bool(state.validations) and state.validations[-1]["step"] >= state.step


def warn_unused(config, plan, has_val_data: bool, rank: int) -> None:
    """Before training: a validation interval set without validation data, or one the run is too
    short to reach (it is then validated once, at its end)."""
    if rank != 0:
        return
    setting = (f"val_every_steps={config.val_every_steps}" if config.val_every_steps is not None
               else f"val_every={config.val_every}" if config.val_every != 1 else None)
    if not has_val_data:
        if setting is not None:
            warnings.warn(f"{setting} is set but there is no validation data, so nothing is validated.\n"
                          f"HINT: pass `val_data` (fit's third argument, or define `val_data` in the cell), "
                          f"or leave `{setting.split('=')[0]}` out.", UserWarning, stacklevel=3)
        return
    total_steps, epochs = plan.total_steps, plan.epochs
    if config.val_every_steps is not None and total_steps is not None and config.val_every_steps > total_steps:
        length = f"{total_steps} optimizer steps"
    elif config.val_every_steps is None and epochs is not None and config.val_every > epochs:
        length = f"{epochs} epochs"
    else:
        return
    name = setting.split("=")[0]
    warnings.warn(f"{setting} is more than this run's {length}, so no pass falls within it: it is validated "
                  f"once, at its end.\nHINT: set `{name}` to at most {length.split()[0]} for passes along the "
                  f"way, or leave it out to validate at each epoch's end.", UserWarning, stacklevel=3)


def validate(run, timer) -> dict:
    """One pass over the validation data; records its row and returns the metrics."""
    state = run.state
    with timer.validating():
        metrics = _evaluate(run)
    state.validations.append({"step": state.step, "epoch": state.epoch, **metrics, "elapsed_s": timer.elapsed()})
    state.latest.update(metrics)
    return metrics


def at_step(run, timer) -> None:
    """A pass within the epoch; a stop asked for in on_validation_end applies on every rank now."""
    metrics = validate(run, timer)
    run.callbacks.call("on_validation_end", run.state, metrics)
    run.dist.sync_stop(run.state)  # every rank validates at this step: the same collective order


def epoch_metrics(state) -> dict:
    """The metrics of the epoch's last pass (step validation: the epoch row shows those)."""
    for row in reversed(state.validations):
        if row["epoch"] == state.epoch:
            return {k: v for k, v in row.items() if k.startswith("val_")}
        break
    return {}


def _evaluate(run) -> dict:
    __tracebackhide__ = True  # noqa: F841
    ema = run.stepper.ema
    with ema.swapped() if ema is not None else contextlib.nullcontext():  # validate the averaged weights
        return validation_pass(run.train_model, run.val_feed, run.objective, run.precision, run.dist.reduce_sums)
