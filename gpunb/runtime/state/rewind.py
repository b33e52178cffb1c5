"""Put a model, its optimizer and the RNGs back exactly as they were.

Used by everything that runs real training steps only to learn something (the batch-size
probe, the learning-rate sweep, the profiler) and must leave no trace on the run. What is
saved is a RunState's (runtime/run_state.py), holding only the model and its optimizer.
Copies go to host memory so that probing a large model does not double its GPU footprint;
frozen parameters (a LoRA model's base) are not copied at all: no step changes them.
"""

from __future__ import annotations

import torch

from gpunb.runtime.run_state import RunState

_CPU = torch.device("cpu")


def capture(model, optimizer=None, device: torch.device | None = None) -> dict:
    return _cpu_copy(RunState(model=model, optimizer=optimizer, device=device or _CPU).state_dict())


def restore(saved: dict, model, optimizer=None, device: torch.device | None = None) -> None:
    # casts the optimizer's state back to each parameter's device
    RunState(model=model, optimizer=optimizer, device=device or _CPU).load_state_dict(saved)
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
