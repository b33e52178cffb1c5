"""The default optimizer and the learning-rate schedules."""

from __future__ import annotations

import math
import warnings

import torch

from gpunb.errors import GpunbError
from gpunb.runtime.roles import check_optimizer_kind

DEFAULT_LR = 1e-3


def default_optimizer(model: torch.nn.Module, lr: float | None):
    """AdamW with torch's fused kernel where it has one for these parameters (CUDA, CPU, MPS):
    one pass over all parameters instead of one op per update term. On a CPU, torch's own
    default is a Python loop over the parameters, and a small model's whole step takes 10-20%
    less time with fused (benchmarks/RESULTS.md). Elsewhere the foreach implementation."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise GpunbError("The model has no trainable parameters.",
                         "check `requires_grad` on its parameters, or pass a model that has some.")
    return torch.optim.AdamW(params, lr=lr or DEFAULT_LR, **fastest_implementation(params))


def fastest_implementation(params) -> dict:
    """{"fused": True} when every parameter is a plain floating-point tensor on a device with
    the fused kernel, else {"foreach": True} (subclasses such as DTensor take the foreach path)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # torch's own list

    fused_devices = _get_fused_kernels_supported_devices()
    if all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.device.type in fused_devices
           and torch.is_floating_point(p) for p in params):
        return {"fused": True}
    return {"foreach": True}


def check_optimizer(optimizer, model: torch.nn.Module) -> None:
    """The optimizer must update this model's parameters (a stale one from an older model would not)."""
    check_optimizer_kind(optimizer)
    owned = {id(p) for p in model.parameters()}
    optimized = [p for group in optimizer.param_groups for p in group["params"]]
    if optimized and not any(id(p) in owned for p in optimized):
        raise GpunbError("The optimizer holds none of the model's parameters (it was probably made "
                         "for an earlier instance of the model).",
                         "create the optimizer after the model: "
                         "`optimizer = torch.optim.AdamW(model.parameters())`.")
    if optimized and not any(p.requires_grad for p in optimized):
        raise GpunbError("Every parameter the optimizer holds is frozen (`requires_grad=False`), so "
                         "there is nothing to train and backward would fail.",
                         "unfreeze what should train (`p.requires_grad_(True)`) before creating the "
                         "optimizer, e.g. `torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)`.")
    held = {id(p) for p in optimized}
    left_out = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if optimized and left_out:
        listed = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        warnings.warn(f"The optimizer holds only some of the model's trainable parameters: {listed} "
                      "get gradients but are never updated. Pass `model.parameters()` to the "
                      "optimizer, or freeze those (`requires_grad_(False)`) to skip their gradients.",
                      UserWarning, stacklevel=2)


def make_scheduler(optimizer, kind: str, total_steps: int | None, warmup_steps: int, min_lr_ratio: float = 0.0):
    """A per-optimizer-step schedule, or None for a constant learning rate."""
    if kind == "none":
        return None
    if not total_steps:
        raise GpunbError(f"lr_schedule={kind!r} needs to know the run's length, and this data has "
                         "no length.", "set `max_steps`, or use data with a `__len__`.")
    if kind == "one-cycle":
        max_lrs = [group["lr"] for group in optimizer.param_groups]
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lrs, total_steps=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))


class WarmupCosine:
    """Linear warmup to the base rate, then cosine decay to `min_lr_ratio` of it at `total_steps`
    (HF's cosine_with_min_lr, timm's lr_min as a ratio; 0 is torch's CosineAnnealingLR)."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0):
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine
