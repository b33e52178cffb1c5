"""A validation pass: every sample of val_data counted once, over all ranks.

The shares of a multi-rank run are made equal by repeating a sample at the end of some
ranks' shares (as DistributedSampler does). Every rank still runs the same number of
forward passes (FSDP gathers parameters in each), but the repeated sample is cut from
the last batch before it is scored, so the means and the torchmetrics see each sample once.
"""

from __future__ import annotations

import torch

from gpunb.runtime.inputs import batch_size_of, slice_batch


@torch.no_grad()
def validate(model, feed, objective, precision, dist) -> dict:
    """Means of the loss and metrics over the validation data, and the torchmetrics' values."""
    __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
    model.eval()
    sums, count = {}, 0
    for batch, last in _with_last(feed.epoch(0)):
        n = batch_size_of(batch)
        keep = n - feed.padding if last else n
        if 0 < keep < n:
            batch = slice_batch(batch, 0, keep)
        with precision.autocast():  # keep 0, only a repeated sample: the forward pass (collectives), not scored
            batch_sums = objective.evaluate(model, batch, score=keep > 0)
        for name, value in batch_sums.items():
            sums[name] = value if name not in sums else sums[name] + value
        count += max(keep, 0)
    model.train()
    metrics = dict(dist.reduce_sums(sums, count))  # one sync; sums across ranks when distributed
    if objective.stateful is not None:
        metrics.update(objective.stateful.compute())  # torchmetrics gather every rank's state here
    return metrics


def _with_last(batches):
    """(batch, is_last) pairs, looking one batch ahead."""
    iterator = iter(batches)
    previous = next(iterator, None)
    while previous is not None:
        following = next(iterator, None)
        yield previous, following is None
        previous = following
