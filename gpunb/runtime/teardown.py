"""Handing the user's model and the global settings back after fit, whatever happened.

Every step runs even when an earlier one fails, and an error in a step never replaces
the error (or the KeyboardInterrupt) that fit is already raising: it becomes a warning.
"""

from __future__ import annotations

import warnings

import torch

from gpunb.runtime import device as devices


class Teardown:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.was_training = model.training
        self.device = _device_of(model)  # where the model came from
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.saved_globals = None  # set once seed_everything has changed them
        self.unwrap = None  # set once wrap_model has changed the module
        self.memory = None  # set once the memory plan has taken measures (runtime/memory/measures.py)
        self.rollback = None  # a continued fit: puts what it moved back if it fails (runtime/state/continuing.py)

    def __call__(self, failed: bool, trained: bool = True) -> None:
        steps = [undo for undo in (self.unwrap, self.memory) if undo is not None]
        if failed and self.rollback is not None:
            steps.append(lambda: self.rollback(announce=trained))  # after unwrapping: into the user's module
        if failed and not trained and self.device is not None:
            # Nothing was trained: leave the model where it was (not on the GPU fit chose).
            steps.append(lambda: self.model.to(self.device))
        steps += [lambda: self.model.train(self.was_training),  # the mode it came in
                  lambda: devices.restore_globals(self.saved_globals) if self.saved_globals else None,
                  lambda: torch.set_float32_matmul_precision(self.matmul_precision),
                  _release_cached_memory]
        first = None
        for step in steps:
            try:
                step()
            except Exception as error:  # noqa: BLE001 - each step runs; the first error is kept
                first = first or error
        if first is None:
            return
        if not failed:
            raise first
        warnings.warn(f"Cleaning up after the failed run also failed ({type(first).__name__}: {first}); "
                      "the run's own error follows.", RuntimeWarning, stacklevel=3)


def _device_of(model: torch.nn.Module) -> torch.device | None:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return None


def _release_cached_memory() -> None:
    if torch.cuda.is_initialized():  # not is_available(): that would rule out fork later
        torch.cuda.empty_cache()  # hand cached blocks back so the notebook sees free memory
