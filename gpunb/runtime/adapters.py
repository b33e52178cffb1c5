"""PEFT models (LoRA and its kin) at the two ends of a fit.

Between the ends a peft model trains as any model: only its trainable parameters (the
adapters) go into the default optimizer, and checkpoints hold what trains
(trainable.py). Before any work, `check_adapters` refuses what could not train: layers
quantized by bitsandbytes (QLoRA's 4-bit base) where that package cannot be imported,
and `merge_adapters=True` on a model that has no adapters to merge. At the end,
`merge_adapters` folds the adapters into the base weights with peft's `merge_and_unload`.
"""

from __future__ import annotations

import warnings

import torch

from gpunb.errors import GpunbError
from gpunb.quiet import import_quietly

# bitsandbytes' layer and parameter classes that hold quantized weights
_QUANTIZED = ("Linear4bit", "Linear8bitLt", "Params4bit", "Int8Params")


def quantized_layers(model: torch.nn.Module) -> dict[str, int]:
    """{class name: count} of the bitsandbytes-quantized layers in `model` (found by their class's
    module, so without importing bitsandbytes)."""
    found: dict[str, int] = {}
    for module in model.modules():
        kind = type(module)
        if kind.__module__.startswith("bitsandbytes") and kind.__name__ in _QUANTIZED:
            found[kind.__name__] = found.get(kind.__name__, 0) + 1
    return found


def check_adapters(model: torch.nn.Module, config) -> None:
    """Before any work: quantized layers need bitsandbytes; merge_adapters needs adapters."""
    layers = quantized_layers(model)
    if layers:
        _check_bitsandbytes(layers)
    if config.merge_adapters and not callable(getattr(model, "merge_and_unload", None)):
        raise GpunbError(f"merge_adapters=True merges a peft model's adapters into its base at the end, and "
                         f"this {type(model).__name__} has no adapters (no `merge_and_unload`).",
                         "wrap the model first, `model = peft.get_peft_model(model, LoraConfig(...))`, or drop "
                         "`merge_adapters`.")


def _check_bitsandbytes(layers: dict[str, int]) -> None:
    listed = ", ".join(f"{count} {name}" for name, count in layers.items())
    try:
        import_quietly("bitsandbytes")  # without its notice about optional kernel packages
    except Exception as error:  # not installed, or installed without a backend for this machine
        raise GpunbError(f"The model has weights quantized by bitsandbytes ({listed}), and the bitsandbytes "
                         f"package cannot be imported here ({type(error).__name__}: {error}), so its "
                         "layers cannot run.",
                         "install it, `pip install \"gpunb[llm]\"` (or `pip install bitsandbytes`), and restart "
                         "the kernel; or load the base model without `quantization_config` (bf16 weights, "
                         "more memory).") from None


def merge_adapters(result, model: torch.nn.Module) -> None:
    """merge_adapters=True at the end of a fit: `result.model` becomes the base model with the
    trained adapters merged into its weights. An interrupted fit keeps its adapters (it may
    go on), and says so."""
    if result.interrupted:
        warnings.warn("merge_adapters: the fit was interrupted, so the adapters stay separate (a fit can go "
                      "on from them). Merge them yourself when done: `merged = model.merge_and_unload()`.",
                      RuntimeWarning, stacklevel=3)
        return
    result.model = model.merge_and_unload()
    result.continue_state = None  # the adapters the optimizer trained are gone from the model
