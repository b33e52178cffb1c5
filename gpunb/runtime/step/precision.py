"""Precision as a small object: autocast, backward, optimizer step, state.

"auto" picks bf16 autocast on GPUs with native bf16, fp16 autocast with a GradScaler
on older GPUs, and fp32 elsewhere. bf16 needs no scaler (same exponent range as fp32).
"""

from __future__ import annotations

import contextlib

import torch

from gpunb.runtime import device as devices

_NO_AUTOCAST = contextlib.nullcontext()  # fp32: one shared context that does nothing


def resolve_precision(requested: str, device: torch.device) -> tuple[str, str]:
    """The precision to use on `device`, and one line saying why."""
    if requested != "auto":
        return requested, "asked for"
    if device.type == "cuda":
        if devices.cuda_bf16_supported(device):
            return "bf16-mixed", "the GPU has native bf16: no loss scaling needed"
        major, minor = devices.cuda_capability(device)
        return "16-mixed", f"the GPU (compute {major}.{minor}) lacks native bf16: fp16 with loss scaling"
    if device.type == "mps":
        return "32", "fp32 is the stable choice on Apple MPS"
    return "32", "CPUs gain little from autocast: fp32"


class Precision:
    """Autocast, scaled backward and the optimizer step for one precision."""

    def __init__(self, name: str, device: torch.device, scaler_type=None):
        """`scaler_type`: the fp16 loss scaler's class, when the strategy needs its own
        (FSDP: one that skips a step on every rank when any rank's shard holds inf/NaN);
        the context hands it over (see setup.py), so the precision is complete once built."""
        self.name = name
        self.device = device
        self.dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(name)
        scaler_type = scaler_type or torch.amp.GradScaler
        self.scaler = scaler_type(device.type) if name == "16-mixed" else None
        # Counted on the device (no sync per step); read at the end of the run.
        self._skipped = torch.zeros((), dtype=torch.int64, device=device) if self.scaler else None
        self.step_taken = None  # with a scaler: 0-d device tensor, 1 when the last step was taken

    def autocast(self, cache: bool = True):
        """The forward's autocast context; `cache=False` for CUDA-graph capture, which cannot
        keep autocast's cast copies of the weights between replays."""
        if self.dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=cache)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer) -> None:
        """Bring gradients back to their true scale (needed before clipping)."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        before = self.scaler._scale.clone() if self.scaler._scale is not None else None
        self.scaler.step(optimizer)  # skips the step when gradients hold inf/NaN
        self.scaler.update()  # ... and then lowers the scale, which is how we count skips
        if before is not None:
            skipped = self.scaler._scale < before
            self._skipped += skipped.to(torch.int64)
            self.step_taken = ~skipped

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped.item()) if self._skipped is not None else 0

    def state_dict(self) -> dict:
        if self.scaler is None:
            return {}
        return {"scaler": self.scaler.state_dict(), "skipped": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self._skipped.fill_(int(state.get("skipped", 0)))
