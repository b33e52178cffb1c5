"""Objects an earlier cell left in the namespace under a role's name, and whether this cell's
training should use them.

A notebook builds one set-up after another: a BERT cell, then a CNN cell that binds `model`,
`train_data` and `loss_fn` but not `val_data`. The names the cell did not bind still hold the
earlier cell's objects, and using them silently validates the CNN on BERT's dicts or trains a
Hugging Face model on a classifier's `loss_fn`. So each such leftover is used only when it
matches what this cell trains, and otherwise left out with a one-line note that names it.
"Matches", role by role:

- val_data: its batches have the layout of train_data's (dict keys, tuple length, each
  tensor's kind of dtype and number of dimensions, and for tensor data the per-sample shape).
- loss_fn: the batches are not dicts (loss_fn takes `(inputs, target)`), and the model does not
  compute its own loss from them (a forward taking `labels` or `targets` that the batch holds):
  then the model's own loss wins.
- step: the same own-loss test, when the cell built a new model (a step written for the
  earlier model; with that same model, the user's step stands).
- optimizer: every parameter it updates is the model's; otherwise the default AdamW.
- scheduler: a scheduler object is built on the optimizer that is trained (a factory fits any).
- metrics: class metrics ("accuracy", torchmetrics classification) need integer targets.
- callbacks only watch a run, whatever it trains: always used.

A role named on the magic line (`--val-data val_data`) is the user's choice: used as it is.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from gpunb.runtime import matching

NOTE_END = "bind it in this cell, or name it on the line (`{option} {name}`), to use it."


def drop_mismatched(args, before, found, named, evaluating: bool = False) -> None:
    """Sets to None each role in `found` that an earlier cell bound and that does not match.
    `evaluating` (`--eval`): the data evaluated is the reference, and nothing is trained."""
    def leftover(role):
        name = getattr(args, f"{role}_name")
        return role not in named and found[role] is not None and before.get(name) == id(found[role])

    def drop(role, why):
        name = getattr(args, f"{role}_name")
        option = f"--{role.replace('_', '-')}"
        warnings.warn(f"gpunb: `{name}` is from an earlier cell and {why}; "
                      + NOTE_END.format(option=option, name=name), UserWarning, stacklevel=3)
        found[role] = None

    model = found["model"]
    if not evaluating and leftover("optimizer") and not matching.optimizer_fits(found["optimizer"], model):
        drop("optimizer", "updates another model's parameters: training uses the default AdamW")
    if not evaluating and leftover("scheduler") and not matching.scheduler_fits(found["scheduler"], found["optimizer"]):
        drop("scheduler", "drives another optimizer than the one trained: training goes without it")
    if not any(leftover(role) for role in ("val_data", "loss_fn", "step", "metrics")):
        return
    reference = "val_data" if evaluating and found["val_data"] is not None else "train_data"
    train = peek(found[reference])
    if train is None:
        return  # no batch to compare with: the pre-training check judges the data
    if leftover("val_data") and not evaluating:
        val = peek(found["val_data"])
        exact = all(isinstance(_adapted(_head(d)), tuple) for d in (found["train_data"], found["val_data"]))
        if val is not None and matching.layout(val, exact) != matching.layout(train, exact):
            drop("val_data", f"its batches ({matching.batch_kind(val)}) are not laid out like train_data's "
                             f"({matching.batch_kind(train)}): training goes without validation")
    own = matching.own_loss_target(model, train)
    if leftover("loss_fn") and own:
        drop("loss_fn", f"the model computes its own loss (its forward takes `{own}` from the batch): "
                        "training uses that loss")
    elif leftover("loss_fn") and isinstance(train, Mapping):
        drop("loss_fn", f"{reference}'s batches are dicts, which `loss_fn(output, target)` cannot take: "
                        "training asks the model for its own loss")
    fresh_model = before.get(args.model_name) != id(model)
    if leftover("step") and own and fresh_model:
        drop("step", f"the new model computes its own loss (its forward takes `{own}`): training uses that loss")
    if leftover("metrics") and _class_metrics(found["metrics"]) and not _integer(matching.target_of(train)):
        drop("metrics", f"compares class scores with integer labels, and {reference}'s batches hold no "
                        "integer labels: training goes without them")


def peek(data):
    """Two samples of `data` batched as training batches them, on the CPU; None for a stream or
    data gpunb refuses (the fit says why). Any RNG a collate function draws from is put back."""
    import random

    import numpy as np
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from gpunb.runtime.feed.inputs import first_batch

    adapted = _adapted(_head(data))
    dataset = adapted.dataset if isinstance(adapted, DataLoader) else adapted
    if adapted is None or isinstance(dataset, IterableDataset):
        return None  # reading a stream would move it on
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            return first_batch(adapted, 2, torch.device("cpu"))
    except Exception:  # noqa: BLE001 (the data's own errors are the fit's to report, with its hints)
        return None
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _head(data):
    """The first two rows of arrays and tables (`(x, y)`, a DataFrame), so that none is copied whole."""
    def rows(value):
        if hasattr(value, "shape") and hasattr(value, "__getitem__") and getattr(value, "ndim", 0) > 0:
            return getattr(value, "iloc", value)[:2]  # pandas slices rows by position through iloc
        return value

    return tuple(rows(v) for v in data) if isinstance(data, tuple) else rows(data)


def _adapted(data):
    from gpunb.errors import GpunbError
    from gpunb.runtime.feed.inputs import adapt_data

    try:
        return adapt_data(data)
    except GpunbError:
        return None


def _class_metrics(metrics) -> bool:
    if isinstance(metrics, dict):
        metrics = list(metrics.values())
    elif not isinstance(metrics, (list, tuple)):
        metrics = [metrics]
    return any(matching.is_class_metric(m) for m in metrics)


def _integer(target) -> bool:
    import torch

    return isinstance(target, torch.Tensor) and not target.is_floating_point() and target.dtype != torch.bool
