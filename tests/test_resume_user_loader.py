"""Exact resume with the user's own DataLoader: a stop mid-epoch, then `resume="last"`, ends in the
weights of the run that was never stopped, bit for bit, whatever the loader draws its order from."""

import random
import re
import warnings

import pytest
import torch
from test_checkpoint import StopAt
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, TensorDataset

from gpunb import Trainer


def dropout_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))


def tensors():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(512, 10, generator=generator), torch.randint(0, 3, (512,), generator=generator)


def shuffled(workers=0, **options):
    return DataLoader(TensorDataset(*tensors()), batch_size=8, shuffle=True, num_workers=workers, **options)


def in_order(workers=0):
    return DataLoader(TensorDataset(*tensors()), batch_size=8, shuffle=False, num_workers=workers)


def with_generator(workers=0):
    dataset = TensorDataset(*tensors())
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(3))
    return DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=workers)


def fit(model, data, callbacks=(), **options):
    settings = dict(max_steps=80, log_every=10, track=False, accelerator="cpu")
    settings.update(options)
    return Trainer(**settings).fit(model, data, loss_fn=nn.CrossEntropyLoss(), callbacks=callbacks)


def assert_resume_is_exact(make_loader, tmp_path, stop=10, **options):
    """Straight to the end, against stopped at `stop` and resumed, both from the same seeds; the
    notebook draws from the global RNGs in between, as a user's cells do."""
    straight, stopped, resumed = dropout_mlp(), dropout_mlp(), dropout_mlp(seed=7)
    torch.manual_seed(5)  # a loader may draw its order's seed when it is made (StatefulDataLoader)
    fit(straight, make_loader(), **options)
    torch.manual_seed(5)
    assert fit(stopped, make_loader(), checkpoint_dir=tmp_path, callbacks=[StopAt(stop)], **options).steps == stop
    torch.manual_seed(123)
    random.random()
    result = fit(resumed, make_loader(), checkpoint_dir=tmp_path, resume="last", **options)
    assert result.resumed_from["step"] == stop and result.steps == options.get("max_steps", 80)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("make_loader", [shuffled, in_order, with_generator])
def test_a_stop_mid_epoch_resumes_bit_for_bit_without_workers(make_loader, tmp_path):
    assert_resume_is_exact(make_loader, tmp_path)


@pytest.mark.parametrize("make_loader", [shuffled, with_generator])
def test_a_stop_mid_epoch_resumes_bit_for_bit_with_two_workers(make_loader, tmp_path):
    assert_resume_is_exact(lambda: make_loader(workers=2), tmp_path)


@pytest.mark.parametrize("make_loader", [shuffled, with_generator])
def test_a_stop_in_a_later_epoch_resumes_bit_for_bit(make_loader, tmp_path):
    """64 batches an epoch: stopped 6 batches into the second, whose order was drawn after the first's
    (from the global RNG, or from the sampler's generator, which a new run makes afresh)."""
    assert_resume_is_exact(make_loader, tmp_path, stop=70)


def test_persistent_workers_resume_bit_for_bit_and_warn_about_their_own_rngs(tmp_path):
    """The second epoch's iterator is the first's, reset (no new base seed drawn): the resumed run
    starts its workers aside and resets them, drawing the epoch's order as the straight run did."""
    with pytest.warns(RuntimeWarning, match="persistent_workers=True") as caught:
        assert_resume_is_exact(lambda: shuffled(workers=2, persistent_workers=True), tmp_path, stop=70,
                               max_steps=72)
    assert len([w for w in caught if "cannot resume exactly" in str(w.message)]) == 2  # once per run that saves


class OwnRngSampler(Sampler):
    """A sampler whose randomness is its own `random.Random`, which no checkpoint can see."""

    def __init__(self, n):
        self.n, self.rng = n, random.Random(0)

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)

    def __len__(self):
        return self.n


class Stream(IterableDataset):
    def __iter__(self):
        x, y = tensors()
        return iter(zip(x, y))


@pytest.mark.parametrize("loader, why", [
    (lambda: DataLoader(TensorDataset(*tensors()), batch_size=8, sampler=OwnRngSampler(512)),
     r"OwnRngSampler draws from its own random.Random \(`rng`\)"),
    (lambda: DataLoader(Stream(), batch_size=8), "IterableDataset"),
])
def test_a_loader_that_cannot_resume_exactly_is_named_once_before_training(loader, why, tmp_path):
    seen = []

    class FirstStep:
        def on_step_end(self, state):
            seen.append(len(caught))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(dropout_mlp(), loader(), callbacks=[FirstStep()], max_steps=2, checkpoint_dir=tmp_path)
    ours = [w for w in caught if "cannot resume exactly" in str(w.message)]
    assert len(ours) == 1 and seen[0] >= 1  # before the first step
    assert re.search(why, str(ours[0].message)) and "HINT:" in str(ours[0].message)


def test_a_loader_that_resumes_exactly_gets_no_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fit(dropout_mlp(), with_generator(), max_steps=2, checkpoint_dir=tmp_path)


@pytest.mark.parametrize("stop", [10, 64, 70])  # in the first epoch, at its end, in the second
def test_stateful_dataloader_resumes_through_its_own_state(stop, tmp_path):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    assert_resume_is_exact(lambda: stateful.StatefulDataLoader(TensorDataset(*tensors()), batch_size=8,
                                                                shuffle=True), tmp_path, stop=stop)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["shuffled", "stateful"])
def test_on_a_gpu_the_prefetcher_reading_ahead_does_not_move_the_resume_point(kind, tmp_path):
    """On CUDA the feed reads a batch ahead of the step: the checkpoint still resumes at the step's."""
    if kind == "stateful":
        stateful = pytest.importorskip("torchdata.stateful_dataloader")
        make = lambda: stateful.StatefulDataLoader(TensorDataset(*tensors()), batch_size=8, shuffle=True)  # noqa: E731
    else:
        make = shuffled
    assert_resume_is_exact(make, tmp_path, accelerator="cuda", precision="32", compile=False)
