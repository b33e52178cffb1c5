"""Validation metrics: plain functions (a weighted mean of per-batch values) and torchmetrics'
Metric / MetricCollection, which keep state over the whole pass.

A per-batch mean is right for loss and accuracy but not for F1 or AUROC: those need every
prediction. A torchmetrics metric is updated with each batch's output and target, computed
once per validation pass and reset; under a process group its compute() gathers the
state of every rank (torchmetrics syncs itself on compute).
"""

from __future__ import annotations

import sys

import torch

from gpunb.errors import GpunbError


def is_stateful(value) -> bool:
    """A torchmetrics Metric or MetricCollection (torchmetrics imported only if the user did)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, (torchmetrics.Metric, torchmetrics.MetricCollection))


def stateful_name(metric) -> str:
    """A metric given without a name: its class name, lowercased (MulticlassF1Score -> multiclassf1score)."""
    return type(metric).__name__.lower()


class StatefulMetrics:
    """The torchmetrics of a run, by name; a MetricCollection contributes its own keys."""

    def __init__(self, metrics: dict):
        self.metrics = metrics

    def to(self, device) -> None:
        for metric in self.metrics.values():
            metric.to(device)

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()

    def update(self, output, target) -> None:
        for metric in self.metrics.values():
            metric.update(output, target)

    def names(self) -> tuple:
        """The `val_*` names compute() gives (a MetricCollection: its keys, prefix and postfix included)."""
        names = []
        for name, metric in self.metrics.items():
            if hasattr(metric, "keys"):  # a MetricCollection
                names.extend(f"val_{key}" for key in metric.keys(keep_base=False))
            else:
                names.append(f"val_{name}")
        return tuple(names)

    def compute(self) -> dict:
        """`val_<name>` -> float for each metric, then reset (one host sync for all)."""
        values = {}
        for name, metric in self.metrics.items():
            computed = metric.compute()  # gathers every rank's state when a process group is up
            metric.reset()
            if isinstance(computed, dict):  # a MetricCollection: its keys (with its prefix/postfix)
                values.update({f"val_{key}": _scalar(key, value) for key, value in computed.items()})
            else:
                values[f"val_{name}"] = _scalar(name, computed)
        if not values:
            return {}
        floats = torch.stack([v.detach().float().reshape(()).cpu() for v in values.values()]).tolist()
        return dict(zip(values, floats))


def _scalar(name: str, value) -> torch.Tensor:
    value = torch.as_tensor(value)
    if value.numel() != 1:
        raise GpunbError(f"The metric {name!r} computed a tensor of shape {tuple(value.shape)}, not one number.",
                         "give it an average that reduces over classes, e.g. "
                         "`MulticlassF1Score(num_classes=10, average='macro')`.")
    return value
