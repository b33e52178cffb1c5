"""setup(): what every run of the step needs before its first batch, built one way.

fit (prepare.py) and the learning-rate sweep (lr_find) both start here: the device,
the precision (built once, with the loss scaler the context's strategy needs), the data
in the forms the feed takes, the model on the device and its optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpunb.runtime import device as devices
from gpunb.runtime.feed.inputs import adapt_data
from gpunb.runtime.step.optimizer import check_optimizer, default_optimizer
from gpunb.runtime.step.precision import Precision, resolve_precision


@dataclass
class Setup:
    device: torch.device
    precision: Precision
    precision_reason: str  # one line saying why this precision
    train: object  # adapted: tensors, a Dataset or a DataLoader
    val: object  # the same, or None
    optimizer: torch.optim.Optimizer


def setup(config, dist, model, train_data, val_data=None, optimizer=None) -> Setup:
    """Select the device, resolve the precision, adapt the data, move `model` and build
    (or check) its optimizer. `dist`, the context, gives the local rank and the strategy's loss scaler."""
    __tracebackhide__ = True  # noqa: F841
    device = devices.select_device(config.accelerator, dist.local_rank)
    name, reason = resolve_precision(config.precision, device)
    precision = Precision(name, device, scaler_type=dist.grad_scaler)
    train = adapt_data(train_data, "train_data")
    val = adapt_data(val_data, "val_data") if val_data is not None else None
    model.to(device)
    if optimizer is None:
        optimizer = default_optimizer(model, config.lr)
    check_optimizer(optimizer, model)
    return Setup(device, precision, reason, train, val, optimizer)
