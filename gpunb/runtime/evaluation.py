"""One pass of validation: device-side sums of the loss and metrics over a feed's batches.

fit validates with it (runtime/validation.py) and gpunb.evaluate calls the same function, so a
model evaluated on its own reports exactly what the run's validation reported.
"""

from __future__ import annotations

import torch

from gpunb.runtime.inputs import batch_size_of


@torch.no_grad()
def validation_sums(model, batches, objective, precision) -> tuple[dict, int]:
    """Sums of val_loss and each val_* metric (weighted by batch size, on the device), and
    the samples seen. The caller sets the model's mode and turns sums into means."""
    __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
    sums, count = {}, 0
    for batch in batches:
        with precision.autocast():
            batch_sums = objective.evaluate(model, batch)
        for name, value in batch_sums.items():
            sums[name] = value if name not in sums else sums[name] + value
        count += batch_size_of(batch)
    return sums, count
