"""Exact resume: DataLoader workers, a longer run's schedule, changed batches, mid-epoch stops."""

import pytest
import torch
from conftest import classification_data
from test_checkpoint import StopAt
from torch import nn
from torch.utils.data import Dataset

from gpunb import Trainer
from gpunb.errors import GpunbError


class NoisyData(Dataset):
    """Random augmentation in __getitem__: runs in the DataLoader's worker processes."""

    def __init__(self):
        self.x, self.y = classification_data(n=96)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(10), self.y[i]


def dropout_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))


def fit(model, data, **options):
    settings = dict(batch_size=16, log_every=2, track=False, accelerator="cpu")
    settings.update(options)
    callbacks = settings.pop("callbacks", ())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    result = Trainer(**settings).fit(model, data, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer,
                                     callbacks=callbacks)
    return result, optimizer


def assert_same_weights(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_workers_resume_bit_for_bit(tmp_path):
    straight = dropout_mlp()
    fit(straight, NoisyData(), epochs=3, num_workers=2)
    fit(dropout_mlp(), NoisyData(), epochs=2, num_workers=2, checkpoint_dir=tmp_path)
    resumed = dropout_mlp(seed=7)
    result, _ = fit(resumed, NoisyData(), epochs=3, num_workers=2, checkpoint_dir=tmp_path, resume="last")
    assert result.steps == 18
    assert_same_weights(straight, resumed)


def test_workers_resume_mid_epoch_bit_for_bit(tmp_path):
    straight = dropout_mlp()
    fit(straight, NoisyData(), epochs=2, num_workers=2)
    fit(dropout_mlp(), NoisyData(), epochs=2, num_workers=2, checkpoint_dir=tmp_path, callbacks=[StopAt(3)])
    resumed = dropout_mlp(seed=7)
    fit(resumed, NoisyData(), epochs=2, num_workers=2, checkpoint_dir=tmp_path, resume="last")
    assert_same_weights(straight, resumed)


def test_more_epochs_stretch_a_cosine_schedule_and_warn(tmp_path):
    x, y = classification_data(n=96)
    fit(dropout_mlp(), (x, y), epochs=2, lr_schedule="cosine", checkpoint_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match="planned for 12 steps and this run has 24: it now decays to "
                                            "zero at step 24"):
        result, _ = fit(dropout_mlp(), (x, y), epochs=4, lr_schedule="cosine", checkpoint_dir=tmp_path,
                        resume="last")
    added = [row["lr"] for row in result.history if row["epoch"] >= 2]
    assert added and all(lr > 0 for lr in added[:-1])


def test_more_epochs_with_one_cycle_is_refused_saying_how(tmp_path):
    x, y = classification_data(n=96)
    fit(dropout_mlp(), (x, y), epochs=2, lr_schedule="one-cycle", checkpoint_dir=tmp_path)
    with pytest.raises(GpunbError, match="cannot be stretched") as error:
        fit(dropout_mlp(), (x, y), epochs=4, lr_schedule="one-cycle", checkpoint_dir=tmp_path, resume="last")
    assert "`epochs`/`max_steps` it was saved with" in error.value.hint


def test_a_mid_epoch_stop_then_resume_has_one_row_per_epoch(tmp_path):
    x, y = classification_data(n=96)
    straight, _ = fit(dropout_mlp(), (x, y), epochs=2)
    fit(dropout_mlp(), (x, y), epochs=2, checkpoint_dir=tmp_path, callbacks=[StopAt(3)])
    result, _ = fit(dropout_mlp(), (x, y), epochs=2, checkpoint_dir=tmp_path, resume="last")
    assert [row["epoch"] for row in result.epochs] == [0, 1]
    # The resumed epoch's mean loss covers all its steps (the same steps, logged in other intervals).
    assert [r["step"] for r in result.epochs] == [r["step"] for r in straight.epochs]
    assert [r["train_loss"] for r in result.epochs] == pytest.approx([r["train_loss"] for r in straight.epochs],
                                                                    rel=1e-6)


def image_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))


def uint8_images(n=96):
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g), torch.randint(0, 3, (n,), generator=g)


def augmentations():
    from gpunb.runtime.feed.transforms import Normalize, RandomCrop, RandomFlip

    return [RandomCrop(2), RandomFlip(), Normalize([127.0] * 3, [64.0] * 3)]


def test_random_device_transforms_resume_mid_epoch_bit_for_bit(tmp_path, accelerator="cpu", **options):
    """Transforms draw per (seed, epoch, batch) and Dropout from the run's RNG, saved in the checkpoint."""
    settings = dict(epochs=2, transforms=augmentations(), accelerator=accelerator, **options)
    straight = image_mlp()
    fit(straight, uint8_images(), **settings)
    fit(image_mlp(), uint8_images(), checkpoint_dir=tmp_path, callbacks=[StopAt(3)], **settings)
    resumed = image_mlp(seed=7)
    fit(resumed, uint8_images(), checkpoint_dir=tmp_path, resume="last", **settings)
    assert_same_weights(straight, resumed)
    other = image_mlp()
    fit(other, uint8_images(), **dict(settings, transforms=augmentations()[2:]))
    with pytest.raises(AssertionError):  # the random transforms do change the run
        assert_same_weights(straight, other)


def damage(path, change):
    payload = torch.load(path, weights_only=True)
    change(payload)
    torch.save(payload, path)


@pytest.mark.parametrize("part, change", [
    ("torch", lambda rng: rng.update(torch=rng["torch"][:100])),
    ("torch", lambda rng: rng.update(torch=rng["torch"].float())),
    ("python", lambda rng: rng.update(python=rng["python"][:10])),
    ("numpy", lambda rng: rng.update(numpy=rng["numpy"][:5])),
    ("numpy", lambda rng: rng.update(numpy_meta=["PCG64", 0, 0, 0.0])),
], ids=["torch-truncated", "torch-float", "python-short", "numpy-short", "numpy-other-kind"])
def test_a_damaged_rng_state_is_refused_before_the_weights_are_touched(tmp_path, part, change):
    from gpunb.runtime.state.resume_target import find_checkpoint

    x, y = classification_data(n=96)
    fit(dropout_mlp(), (x, y), epochs=1, checkpoint_dir=tmp_path)
    damage(find_checkpoint("last", tmp_path), lambda payload: change(payload["rng"]))
    model = dropout_mlp(seed=7)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(GpunbError, match=f"(?s)is damaged.*the {part} RNG state cannot be set") as error:
        fit(model, (x, y), epochs=2, checkpoint_dir=tmp_path, resume="last")
    assert "resume from an earlier checkpoint" in error.value.hint
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in before.items())


def test_a_resume_with_fewer_batches_an_epoch_warns_that_epochs_no_longer_line_up(tmp_path):
    x, y = classification_data(n=200)
    fit(dropout_mlp(), (x, y), epochs=2, checkpoint_dir=tmp_path, callbacks=[StopAt(10)])  # 13 batches an epoch
    with pytest.warns(RuntimeWarning, match="saved with 13 batches an epoch and the data now gives 7: the saved "
                                            r"position \(batch 10\) is past the end of the new epoch 0.*"
                                            "goes on from 10 and this run ends at step 14"):
        result, _ = fit(dropout_mlp(), (x[:100], y[:100]), epochs=2, checkpoint_dir=tmp_path, resume="last")
    assert result.steps == 14 and result.epochs[-1]["epoch"] == 1


def test_a_damaged_weight_average_is_refused_before_the_weights_are_touched(tmp_path):
    from gpunb.runtime.state.resume_target import find_checkpoint

    x, y = classification_data(n=96)
    fit(dropout_mlp(), (x, y), epochs=1, ema=0.9, checkpoint_dir=tmp_path)
    damage(find_checkpoint("last", tmp_path), lambda payload: payload["ema"]["weights"].pop("0.weight"))
    model = dropout_mlp(seed=7)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(GpunbError, match="weight average: missing from the checkpoint: 0.weight"):
        fit(model, (x, y), epochs=2, ema=0.9, checkpoint_dir=tmp_path, resume="last")
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in before.items())


@pytest.mark.cuda
def test_a_cuda_rng_state_is_checked_in_a_scratch_generator():
    from gpunb.runtime import device as devices
    from gpunb.runtime.state.resume_check import rng_problems

    device = torch.device("cuda", torch.cuda.current_device())
    state = devices.rng_state(device)
    assert rng_problems(state, device) == []
    before = torch.cuda.get_rng_state(device)
    state["cuda"] = state["cuda"][:3]
    problems = rng_problems(state, device)
    assert len(problems) == 1 and "the cuda RNG state cannot be set" in problems[0], problems
    assert torch.equal(torch.cuda.get_rng_state(device), before)  # the device's own generator is untouched
