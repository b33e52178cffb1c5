"""How a batch becomes a loss, and how validation metrics are computed.

Three ways, checked in this order:
- `step(model, batch) -> loss`: any custom logic;
- `loss_fn(output, target)`: batch is (inputs..., target) and output = model(*inputs);
  a single-tensor batch x gives loss_fn(model(x), x) (reconstruction);
- neither: the model computes its own loss from model(*batch) / model(**batch) and
  returns a scalar, an object with a `.loss` (Hugging Face style), or a tuple holding
  exactly one scalar such as nanoGPT's `(logits, loss)`. Validation metrics then take
  the output's `.logits` and the batch's "labels" when it has both.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch

from gpunb.errors import GpunbError
from gpunb.runtime.inputs import batch_size_of, is_mapping
from gpunb.runtime.metrics import StatefulMetrics, is_stateful, stateful_name


class Objective:
    def __init__(self, loss_fn: Callable | None = None, step: Callable | None = None, metrics=None,
                 batch_size_fn: Callable | None = None):
        if loss_fn is not None and step is not None:
            raise GpunbError("Both `loss_fn` and `step` were given; gpunb uses one of them.",
                             "compute the loss inside `step(model, batch)`, or drop `step`.")
        for name, value in (("loss_fn", loss_fn), ("step", step)):
            if value is not None and not callable(value):
                raise GpunbError(f"`{name}` must be callable, got a {type(value).__name__}.",
                                 "pass e.g. `loss_fn=torch.nn.CrossEntropyLoss()`.")
        self.loss_fn, self.step_fn = loss_fn, step
        self.train_loss_fn = loss_fn  # what training steps apply: its compiled form while compiled (compiling.py)
        self.metrics, stateful = _metric_functions(metrics)
        self.stateful = StatefulMetrics(stateful) if stateful else None  # torchmetrics
        self.val_names = None  # the names evaluate() gave, once it has run (see monitor.py)
        # Samples in a batch: what the run counts, validation weights by, and an OOM split cuts.
        self.samples = _checked_count(batch_size_fn) if batch_size_fn is not None else batch_size_of

    def loss(self, model, batch) -> torch.Tensor:
        """The scalar training loss of `batch`."""
        __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
        if self.step_fn is not None:
            return _scalar(self.step_fn(model, batch), "step(model, batch)")
        if self.loss_fn is not None:
            output, target = self._forward(model, batch)
            return _scalar(self._apply_loss(self.train_loss_fn, output, target), "loss_fn(output, target)")
        return _scalar(_call(model, batch), "the model's forward", tuples=True)

    def evaluate(self, model, batch, score: bool = True) -> dict[str, torch.Tensor]:
        """Device-side sums for validation: loss and each metric, weighted by batch size;
        torchmetrics are updated with the batch (computed once the pass is over).
        `score=False`: the forward pass alone, nothing counted (see validation.py)."""
        __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
        n = self.samples(batch)
        if self.loss_fn is None:
            sums = self._own_loss_sums(model, batch, n, score)
        else:
            output, target = self._forward(model, batch)
            if not score:
                return {}
            sums = {"val_loss": _scalar(self._apply_loss(self.loss_fn, output, target), "loss_fn").float() * n}
            sums.update(self._metric_sums(output, target, n))
        if score:
            self.val_names = tuple(sums) + (self.stateful.names() if self.stateful is not None else ())
        return sums

    def _own_loss_sums(self, model, batch, n: int, score: bool) -> dict[str, torch.Tensor]:
        """Validation of a model that computes its own loss; metrics take its `.logits` and the
        batch's "labels" (Hugging Face style), when it has both."""
        if self.step_fn is not None:
            loss = self.loss(model, batch)
            return {"val_loss": loss.float() * n} if score else {}
        output = _call(model, batch)
        if not score:
            return {}
        sums = {"val_loss": _scalar(output, "the model's forward", tuples=True).float() * n}
        logits = getattr(output, "logits", None)
        labels = batch.get("labels") if is_mapping(batch) else None
        if isinstance(logits, torch.Tensor) and isinstance(labels, torch.Tensor):
            sums.update(self._metric_sums(logits, labels, n))
        return sums

    def _metric_sums(self, output, target, n: int) -> dict[str, torch.Tensor]:
        """Each plain metric weighted by the batch size; the torchmetrics take the batch."""
        if self.stateful is not None:
            self.stateful.update(output, target)
        metrics = self.metrics if self.metrics or self.stateful else _default_metrics(output, target)
        return {f"val_{name}": torch.as_tensor(fn(output, target), device=output.device).float() * n
                for name, fn in metrics.items()}

    @staticmethod
    def _apply_loss(loss_fn, output, target):
        __tracebackhide__ = True  # noqa: F841
        try:
            return loss_fn(output, target)
        except (TypeError, AttributeError) as error:
            if not isinstance(output, (list, tuple)):
                raise
            raise GpunbError(f"The model returned a {type(output).__name__} of {len(output)}, and "
                             f"`loss_fn` cannot take it: {type(error).__name__}: {error}",
                             "return only the output the loss needs from forward, or pass a "
                             "`step(model, batch)` that picks it, e.g. `def step(model, batch): "
                             "x, y = batch; return loss_fn(model(x)[0], y)`.") from error

    def _forward(self, model, batch):
        __tracebackhide__ = True  # noqa: F841
        if type(batch) is tuple and len(batch) == 2:  # (inputs, target): the common case, first
            return model(batch[0]), batch[1]
        if isinstance(batch, torch.Tensor):
            return model(batch), batch
        if isinstance(batch, (list, tuple)) and len(batch) >= 2:
            return model(*batch[:-1]), batch[-1]  # the inputs, as model_inputs() reads them
        if isinstance(batch, (list, tuple)) and len(batch) == 1:
            raise GpunbError(f"With `loss_fn`, a batch must be (inputs, target); this one is a "
                             f"{_describe(batch)}, so the data holds no labels for `loss_fn`.",
                             "pass features and labels apart, e.g. `train_data = (x, y)` or "
                             "`(df.drop(columns='label'), df['label'])`; or use `step(model, batch)`.")
        raise GpunbError(f"With `loss_fn`, a batch must be (inputs, target); got a {_describe(batch)}.",
                         "yield (x, y) pairs from the data, or use `step(model, batch)` for "
                         "other layouts.")


def model_inputs(batch) -> tuple[tuple, dict]:
    """The (args, kwargs) the model is called with for `batch`, its target left out.

    As training with `loss_fn` reads a batch: a tensor is the input; in a tuple or list of
    two or more the last item is the target; a one-item tuple holds the input alone; a dict
    goes in as keywords (`model(**batch)`), as for a model that computes its own loss; so does
    any other Mapping (a Hugging Face `BatchEncoding`).
    """
    if is_mapping(batch):
        return (), batch
    if isinstance(batch, (list, tuple)):
        return tuple(batch[:-1] if len(batch) >= 2 else batch), {}
    return (batch,), {}


def _checked_count(batch_size_fn: Callable) -> Callable:
    """The user's `batch_size_fn`, its answer checked to be a count of samples."""
    def samples(batch) -> int:
        answer = batch_size_fn(batch)
        if type(answer) is int and answer >= 0:  # the common answer, checked in one step
            return answer
        try:
            n = operator.index(answer)  # a NumPy integer, a 0-d integer tensor on the host
        except TypeError:
            n = -1
        if isinstance(answer, bool) or n < 0:
            raise GpunbError(f"batch_size_fn(batch) returned {answer!r}, not a count of samples.",
                             "return an int, e.g. `batch_size_fn=lambda batch: len(batch[-1])`.")
        return n
    return samples


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Top-1 accuracy of class scores (N, C) against integer labels (N,)."""
    return (output.argmax(dim=-1) == target).float().mean()


def _default_metrics(output, target) -> dict:
    """Classification (scores (N, C) and integer labels (N,)) gets accuracy for free."""
    if (isinstance(output, torch.Tensor) and output.ndim == 2 and isinstance(target, torch.Tensor)
            and target.ndim == 1 and not target.is_floating_point()):
        return {"acc": accuracy}
    return {}


def _metric_functions(metrics) -> tuple[dict, dict]:
    """(plain functions by name, torchmetrics by name) from what `metrics=` was given."""
    if metrics is None:
        return {}, {}
    if is_stateful(metrics):
        metrics = [metrics]
    if isinstance(metrics, str) or (callable(metrics) and not isinstance(metrics, (list, tuple, dict))):
        metrics = [metrics]
    if isinstance(metrics, (list, tuple)):
        metrics = {_name_of(m): m for m in metrics}
    if not isinstance(metrics, dict):
        raise GpunbError(f"`metrics` must be a dict of name -> fn(output, target), a list, or "
                         f"'accuracy'; got a {type(metrics).__name__}.",
                         "pass e.g. `metrics=['accuracy']`, `metrics={'f1': my_f1}` with "
                         "`my_f1(output, target) -> scalar tensor`, or a torchmetrics Metric.")
    functions, stateful = {}, {}
    for name, fn in metrics.items():
        if is_stateful(fn):
            stateful[name] = fn
            continue
        if isinstance(fn, str) and fn in ("accuracy", "acc"):
            name, fn = "acc", accuracy
        if not callable(fn):
            raise GpunbError(f"Metric {name!r} is not callable and not a built-in name.",
                             "built-in: 'accuracy'; or pass fn(output, target) -> scalar tensor, "
                             "or a torchmetrics Metric.")
        functions[name] = fn
    return functions, stateful


def _name_of(metric) -> str:
    if isinstance(metric, str):
        return metric
    if is_stateful(metric):
        return stateful_name(metric)
    return getattr(metric, "__name__", "metric")


_THREE_WAYS = ("pass `loss_fn=` (e.g. `torch.nn.CrossEntropyLoss()`: gpunb then calls `model(inputs)` "
               "and `loss_fn(output, target)`), a `step(model, batch)` function that returns the loss, "
               "or a model whose forward takes the whole batch and returns the loss (or an object "
               "with `.loss`, or a tuple such as `(logits, loss)`).")


def _call(model, batch):
    __tracebackhide__ = True  # noqa: F841
    args, kwargs = (batch,), {}
    if is_mapping(batch):  # a dict, or a collator's BatchEncoding (a UserDict)
        args, kwargs = (), batch
    elif isinstance(batch, (list, tuple)):
        args = tuple(batch)
    try:
        return model(*args, **kwargs)
    except TypeError as error:
        if not _forward_never_ran(error):
            raise  # a TypeError inside the user's forward: their traceback says it best
        given = (f"`model(**batch)` with keys {', '.join(map(repr, kwargs))}" if kwargs
                 else f"`model(*batch)` with {len(args)} positional argument{'s' * (len(args) != 1)}")
        raise GpunbError(f"gpunb called {given} because no `loss_fn` or `step` was given, and the "
                         f"model's forward does not take that: {error}", _THREE_WAYS) from error


def _forward_never_ran(error: TypeError) -> bool:
    """Whether the TypeError came from binding the call's arguments, before forward's first line.

    Python raises that error in the caller's frame, so the innermost traceback frame is
    torch's Module.__call__ (or this module), never the user's forward.
    """
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename.replace("\\", "/")
    return filename.endswith(("torch/nn/modules/module.py", "gpunb/runtime/objective.py"))


def _scalar(loss: Any, source: str, tuples: bool = False) -> torch.Tensor:
    if isinstance(loss, torch.Tensor):  # the common case first: no failed attribute lookup per step
        pass
    elif hasattr(loss, "loss"):
        loss = loss.loss
    elif is_mapping(loss) and "loss" in loss:
        loss = loss["loss"]
    elif tuples and isinstance(loss, (list, tuple)):
        loss = _loss_in_tuple(loss, source)
    if not isinstance(loss, torch.Tensor):
        raise GpunbError(f"{source} returned a {type(loss).__name__}, not a loss tensor.",
                         "return a scalar tensor, or pass `loss_fn=` (e.g. "
                         "`torch.nn.CrossEntropyLoss()`) so gpunb computes it from the output.")
    if loss.ndim != 0:
        raise GpunbError(f"{source} returned a tensor of shape {tuple(loss.shape)}, not a scalar loss.",
                         "reduce it (`.mean()`, or a loss with reduction='mean'), or if these are "
                         "model outputs pass `loss_fn=` (e.g. `torch.nn.CrossEntropyLoss()`).")
    return loss


def _loss_in_tuple(output, source: str) -> torch.Tensor:
    """The one scalar in a tuple output: nanoGPT's `(logits, loss)`, or `(loss, logits)`."""
    scalars = [v for v in output if isinstance(v, torch.Tensor) and v.ndim == 0 and v.is_floating_point()]
    if len(scalars) == 1:
        return scalars[0]
    shapes = ", ".join(repr(tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__
                       for v in output)
    raise GpunbError(f"{source} returned a {type(output).__name__} ({shapes}) holding "
                     f"{'no' if not scalars else len(scalars)} scalar tensors, so gpunb cannot tell "
                     "which is the loss.",
                     "return the loss alone (or an object with `.loss`), or pass a `step(model, batch)` "
                     "that picks it, e.g. `def step(model, batch): return model(*batch)[1]`.")


def _describe(batch) -> str:
    if isinstance(batch, (list, tuple)):
        return f"{type(batch).__name__} of {len(batch)}"
    return type(batch).__name__
