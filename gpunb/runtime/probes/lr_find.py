"""Learning-rate range test (Smith 2015; fastai's and Lightning's lr_find).

Train for up to `steps` steps while the learning rate grows exponentially from
`min_lr` to `max_lr`; stop once the smoothed loss diverges (4x its minimum). The
suggestion is the rate where the smoothed loss falls fastest, before its minimum.
Model, optimizer and RNG states are restored afterwards: the sweep leaves no trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gpunb.errors import GpunbError
from gpunb.runtime.context import LocalContext
from gpunb.runtime.feed.feeds import build_feed
from gpunb.runtime.setup import setup
from gpunb.runtime.state import rewind
from gpunb.runtime.step.objective import Objective
from gpunb.runtime.step.stepper import Stepper

SMOOTHING = 0.98  # exponential moving average of the loss, as fastai uses
DIVERGENCE = 4.0  # stop when the smoothed loss exceeds this multiple of its minimum


@dataclass
class LRFinderResult:
    lrs: list = field(default_factory=list)
    losses: list = field(default_factory=list)  # smoothed
    suggestion: float | None = None
    stopped_early: bool = False

    # Display lives in gpunb.render (imported lazily): the result renders without %load_ext.
    def __repr__(self) -> str:
        from gpunb.render import lr_find_text

        return lr_find_text(self)

    def _repr_html_(self) -> str:
        from gpunb.render import lr_find_html

        return lr_find_html(self)

    def plot(self, ax=None):
        """The smoothed loss against the learning rate with matplotlib; returns the Axes."""
        from gpunb.render import plot_lr_find

        return plot_lr_find(self, ax)


def find_lr(model, train_data, *, config, optimizer=None, loss_fn=None, step=None,
            min_lr: float = 1e-7, max_lr: float = 10.0, steps: int = 200) -> LRFinderResult:
    if not 0 < min_lr < max_lr:
        raise GpunbError(f"The learning-rate sweep needs 0 < min_lr < max_lr, got {min_lr} and {max_lr}.")
    ready = setup(config, LocalContext(), model, train_data, optimizer=optimizer)  # as fit sets up
    device, optimizer = ready.device, ready.optimizer
    objective = Objective(loss_fn, step)
    batch_size = 64 if config.batch_size == "auto" else config.batch_size
    feed = build_feed(ready.train, batch_size=batch_size, device=device, config=config)
    saved = rewind.capture(model, optimizer, device)  # RNG states included: seeding below is undone too
    if config.seed is not None:
        torch.manual_seed(config.seed)  # the same sweep every time, as fit is the same run every time
    result = LRFinderResult()
    try:
        stepper = Stepper(model, optimizer, objective, ready.precision, None, config.replace(grad_accum=1))
        _sweep(model, stepper, feed, result, min_lr, max_lr, steps)
    finally:
        rewind.restore(saved, model, optimizer, device)
    result.suggestion = _steepest(result.lrs, result.losses)
    return result


def _sweep(model, stepper, feed, result, min_lr, max_lr, steps):
    """fit's own step (one batch a step), with the learning rate set before each."""
    model.train()
    growth = (max_lr / min_lr) ** (1 / max(1, steps - 1))
    average, best, epoch = 0.0, math.inf, 0
    batches = feed.epoch(epoch)
    for i in range(steps):
        batch = next(batches, None)
        if batch is None:  # a short dataset: start another pass
            epoch += 1
            batches = feed.epoch(epoch)
            batch = next(batches)
        lr = min_lr * growth**i
        for group in stepper.optimizer.param_groups:
            group["lr"] = lr
        stepper.accumulate(batch, last_in_step=True)
        value = stepper.update().item()  # a sync per step is fine here: the sweep is short
        average = SMOOTHING * average + (1 - SMOOTHING) * value
        smoothed = average / (1 - SMOOTHING ** (i + 1))  # bias-corrected, as in Adam
        result.lrs.append(lr)
        result.losses.append(smoothed)
        best = min(best, smoothed)
        if not math.isfinite(smoothed) or (i > 10 and smoothed > DIVERGENCE * best):
            result.stopped_early = True
            break


def _steepest(lrs: list, losses: list) -> float | None:
    """The rate with the most negative slope of loss vs log(lr), before the loss minimum."""
    finite = [(lr, loss) for lr, loss in zip(lrs, losses) if math.isfinite(loss)]
    if len(finite) < 5:
        return None
    lowest = min(range(len(finite)), key=lambda i: finite[i][1])
    window = finite[: lowest + 1]
    if len(window) < 3:
        return None
    slopes = [(window[i + 1][1] - window[i - 1][1]) /
              (math.log(window[i + 1][0]) - math.log(window[i - 1][0])) for i in range(1, len(window) - 1)]
    steepest = min(range(len(slopes)), key=lambda i: slopes[i])
    return window[steepest + 1][0] if slopes[steepest] < 0 else None
