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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.ndim - 2)  # broadcast over the channel dim
        mean = self.mean.to(x.device, torch.float32).view(shape)
        std = self.std.to(x.device, torch.float32).view(shape)
        return (x.float() - mean) / std


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
