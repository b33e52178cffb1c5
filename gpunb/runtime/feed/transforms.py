"""Augmentations applied to a whole batch on the device (no per-sample host work).

Each acts on an input batch of shape (N, C, H, W) (flip also on any (N, ..., W)).
`train_only` ones are skipped for validation data. Each takes a `generator` keyword and
draws from it alone (from torch's global RNG when it is None): the feeds then prepare
their batches in a thread of their own (augmenter.py). A transform of your own can do the
same by taking `generator` and passing it to every random draw.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


class Normalize:
    """(x - mean) / std per channel; applied to training and validation batches."""

    train_only = False

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean, self.std = torch.as_tensor(mean), torch.as_tensor(std)
        self._on = {}  # (device, ndim) -> (shift, scale) there, shaped for the batch; copied once

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        # `generator` is unused: Normalize draws nothing, and taking it says so to the feed
        shift, scale = self._on_device(x.device, x.ndim)
        if x.is_floating_point() and x.dtype != torch.float32:
            x = x.float()
        # -mean/std + x * (1/std): one pass over the batch, uint8 read as float32 on the way,
        # where (x.float() - mean) / std takes three (each a kernel launch, and the batch's size
        # written and read again)
        return torch.addcmul(shift, x, scale)

    def _on_device(self, device: torch.device, ndim: int) -> tuple:
        # A copy from pageable host memory waits for the whole stream (a host sync): done once
        # per device, not per batch. Complete when `to` returns, so any stream may read it.
        if (device, ndim) not in self._on:
            shape = (1, -1) + (1,) * (ndim - 2)  # broadcast over the channel dim
            mean, std = self.mean.double().view(shape), self.std.double().view(shape)
            self._on[device, ndim] = ((-mean / std).to(device, torch.float32), (1 / std).to(device, torch.float32))
        return self._on[device, ndim]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_on": {}}  # device copies stay in this process


class RandomFlip:
    """Mirror each sample along the last (width) dimension with probability p."""

    train_only = True

    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        flip = torch.rand(x.shape[0], device=x.device, generator=generator) < self.p  # (N,)
        return torch.where(flip.view(-1, *(1,) * (x.ndim - 1)), x.flip(-1), x)


class RandomCrop:
    """Pad by `padding` (zeros) and take a random crop of the original size per sample."""

    train_only = True

    def __init__(self, padding: int = 4):
        self.padding = padding
        self._samples = {}  # (batch size, device) -> arange(N) there, made once

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        n, c, h, w = x.shape
        p = self.padding
        padded = F.pad(x, (p, p, p, p))  # (N, C, H+2p, W+2p)
        # Every crop of the padded batch, as a view (N, C, 2p+1, 2p+1, H, W); each sample's is
        # picked by one indexing kernel. Three kernels a batch (pad, randint, the index), the
        # other ops views; indexing the padded batch with four broadcast index tensors cost more
        # host time a batch and, on a CPU, 8x the compute (benchmarks/RESULTS.md).
        crops = padded.unfold(2, h, 1).unfold(3, w, 1)
        dy, dx = torch.randint(0, 2 * p + 1, (2, n), device=x.device, generator=generator)  # each sample's offsets
        return crops[self._sample_numbers(n, x.device), :, dy, dx]

    def _sample_numbers(self, n: int, device: torch.device) -> torch.Tensor:
        """arange(n) on `device`: made on the host and copied once (complete when `to` returns,
        so any stream may read it)."""
        if (n, device) not in self._samples:
            self._samples[n, device] = torch.arange(n).to(device)
        return self._samples[n, device]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_samples": {}}  # device tensors stay in this process
