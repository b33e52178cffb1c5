"""Put a model, its optimizer and the RNGs back exactly as they were.

Used by everything that runs real training steps only to learn something (the batch-size
probe, the learning-rate sweep, the profiler) and must leave no trace on the run.
Copies go to host memory so that probing a large model does not double its GPU footprint;
frozen parameters (a LoRA model's base) are not copied at all: no step changes them.
"""

from __future__ import annotations

import torch

from gpunb.runtime import device as devices
from gpunb.runtime.trainable import load_weights, trainable_part

_CPU = torch.device("cpu")


def capture(model, optimizer=None, device: torch.device | None = None) -> dict:
    return {"model": _cpu_copy(trainable_part(model, model.state_dict())),
            "optimizer": None if optimizer is None else _cpu_copy(optimizer.state_dict()),
            "rng": devices.rng_state(device or _CPU)}


def restore(saved: dict, model, optimizer=None, device: torch.device | None = None) -> None:
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
        optimizer.load_state_dict(saved["optimizer"])  # casts the state back to each parameter's device
    load_weights(model, saved["model"])
    devices.set_rng_state(saved["rng"], device or _CPU)
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _cpu_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj
