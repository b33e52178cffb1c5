"""Whether the objects given for different roles belong together: a model that computes its own
loss from the batch, a val_data shaped like the train_data, an optimizer over the model's
parameters, a scheduler over that optimizer.

The notebook front end asks this of objects an earlier cell left behind (notebook/collect.py);
the pre-training check asks it to explain a failure (preflight.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

# Names a forward gives the parameter through which it takes the target and returns its loss:
# Hugging Face `labels`, nanoGPT `targets`.
TARGET_NAMES = ("labels", "targets", "target", "label", "y")


def forward_parameters(model) -> dict | None:
    """The parameters of `model.forward` by name (None when they cannot be read)."""
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return None


def takes_labels(model) -> str | None:
    """The keyword a model's forward takes its target by (`labels` for Hugging Face models)."""
    params = forward_parameters(model) or {}
    return next((name for name in TARGET_NAMES if name in params), None)


def own_loss_target(model, batch) -> str | None:
    """The forward parameter through which the model gets its target from `batch`, when it does:
    then, called as gpunb calls it without `loss_fn` (`model(**batch)`, `model(*batch)`), the
    model computes its own loss. A Hugging Face model with a batch holding "labels", nanoGPT's
    `forward(idx, targets)` with `(x, y)` batches."""
    params = forward_parameters(model)
    if params is None:
        return None
    if isinstance(batch, Mapping):
        anything = any(p.kind is p.VAR_KEYWORD for p in params.values())
        return next((name for name in TARGET_NAMES if name in batch and (name in params or anything)), None)
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        positional = [name for name, p in params.items()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        # model(*batch) passes the last item (the target) in the position of this parameter
        if len(positional) >= len(batch) and positional[len(batch) - 1] in TARGET_NAMES:
            return positional[len(batch) - 1]
    return None


def batch_kind(batch) -> str:
    """A batch's layout in words: "dicts (keys 'input_ids', 'labels')", "tuples of 2", "tensors"."""
    if isinstance(batch, Mapping):
        return f"dicts (keys {', '.join(map(repr, batch))})"
    if isinstance(batch, (list, tuple)):
        return f"{type(batch).__name__}s of {len(batch)}"
    return f"{type(batch).__name__}s"


def layout(batch, exact: bool) -> tuple:
    """What two batches of the same data share: the container (dict keys, tuple length) and, per
    tensor, its kind of dtype and its number of dimensions; `exact` adds the per-sample shape
    (data held as tensors, whose batches all have it; padded text batches differ in length)."""
    if isinstance(batch, Mapping):
        return ("dict", tuple(sorted((str(k), layout(v, exact)) for k, v in batch.items())))
    if isinstance(batch, (list, tuple)):
        return ("tuple", tuple(layout(v, exact) for v in batch))
    if isinstance(batch, torch.Tensor):
        kind = "float" if batch.is_floating_point() else "bool" if batch.dtype == torch.bool else "int"
        return ("tensor", kind, batch.ndim, tuple(batch.shape[1:]) if exact else None)
    return (type(batch).__name__,)


def target_of(batch):
    """The target a batch holds as gpunb reads it (metrics, leftovers): "labels" of a mapping, the
    last item of a tuple."""
    if isinstance(batch, Mapping):
        return batch.get("labels")
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return batch[-1]
    return None


def optimizer_fits(optimizer, model) -> bool:
    """Every parameter the optimizer updates is one of the model's (a subset is fine: a head only)."""
    own = {id(p) for p in model.parameters()}
    return all(id(p) in own for group in optimizer.param_groups for p in group["params"])


def scheduler_fits(scheduler, optimizer) -> bool:
    """A scheduler object drives the optimizer it was built on; a factory fits any."""
    bound = getattr(scheduler, "optimizer", None)
    return bound is None or bound is optimizer


def is_class_metric(metric) -> bool:
    """A metric that compares class scores with integer labels: gpunb's "accuracy", a torchmetrics
    classification metric."""
    if isinstance(metric, str):
        return metric in ("accuracy", "acc")
    module = getattr(type(metric), "__module__", "") or ""
    return module.startswith("torchmetrics.classification") or getattr(metric, "__name__", "") == "accuracy"
