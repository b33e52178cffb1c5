"""A real model on real data: a small CNN on scikit-learn's digits (no download)."""

from __future__ import annotations

import torch
from torch import nn


def digits_data(seed: int = 0, val_fraction: float = 0.2):
    """(x_train, y_train), (x_val, y_val): 1,797 8x8 grey images scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # not a dependency of gpunb: only the demo data needs it
        from gpunb.errors import GpunbError

        raise GpunbError("The demo's digits data comes with scikit-learn, which is not installed.",
                         "`pip install scikit-learn`") from error

    digits = load_digits()
    x = torch.from_numpy(digits.images).float().unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    y = torch.from_numpy(digits.target).long()  # (N,)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return (x[train], y[train]), (x[val], y[val])


def digits_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (N, 64, 4, 4)
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(128, 10),
    )


def run_demo(epochs: int = 5, batch_size=32, precision: str = "auto", quiet: bool = False, **overrides):
    from gpunb.render import ProgressPrinter
    from gpunb.trainer import Trainer

    train, val = digits_data()
    torch.manual_seed(0)
    model = digits_cnn()
    settings = dict(epochs=epochs, batch_size=batch_size, precision=precision, lr=2e-3, lr_schedule="one-cycle",
                    log_every=10, name="digits-cnn")
    trainer = Trainer(**(settings | overrides))  # overrides: any other TrainConfig field
    return trainer.fit(model, train, val, loss_fn=nn.CrossEntropyLoss(),
                       callbacks=() if quiet else (ProgressPrinter(),))
