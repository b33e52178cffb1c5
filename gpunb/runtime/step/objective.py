"""How a batch becomes a loss, and how validation metrics are computed.

Three ways, checked in this order:
- `step(model, batch)`: any custom logic. It returns the loss; for validation metrics it
  returns the output too: `(loss, output)` or `{"loss": loss, "output": output, "target": target}`
  (the target, when left out, is the batch's, read as below);
- `loss_fn(output, target)`: batch is (inputs..., target) and output = model(*inputs);
  a single-tensor batch x gives loss_fn(model(x), x) (reconstruction);
- neither: the model computes its own loss from model(*batch) / model(**batch) and
  returns a scalar, an object with a `.loss` (Hugging Face style), or a tuple holding
  exactly one scalar such as nanoGPT's `(logits, loss)`. Validation metrics then take
  the output's `.logits` (or the tuple's one other tensor) and the batch's target: a dict
  batch's "labels", else a tuple batch's last item. A Hugging Face causal LM shifts its
  labels inside its loss, so its metrics compare logits[:, :-1] with labels[:, 1:], the same pairs.

Where no output or target is found, metrics= is not computed, and a warning (once) says why.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch

from gpunb.errors import GpunbError
from gpunb.runtime.feed.inputs import batch_size_of, is_mapping
from gpunb.runtime.matching import target_of
from gpunb.runtime.step.metrics import (COUNTED, IGNORE_INDEX, StatefulMetrics, accuracy, accuracy_counts,
                                   is_stateful, shifts_labels, stateful_name)
from gpunb.runtime.roles import check_kinds


class Objective:
    def __init__(self, loss_fn: Callable | None = None, step: Callable | None = None, metrics=None,
                 batch_size_fn: Callable | None = None):
        if loss_fn is not None and step is not None:
            raise GpunbError("Both `loss_fn` and `step` were given; gpunb uses one of them.",
                             "compute the loss inside `step(model, batch)`, or drop `step`.")
        check_kinds({"loss_fn": loss_fn, "step": step})
        self.loss_fn, self.step_fn = loss_fn, step
        # the memory plan's loss for a model that computes its own (memory/chunked_loss.py); None: the model's
        self.model_loss = None
        self.metrics, stateful = _metric_functions(metrics)
        self.stateful = StatefulMetrics(stateful) if stateful else None  # torchmetrics
        self.val_names = None  # the names evaluate() gave, once it has run (see monitor.py)
        # Samples in a batch: what the run counts, validation weights by, and an OOM split cuts.
        self.samples = _checked_count(batch_size_fn) if batch_size_fn is not None else batch_size_of
        self.unscored_warned = False  # metrics= could not be computed, and a warning said why
        # the label accuracy leaves out: the loss's own (CrossEntropyLoss(ignore_index=...)), else -100
        self.ignore_index = getattr(loss_fn, "ignore_index", IGNORE_INDEX)

    def loss(self, model, batch, loss_fn: Callable | None = None) -> torch.Tensor:
        """The scalar training loss of `batch`; `loss_fn`: a compiled form of the loss_fn (engines.py)."""
        __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
        if self.step_fn is not None:
            return _step_loss(self.step_fn(model, batch))
        if self.loss_fn is not None:
            output, target = self._forward(model, batch)
            loss_fn = self.loss_fn if loss_fn is None else loss_fn
            return _scalar(self._apply_loss(loss_fn, output, target), "loss_fn(output, target)")
        if self.model_loss is not None:
            return self.model_loss(model, batch)
        return _scalar(_call(model, batch), "the model's forward", tuples=True)

    def evaluate(self, model, batch, score: bool = True) -> dict[str, torch.Tensor]:
        """Device-side sums for validation: loss and each metric, weighted by batch size;
        torchmetrics are updated with the batch (computed once the pass is over).
        `score=False`: the forward pass alone, nothing counted (see validation/sums.py)."""
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
            named = tuple(name for name in sums if not name.endswith(COUNTED))
            scored = self.stateful is not None and self.stateful.updated
            self.val_names = named + (self.stateful.names() if scored else ())
        return sums

    def _own_loss_sums(self, model, batch, n: int, score: bool) -> dict[str, torch.Tensor]:
        """Validation where the model or `step` computes the loss; the metrics score the output
        and target found beside it (_scored_pair)."""
        if self.step_fn is not None:
            returned = self.step_fn(model, batch)
            loss = _step_loss(returned)
        else:
            returned = _call(model, batch)
            loss = _scalar(returned, "the model's forward", tuples=True)
        if not score:
            return {}
        sums = {"val_loss": loss.float() * n}
        scored, missing = self._scored_pair(model, returned, batch)
        if scored is not None:
            sums.update(self._metric_sums(*scored, n))
        elif self.metrics or self.stateful is not None:
            self._warn_unscored(missing)
        return sums

    def _scored_pair(self, model, returned, batch) -> tuple[tuple | None, str]:
        """((output, target), "") with each prediction beside the label it is scored against,
        or (None, what is missing)."""
        if self.step_fn is not None:
            output, target = _step_output(returned)
            if output is None:
                return None, ("`step(model, batch)` returned the loss alone; return "
                              "`{'loss': loss, 'output': output, 'target': target}` or `(loss, output)`")
            if not isinstance(output, torch.Tensor):
                return None, f"the output `step(model, batch)` returned is a {type(output).__name__}, not a tensor"
        else:
            output, target = _scores_in(returned), None
            if output is None:
                return None, (f"the model returned a {type(returned).__name__} with no scores beside its loss "
                              "(no `.logits`, nor one tensor besides the loss in a tuple)")
        if target is not None:  # the step's own pair: scored as given
            return (output, target), ""
        target = target_of(batch)
        if not isinstance(target, torch.Tensor) or not isinstance(output, torch.Tensor):
            return None, ("the batch holds no target: a dict batch needs a 'labels' tensor, a tuple batch "
                          "(inputs..., target)")
        if output.ndim >= 3 and target.ndim >= 2 and shifts_labels(model):
            output, target = output[:, :-1], target[:, 1:]  # logits at t predict the label at t + 1
        return (output, target), ""

    def _warn_unscored(self, missing: str) -> None:
        if self.unscored_warned:
            return
        self.unscored_warned = True
        names = [*self.metrics, *(self.stateful.metrics if self.stateful is not None else ())]
        warnings.warn(f"metrics= ({', '.join(names)}) cannot be computed, so validation reports val_loss "
                      f"alone: {missing}.", UserWarning, stacklevel=4)

    def _metric_sums(self, output, target, n: int) -> dict[str, torch.Tensor]:
        """Each plain metric weighted by the batch size; accuracy as counts (see metrics.py); the
        torchmetrics take the batch."""
        if self.stateful is not None:
            self.stateful.update(output, target)
        metrics = self.metrics if self.metrics or self.stateful else _default_metrics(output, target)
        sums, device = {}, output.device if isinstance(output, torch.Tensor) else target.device
        for name, fn in metrics.items():
            if fn is accuracy:  # correct / counted over the pass: ignored labels left out
                sums[f"val_{name}"], sums[f"val_{name}{COUNTED}"] = accuracy_counts(output, target, self.ignore_index)
            else:
                sums[f"val_{name}"] = torch.as_tensor(fn(output, target), device=device).float() * n
        return sums

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
        if isinstance(answer, torch.Tensor) and answer.device.type != "cpu":
            raise GpunbError(f"batch_size_fn(batch) returned a tensor on {answer.device}: reading it waits for "
                             "the device at every step.",
                             "return an int the host knows, e.g. `batch_size_fn=lambda batch: len(batch[-1])`.")
        try:
            n = operator.index(answer)  # a NumPy integer, a 0-d integer tensor on the host
        except TypeError:
            n = -1
        if isinstance(answer, bool) or n < 0:
            raise GpunbError(f"batch_size_fn(batch) returned {answer!r}, not a count of samples.",
                             "return an int, e.g. `batch_size_fn=lambda batch: len(batch[-1])`.")
        return n
    return samples



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
    return filename.endswith(("torch/nn/modules/module.py", "gpunb/runtime/step/objective.py"))


def _step_loss(returned) -> torch.Tensor:
    """The loss in what `step(model, batch)` returned: the loss, `(loss, output)` or a dict with "loss"."""
    if isinstance(returned, (list, tuple)) and len(returned) == 2:
        returned = returned[_loss_position(returned)]
    return _scalar(returned, "step(model, batch)")


def _loss_position(pair) -> int:
    """0 for `(loss, output)`; 1 for `(output, loss)` (a nanoGPT model's own return, passed on)."""
    first, second = (isinstance(v, torch.Tensor) and v.ndim == 0 for v in pair)
    return 1 if second and not first else 0


def _step_output(returned) -> tuple[Any, Any]:
    """(output, target) from what `step` returned; None for what it left out."""
    if isinstance(returned, (list, tuple)) and len(returned) == 2:
        return returned[1 - _loss_position(returned)], None
    if isinstance(returned, Mapping):  # a dict, or a Hugging Face ModelOutput (.loss, .logits)
        output = returned.get("output", returned.get("logits"))
        return output, returned.get("target")
    return None, None


def _scores_in(output) -> torch.Tensor | None:
    """The scores a model that computes its own loss returned: `.logits`, or the one tensor with
    a batch dimension in a tuple (nanoGPT's `(logits, loss)`)."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (list, tuple)):
        scores = [v for v in output if isinstance(v, torch.Tensor) and v.ndim > 0]
        if len(scores) == 1:
            return scores[0]
    return None


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
