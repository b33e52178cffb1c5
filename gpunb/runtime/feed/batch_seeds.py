"""Randomness in DataLoader workers that depends only on (seed, epoch, batch), so resume is exact.

Worker processes seed their RNGs once, when the (persistent) workers start, from a
value drawn from the main process's RNG. A resumed run starts its workers at another
point of the run, so their random augmentations would differ from an unbroken run's,
and the draw itself would shift the main RNG (Dropout). Here each batch carries its
own seed, made from the run's seed, the epoch and the batch's position in the epoch,
and the worker that loads it seeds torch, random and numpy with it first. Which
worker loads which batch no longer matters, and the loader draws its base seed from
a generator of its own, not from the global RNG.
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import Dataset, Sampler


class SeededBatch(list):
    """The indices of one batch, and the seed its worker uses while loading it."""

    def __init__(self, indices, seed: int):
        super().__init__(indices)
        self.seed = seed


class SeededBatchSampler(Sampler):
    """Wraps a BatchSampler over an _EpochSampler: each batch gets (seed, epoch, position)'s seed."""

    def __init__(self, batch_sampler, epoch_sampler, seed: int | None):
        self.batch_sampler, self.epoch_sampler, self.seed = batch_sampler, epoch_sampler, seed or 0
        self.batch_size = batch_sampler.batch_size

    def __iter__(self):
        first = self.epoch_sampler.start // self.batch_size  # a resumed epoch starts part-way
        for position, batch in enumerate(self.batch_sampler, start=first):
            yield SeededBatch(batch, batch_seed(self.seed, self.epoch_sampler.epoch, position))

    def __len__(self) -> int:
        return len(self.batch_sampler)


class SeededDataset(Dataset):
    """The user's dataset, seeding the worker's RNGs from each batch before loading it."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices):
        seed = getattr(indices, "seed", None)
        if seed is not None:
            seed_worker(seed)
        batched = getattr(self.dataset, "__getitems__", None)
        return batched(list(indices)) if batched else [self.dataset[i] for i in indices]


def batch_seed(seed: int, epoch: int, position: int) -> int:
    """The seed of the batch at `position` in `epoch` of a run seeded with `seed`."""
    return ((seed * 1_000_003 + epoch) * 1_000_003 + position) % 2**63


def seed_worker(seed: int) -> None:
    """Seed a worker's torch, random and numpy RNGs (never called in the main process)."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)


def loader_generator(seed: int | None) -> torch.Generator:
    """The generator a DataLoader draws its workers' base seed from (not the global RNG)."""
    return torch.Generator().manual_seed(seed or 0)
