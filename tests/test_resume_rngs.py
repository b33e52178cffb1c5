"""Exact resume of data that draws from Python's `random` and NumPy's global RNG (not torch's)."""

import random

import numpy as np
import pytest
import torch
from conftest import classification_data
from test_checkpoint import StopAt
from torch import nn
from torch.utils.data import Dataset

from gpunb import Trainer


class GlobalRngNoise(Dataset):
    """An augmentation in __getitem__ that draws only from `random` or only from `numpy.random`,
    so that a resume which restores torch's RNG alone cannot reproduce it."""

    def __init__(self, source):
        self.x, self.y = classification_data(n=96)
        self.source = source

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.source == "random":
            noise = torch.tensor([random.gauss(0.0, 0.1) for _ in range(10)])
        else:
            noise = torch.from_numpy(np.random.normal(0.0, 0.1, size=10).astype(np.float32))
        return self.x[i] + noise, self.y[i]


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))


def fit(model, data, callbacks=(), **options):
    settings = dict(batch_size=16, log_every=2, track=False, accelerator="cpu")
    settings.update(options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Trainer(**settings).fit(model, data, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer,
                                   callbacks=callbacks)


def losses(result):
    return [(row["step"], row["loss"]) for row in result.history]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("source", ["random", "numpy"])
def test_three_epochs_straight_equal_two_then_resume_and_one(source, num_workers, tmp_path):
    """In this process (0 workers) the checkpoint's Python and NumPy RNG states are restored;
    in workers each batch seeds `random` and `numpy` from (seed, epoch, batch) before loading."""
    straight = mlp(seed=0)
    straight_result = fit(straight, GlobalRngNoise(source), epochs=3, num_workers=num_workers)
    fit(mlp(seed=0), GlobalRngNoise(source), epochs=2, num_workers=num_workers, checkpoint_dir=tmp_path)
    random.seed(123)  # the notebook drew from the global RNGs in between
    np.random.seed(123)
    resumed = mlp(seed=7)
    resumed_result = fit(resumed, GlobalRngNoise(source), epochs=3, num_workers=num_workers,
                         checkpoint_dir=tmp_path, resume="last")
    assert resumed_result.steps == straight_result.steps == 18
    assert losses(resumed_result) == losses(straight_result)  # the resumed rows follow the saved ones
    assert_same_weights(straight, resumed)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("source", ["random", "numpy"])
def test_a_stop_mid_epoch_then_resume_equals_the_straight_run(source, num_workers, tmp_path):
    straight = mlp(seed=0)
    fit(straight, GlobalRngNoise(source), epochs=2, num_workers=num_workers)
    fit(mlp(seed=0), GlobalRngNoise(source), epochs=2, num_workers=num_workers, checkpoint_dir=tmp_path,
        callbacks=[StopAt(8)])  # 6 steps an epoch: 2 steps into the second
    random.seed(123)
    np.random.seed(123)
    resumed = mlp(seed=7)
    result = fit(resumed, GlobalRngNoise(source), epochs=2, num_workers=num_workers, checkpoint_dir=tmp_path,
                 resume="last")
    assert result.resumed_from["step"] == 8 and result.steps == 12
    assert_same_weights(straight, resumed)


def assert_same_weights(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
