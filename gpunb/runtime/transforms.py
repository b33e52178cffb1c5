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
        self._on = {}  # device -> (mean, std) there, copied once

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.ndim - 2)  # broadcast over the channel dim
        mean, std = self._on_device(x.device)
        return (x.float() - mean.view(shape)) / std.view(shape)

    def _on_device(self, device: torch.device) -> tuple:
        # A copy from pageable host memory waits for the whole stream (a host sync): done once
        # per device, not per batch. Complete when `to` returns, so any stream may read it.
        if device not in self._on:
            self._on[device] = (self.mean.to(device, torch.float32), self.std.to(device, torch.float32))
        return self._on[device]

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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        p = self.padding
        padded = F.pad(x, (p, p, p, p))  # (N, C, H+2p, W+2p)
        dy = torch.randint(0, 2 * p + 1, (n, 1), device=x.device)
        dx = torch.randint(0, 2 * p + 1, (n, 1), device=x.device)
        rows = (dy + torch.arange(h, device=x.device)).view(n, 1, h, 1)
        cols = (dx + torch.arange(w, device=x.device)).view(n, 1, 1, w)
        batch = torch.arange(n, device=x.device).view(n, 1, 1, 1)
        channel = torch.arange(c, device=x.device).view(1, c, 1, 1)
        return padded[batch, channel, rows, cols]
