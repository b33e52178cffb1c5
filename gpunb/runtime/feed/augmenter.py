"""Device transforms applied to each batch, with randomness that belongs to the batch.

On CUDA the feeds run the transforms one batch ahead, on the prefetcher's side stream
(prefetch.py), and where they can, in a thread of their own. For a resumed run to see
the same augmented batches as an unbroken one, a batch's draws must not depend on when
or where it was prepared: with a seed, each batch draws from RNGs seeded from (seed,
epoch, position in the epoch). The draws are then the same inline and ahead, on CPU and
CUDA, straight and resumed.

A transform that takes a `generator` keyword (gpunb's do) draws from the generator it is
given and from nothing else: it leaves the global RNGs, which the step draws from
(Dropout), alone, so its batches can be prepared in another thread. Other callables draw
from torch's global RNGs, which are then seeded per batch inside, and put back after;
their batches are prepared in the loop's thread. Without a seed, the generator is seeded
once from torch's global RNG, and other callables draw from the global RNGs as they come.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch

from gpunb.errors import GpunbError
from gpunb.runtime.feed.batch_seeds import batch_seed
from gpunb.runtime.feed.inputs import is_mapping, with_values


class Augmenter:
    """Applies `transforms` to the inputs of a batch, seeded per (seed, epoch, position)."""

    def __init__(self, transforms, seed: int | None, device: torch.device):
        self.transforms, self.seed, self.device = list(transforms), seed, device
        # Whether every transform draws only from the generator it is given: then preparing a
        # batch touches no global RNG, and a thread of its own may do it.
        self.own_rng = all(takes_generator(t) for t in self.transforms)
        self._generators = {}  # device -> the generator the transforms draw from there
        # Without a seed, the generator's seed is drawn here, in the loop's thread, from torch's
        # global RNG: torch.manual_seed before fit still makes the augmentations reproducible.
        unseeded = self.own_rng and self.transforms and seed is None
        self._unseeded_base = int(torch.randint(2**62, ())) if unseeded else None

    def __bool__(self) -> bool:
        return bool(self.transforms)

    def __call__(self, batch, epoch: int, position: int):
        if not self.transforms:
            return batch
        if self.own_rng:
            return apply_transforms(batch, self.transforms, self._generator(batch, epoch, position))
        if self.seed is None:
            return apply_transforms(batch, self.transforms)
        with batch_rng(transform_seed(self.seed, epoch, position), self.device):
            return apply_transforms(batch, self.transforms)

    def _generator(self, batch, epoch: int, position: int) -> torch.Generator:
        """The generator on the inputs' device: seeded for this batch, or (without a seed) once."""
        device = _inputs(batch).device
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device)
            if self.seed is None:
                generator.manual_seed(self._unseeded_base)
        if self.seed is not None:  # the same draws as the global RNGs seeded alike (batch_rng)
            generator.manual_seed(transform_seed(self.seed, epoch, position))
        return generator

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_generators": {}}  # device generators stay in this process


def takes_generator(transform) -> bool:
    """Whether `transform` takes a `generator` keyword argument."""
    try:
        parameters = inspect.signature(transform).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    parameter = parameters.get("generator")
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def transform_seed(seed: int, epoch: int, position: int) -> int:
    """The seed of one batch's transforms; apart from the seed its DataLoader worker uses
    (batch_seeds.batch_seed), so that the two never draw the same numbers."""
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


def apply_transforms(batch, transforms, generator: torch.Generator | None = None):
    """Transforms act on the inputs: a tensor batch, the first element of a tuple batch, or a
    mapping batch's "pixel_values" (the Hugging Face name for images). With a `generator`, each
    transform is given it (all of them take one: Augmenter.own_rng)."""
    inputs = _inputs(batch)
    for transform in transforms:
        inputs = transform(inputs) if generator is None else transform(inputs, generator=generator)
    if isinstance(batch, torch.Tensor):
        return inputs
    if is_mapping(batch):
        return with_values(batch, {**batch, "pixel_values": inputs})
    return (inputs, *batch[1:])


def _inputs(batch) -> torch.Tensor:
    """The tensor the transforms act on."""
    if isinstance(batch, torch.Tensor):
        return batch
    if is_mapping(batch):
        if "pixel_values" not in batch:
            raise GpunbError(f"GPU transforms act on images, and this {type(batch).__name__} batch has no "
                             f"'pixel_values' (its keys: {', '.join(map(repr, batch))}).",
                             "name the images 'pixel_values' in the dataset's rows, or drop `transforms=` "
                             "and transform inside the Dataset.")
        return batch["pixel_values"]
    return batch[0]
