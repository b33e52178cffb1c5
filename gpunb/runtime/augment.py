"""Device transforms applied to each batch, with randomness that belongs to the batch.

On CUDA the feeds run the transforms one batch ahead, on the prefetcher's side stream
(prefetch.py), so their random draws happen before the previous step's Dropout draws,
and before the checkpoint of that step saves the RNG state. For a resumed run to see
the same augmented batches as an unbroken one, a batch's draws must not depend on when
it was prepared: with a seed, each batch draws from torch's CPU and device RNGs seeded
from (seed, epoch, position in the epoch), and the run's own RNG state is put back
after. The draws are then the same inline and ahead, on CPU and CUDA, straight and
resumed. Without a seed, transforms draw from the global RNGs as they come.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from gpunb.errors import GpunbError
from gpunb.runtime.worker_seed import batch_seed


class Augmenter:
    """Applies `transforms` to the inputs of a batch, seeded per (seed, epoch, position)."""

    def __init__(self, transforms, seed: int | None, device: torch.device):
        self.transforms, self.seed, self.device = list(transforms), seed, device

    def __bool__(self) -> bool:
        return bool(self.transforms)

    def __call__(self, batch, epoch: int, position: int):
        if not self.transforms:
            return batch
        if self.seed is None:
            return apply_transforms(batch, self.transforms)
        with batch_rng(transform_seed(self.seed, epoch, position), self.device):
            return apply_transforms(batch, self.transforms)


def transform_seed(seed: int, epoch: int, position: int) -> int:
    """The seed of one batch's transforms; apart from the seed its DataLoader worker uses
    (worker_seed.batch_seed), so that the two never draw the same numbers."""
    return (batch_seed(seed, epoch, position) * 1_000_003 + 1) % 2**63


@contextmanager
def batch_rng(seed: int, device: torch.device):
    """torch's CPU RNG and `device`'s RNG seeded with `seed` inside, as they were outside.
    A CUDA RNG's state is a seed and an offset kept on the host: saving and setting it
    costs no sync, and kernels already launched keep the values they were launched with."""
    generators = [torch.default_generator]
    if device.type == "cuda":
        torch.cuda.init()  # default_generators is filled on initialisation
        index = device.index if device.index is not None else torch.cuda.current_device()
        generators.append(torch.cuda.default_generators[index])
    saved = [generator.get_state() for generator in generators]
    for generator in generators:
        generator.manual_seed(seed)
    try:
        yield
    finally:
        for generator, state in zip(generators, saved):
            generator.set_state(state)


def apply_transforms(batch, transforms):
    """Transforms act on the inputs: a tensor batch, the first element of a tuple batch, or a
    dict batch's "pixel_values" (the Hugging Face name for images)."""
    if isinstance(batch, torch.Tensor):
        for transform in transforms:
            batch = transform(batch)
        return batch
    if isinstance(batch, dict):
        if "pixel_values" not in batch:
            raise GpunbError(f"GPU transforms act on images, and this dict batch has no 'pixel_values' "
                             f"(its keys: {', '.join(map(repr, batch))}).",
                             "name the images 'pixel_values' in the dataset's rows, or drop `transforms=` "
                             "and transform inside the Dataset.")
        return {**batch, "pixel_values": apply_transforms(batch["pixel_values"], transforms)}
    inputs = batch[0]
    for transform in transforms:
        inputs = transform(inputs)
    return (inputs, *batch[1:])
