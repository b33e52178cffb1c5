"""Validation passes: at epoch ends (`val_every` epochs) or every `val_every_steps` optimizer steps.

Each pass appends a row (step, epoch, val_*, elapsed_s) to `state.validations`, then
callbacks hear `on_validation_end`. A pass at step s runs before anything else hears of
step s (on_step_end, its checkpoints), so a checkpoint saved at step s already holds it:
a run resumed from there neither repeats it nor skips it.
"""

from __future__ import annotations

import contextlib

from gpunb.runtime.evaluation import validation_pass


def every_steps(run) -> int | None:
    """Optimizer steps between passes within epochs, or None (passes at epoch ends only)."""
    return run.config.val_every_steps if run.val_feed is not None else None


def due_at_epoch_end(run) -> bool:
    config = run.config
    return (run.val_feed is not None and config.val_every_steps is None
            and (run.state.epoch + 1) % config.val_every == 0)


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
