"""One pass of validation: the loss and metrics over a feed, every sample counted once.

fit validates with it (runtime/validation/passes.py) and gpunb.evaluate calls the same
function, so a model evaluated on its own reports exactly what the run's validation did.

The shares of a multi-rank run are made equal by repeating a sample at the end of some
ranks' shares (as DistributedSampler does). Every rank still runs the same number of
forward passes (FSDP gathers parameters in each), but the repeated sample is cut from
the last batch before it is scored, so the means and the torchmetrics see each sample once.
"""

from __future__ import annotations

import torch

from gpunb.runtime.feed.feeds import closing
from gpunb.runtime.feed.inputs import check_sliceable, slice_batch
from gpunb.runtime.step.metrics import divide_counted


def validation_pass(model, feed, objective, precision, reduce_sums) -> dict:
    """Means of the loss and metrics over `feed`, and the torchmetrics' values.
    `reduce_sums(sums, count)` turns sums into means (across ranks when distributed)."""
    __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
    model.eval()
    with closing(feed.epoch(0)) as batches:
        sums, count = validation_sums(model, batches, objective, precision, getattr(feed, "padding", 0))
    model.train()
    metrics = divide_counted(reduce_sums(sums, count))  # one sync
    if objective.stateful is not None:
        metrics.update(objective.stateful.compute())  # torchmetrics gather every rank's state here
    return metrics


@torch.no_grad()
def validation_sums(model, batches, objective, precision, padding: int = 0) -> tuple[dict, int]:
    """Sums of val_loss and each val_* metric (weighted by batch size, on the device), and the
    samples counted; the last batch's `padding` repeated samples are not scored."""
    __tracebackhide__ = True  # noqa: F841
    sums, count = {}, 0
    for batch, last in _with_last(batches):
        n = objective.samples(batch)
        keep = n - padding if last else n
        if 0 < keep < n:
            check_sliceable(batch, n)
            batch = slice_batch(batch, 0, keep)
        with precision.autocast():  # keep 0, only a repeated sample: the forward pass (collectives), not scored
            batch_sums = objective.evaluate(model, batch, score=keep > 0)
        for name, value in batch_sums.items():
            sums[name] = value if name not in sums else sums[name] + value
        count += max(keep, 0)
    return sums, count


def _with_last(batches):
    """(batch, is_last) pairs, looking one batch ahead."""
    iterator = iter(batches)
    previous = next(iterator, None)
    while previous is not None:
        following = next(iterator, None)
        yield previous, following is None
        previous = following
