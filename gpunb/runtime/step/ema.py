"""An exponential moving average (EMA) of the model's weights, kept on the device.

After each optimizer step every parameter's average moves toward the new value:
`ema = decay * ema + (1 - decay) * param`, one `torch._foreach_lerp_` over all
parameters (no host sync: the weight is a number computed on the host from the update
count, or a device tensor when fp16 loss scaling may have skipped the step). Buffers
(BatchNorm statistics, counters) are copied, not averaged, as Composer does.

With warm-up the decay of update n (0-based) is `min(decay, (1 + n) / (10 + n))`, so
the early average follows the fast-moving weights instead of the random initial ones.

A skipped step (fp16: the GradScaler found inf/NaN and left the parameters alone) does
not move the average: the weight is multiplied by "was this step taken", a tensor the
precision keeps on the device. (timm averages on skipped steps too, pulling the average
toward weights that did not change.) The update count, kept on the host, still moves on:
reading the device flag to hold it back would be a sync.

`swapped()` puts the averaged weights into the model for a while (validation, saving
the averaged state) by swapping tensor storage: no copies, no extra memory.

Frozen parameters are left out: their average is themselves, and copying a frozen base
(a LoRA model's) would double the memory its weights take. The averaged state of a model
with frozen parameters holds what trains (trainable.py); it loads into the model as it is.
"""

from __future__ import annotations

import contextlib

import torch

from gpunb.runtime.trainable import load_weights, trainable_part


class WeightEma:
    """The averaged weights of `model` (its parameters and buffers), on the model's device."""

    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool = True):
        self.model, self.decay, self.warmup = model, decay, warmup
        self.params = [p for p in model.parameters() if p.requires_grad]  # deduplicated: tied weights once
        self.buffers = [b for b in model.buffers()]
        with torch.no_grad():
            self.averaged = [p.detach().clone() for p in self.params]
            self.averaged_buffers = [b.detach().clone() for b in self.buffers]
        self.floating = [i for i, p in enumerate(self.params) if p.is_floating_point()]  # averaged
        self.whole = [i for i, p in enumerate(self.params) if not p.is_floating_point()]  # copied
        self.updates = 0  # optimizer steps averaged so far (decides the warm-up decay)

    def reset(self) -> None:
        """Start the average again from the model's current weights."""
        with torch.no_grad():
            torch._foreach_copy_(self.averaged, self.params)
            if self.buffers:
                torch._foreach_copy_(self.averaged_buffers, self.buffers)
        self.updates = 0

    def decay_at(self, update: int) -> float:
        """The decay of update number `update` (0-based)."""
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + update) / (10 + update))

    @torch.no_grad()
    def update(self, taken: torch.Tensor | None = None) -> None:
        """Move the average toward the current weights. `taken`: a 0-d device tensor, 1 when
        the optimizer step was taken and 0 when the loss scaler skipped it (None: taken)."""
        weight = 1.0 - self.decay_at(self.updates)
        self.updates += 1
        # Listed afresh each time: a swap (see _swap) leaves other tensor objects in `averaged`.
        averaged = [self.averaged[i] for i in self.floating]
        if averaged:
            current = [self.params[i] for i in self.floating]
            if taken is None:
                torch._foreach_lerp_(averaged, current, weight)
            else:
                # A 0-d tensor passed as the weight would become a Python number (a sync);
                # one per tensor picks the overload that reads it on the device.
                weight = taken.to(averaged[0].dtype) * weight
                torch._foreach_lerp_(averaged, current, [weight] * len(averaged))
        for i in self.whole:
            self.averaged[i].copy_(self.params[i])
        if self.buffers:
            torch._foreach_copy_(self.averaged_buffers, self.buffers)

    def _swap(self) -> None:
        """Exchange the storage of the model's tensors with the averaged ones (no copy)."""
        for tensors, averaged in ((self.params, self.averaged), (self.buffers, self.averaged_buffers)):
            for i, tensor in enumerate(tensors):
                held = tensor.data
                tensor.data = averaged[i]
                averaged[i] = held

    @contextlib.contextmanager
    def swapped(self):
        """The model holds the averaged weights inside the block and its own ones after it."""
        self._swap()
        try:
            yield self.model
        finally:
            self._swap()

    def state_dict(self, to_cpu: bool = False) -> dict:
        """The averaged weights, keyed like `model.state_dict()` (loadable into the model); a model
        with frozen parameters: what trains."""
        with self.swapped():
            state = trainable_part(self.model, self.model.state_dict())
            return {name: value.detach().to("cpu", copy=True) if to_cpu else value.detach().clone()
                    for name, value in state.items()}

    def load_state_dict(self, state: dict) -> None:
        with self.swapped():
            load_weights(self.model, state)

    def copy_to_model(self) -> None:
        """Make the averaged weights the model's own (`ema_apply=True` at the end of a fit)."""
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.averaged)
            if self.buffers:
                torch._foreach_copy_(self.buffers, self.averaged_buffers)
