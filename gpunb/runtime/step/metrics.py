"""Validation metrics: plain functions (a weighted mean of per-batch values), the built-in
accuracy (counts), and torchmetrics' Metric / MetricCollection, which keep state over the whole pass.

A per-batch mean is right for loss but not for F1 or AUROC: those need every prediction. A
torchmetrics metric is updated with each batch's output and target, computed once per
validation pass and reset; under a process group its compute() gathers the state of every
rank (torchmetrics syncs itself on compute). Accuracy sums its correct predictions and the
positions it counted (`<name>#counted`), so that a pass's accuracy is correct / counted over
every batch: per token for a language model, whose batches hold different numbers of real tokens.
"""

from __future__ import annotations

import sys

import torch

from gpunb.errors import GpunbError


IGNORE_INDEX = -100  # the label losses skip (CrossEntropyLoss's default; Hugging Face's padding)
COUNTED = "#counted"  # a sum's own denominator: `val_acc` is divided by `val_acc#counted`, not the samples

# Hugging Face causal LMs whose loss does not shift the labels (it scores logits[t] against labels[t])
_UNSHIFTED_LM_HEADS = ("XLNetLMHeadModel", "XLMWithLMHeadModel")


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Top-1 accuracy of class scores (..., C) against integer labels (...), positions labelled
    -100 left out (nan when every position is)."""
    correct, counted = accuracy_counts(output, target)
    return correct / counted


def accuracy_counts(output: torch.Tensor, target: torch.Tensor,
                    ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct predictions, positions counted), on the device: labels of `ignore_index` are not counted."""
    counted = target != ignore_index
    correct = (output.argmax(dim=-1) == target) & counted
    return correct.sum().float(), counted.sum().float()


def divide_counted(means: dict) -> dict:
    """The metrics that carry their own denominator (`<name>#counted`) as the ratio of the two."""
    counts = {name: value for name, value in means.items() if name.endswith(COUNTED)}
    values = {name: value for name, value in means.items() if name not in counts}
    for name, counted in counts.items():
        metric = name.removesuffix(COUNTED)
        values[metric] = values[metric] / counted if counted else float("nan")
    return values


def shifts_labels(model) -> bool:
    """Whether the model's own loss scores logits[:, t] against labels[:, t + 1]: a Hugging Face
    causal LM (`*ForCausalLM`, `GPT2LMHeadModel`, ...), which is given its inputs as labels and
    shifts them inside. Its metrics must then compare the same pairs."""
    for attribute in ("_orig_mod", "module", "_orig_mod"):  # torch.compile, DDP, in either order
        model = getattr(model, attribute, model)
    if not hasattr(getattr(model, "config", None), "model_type"):
        return False
    names = {cls.__name__ for cls in type(model).__mro__}  # FSDP and user subclasses keep the class as a base
    if names & set(_UNSHIFTED_LM_HEADS):
        return False
    if any(name.endswith("ForCausalLM") for name in names):
        return True
    if "transformers" not in sys.modules:  # a model of one's own with a Hugging Face-like config
        return False
    from gpunb.quiet import import_quietly

    auto = import_quietly("transformers.models.auto.modeling_auto")  # may import torchao: no notices

    for heads in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        if names & ({heads} if isinstance(heads, str) else set(heads)):
            return True
    return False


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
        self.updated = False  # since the last reset: a pass that scored nothing computes nothing

    def to(self, device) -> None:
        for metric in self.metrics.values():
            metric.to(device)

    def reset(self) -> None:
        self.updated = False
        for metric in self.metrics.values():
            metric.reset()

    def update(self, output, target) -> None:
        self.updated = True
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
        """`val_<name>` -> float for each metric, then reset (one host sync for all); {} when no
        batch was scored (the outputs could not be found: a warning said why), not torchmetrics' 0."""
        if not self.updated:
            return {}
        self.updated = False
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
