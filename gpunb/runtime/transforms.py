"""Augmentations applied to a whole batch on the device (no per-sample host work).

Each acts on an input batch of shape (N, C, H, W) (flip also on any (N, ..., W)).
`train_only` ones are skipped for validation data.
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flip = torch.rand(x.shape[0], device=x.device) < self.p  # (N,)
        return torch.where(flip.view(-1, *(1,) * (x.ndim - 1)), x.flip(-1), x)


class RandomCrop:
    """Pad by `padding` (zeros) and take a random crop of the original size per sample."""

    train_only = True

    def __init__(self, padding: int = 4):
        self.padding = padding
        self._indices = {}  # (shape, device) -> the gather's fixed index tensors, made once

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        p = self.padding
        padded = F.pad(x, (p, p, p, p))  # (N, C, H+2p, W+2p)
        batch, channel, rows, cols = self._fixed(x.shape, x.device)
        offsets = torch.randint(0, 2 * p + 1, (n, 2, 1, 1), device=x.device)  # each sample's (dy, dx)
        return padded[batch, channel, rows + offsets[:, :1], cols + offsets[:, 1:]]

    def _fixed(self, shape, device) -> tuple:
        """The sample, channel, row and column numbers the gather broadcasts, of shapes (N, 1, 1, 1),
        (1, C, 1, 1), (1, 1, H, 1) and (1, 1, 1, W): four kernel launches a batch saved. Made
        on the host and copied (complete when `to` returns, so any stream may read them)."""
        if (shape, device) not in self._indices:
            n, c, h, w = shape
            fixed = (torch.arange(n).view(n, 1, 1, 1), torch.arange(c).view(1, c, 1, 1),
                     torch.arange(h).view(1, 1, h, 1), torch.arange(w).view(1, 1, 1, w))
            self._indices[shape, device] = tuple(t.to(device) for t in fixed)
        return self._indices[shape, device]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_indices": {}}  # device tensors stay in this process
