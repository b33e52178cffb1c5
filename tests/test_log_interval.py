"""log_every="auto": enough points for a live curve on small data, few syncs on long runs."""

import pytest
from conftest import classification_data, mlp
from torch import nn
from torch.utils.data import IterableDataset

from gpunb import Trainer
from gpunb.config import FALLBACK_LOG_EVERY, TrainConfig
from gpunb.errors import GpunbError


def _fit(data=None, **options):
    options = {"batch_size": 16, "track": False, **options}
    return Trainer(**options).fit(mlp(), data if data is not None else classification_data(n=160),
                                  loss_fn=nn.CrossEntropyLoss())


@pytest.mark.parametrize("total, per_epoch, expected", [
    (90, 45, 1),  # two short epochs: every step
    (36_000, 180, 180),  # ~100 points would be 360 steps apart: one per epoch wins
    (36_000, 1_000, 360),  # ~100 points a run
    (500, None, 5),  # max_steps over data without a length
    (None, None, FALLBACK_LOG_EVERY),  # nothing known: a fixed interval
])
def test_auto_interval_gives_about_100_points_and_one_per_epoch(total, per_epoch, expected):
    assert TrainConfig().log_every == "auto"
    assert TrainConfig().resolved_log_every(total, per_epoch) == expected


def test_an_explicit_interval_wins():
    assert TrainConfig(log_every=7).resolved_log_every(90, 45) == 7
    assert TrainConfig(log_every="12").log_every == 12


@pytest.mark.parametrize("bad", [0, -3, "often", 2.5])
def test_a_bad_interval_is_refused_with_the_fix(bad):
    with pytest.raises(GpunbError, match="log_every=64"):
        TrainConfig(log_every=bad)


def test_the_run_logs_at_the_resolved_interval_and_records_it():
    result = _fit(epochs=30)  # 10 steps an epoch, 300 in all: every 3rd step
    assert result.config["log_every"] == 3
    # Every 3rd step, and each epoch's last, partial interval at its end.
    expected = sorted(set(range(3, 301, 3)) | set(range(10, 301, 10)))
    assert [row["step"] for row in result.history] == expected
    assert {row["epoch"] for row in result.history} == set(range(30))


def test_a_short_run_logs_every_epoch_step_for_a_curve():
    result = _fit(epochs=2)
    assert result.config["log_every"] == 1 and len(result.history) == 20


class _Stream(IterableDataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return iter(zip(self.x, self.y))


def test_data_without_a_length_falls_back_to_a_fixed_interval():
    x, y = classification_data(n=64)
    result = _fit(_Stream(x, y), epochs=1, num_workers=0)
    assert result.config["log_every"] == FALLBACK_LOG_EVERY
    assert [row["step"] for row in result.history] == [4]  # the epoch's one partial interval
