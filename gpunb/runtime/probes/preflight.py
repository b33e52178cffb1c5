"""Before the first step: the data is not empty, and one batch goes through model and loss.

Everyday mistakes (float64 arrays from scikit-learn, float or (N, 1) labels for
CrossEntropyLoss, features that do not match the first layer, a val_data of the wrong
shape) otherwise surface as raw PyTorch errors deep in the loop, or only after a whole
epoch. Here they cost one forward pass of CHECKED_SAMPLES samples under no_grad (a check
never sets the run's memory peak); only when that fails does the whole batch go through,
so that the error says what the batch held, what the model expected, and the fix. Nothing is left changed: the buffers
(BatchNorm statistics), each module's train/eval mode and the RNGs are put back, so a
run trains exactly as it would without the check.

With `step(model, batch)` the user's own logic is not run ahead of time (it may count or
log); the data checks still apply.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils.data import DataLoader

from gpunb.errors import GpunbError
from gpunb.runtime import device as devices
from gpunb.runtime.feed.augmenter import apply_transforms
from gpunb.runtime.feed.inputs import batch_size_of, batch_tensors, data_length, first_batch, is_mapping, slice_batch
from gpunb.runtime.probes import explain
from gpunb.runtime.probes.explain import dtype_name

AUTO_PROBE = 8  # samples in the checked batch under batch_size="auto" (the probe's first size)
CHECKED_SAMPLES = 2  # samples of it that go through the model when all goes well (2: BatchNorm trains on >1)


def preflight(model, train, val, objective, precision, device, config):
    """Checks `train`/`val` (as adapt_data returns them); returns them, floats cast to the model's dtype."""
    __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
    check_not_empty(train, config, "train_data", drop_last=config.drop_last)
    if val is not None:
        check_not_empty(val, config, "val_data", drop_last=False)
    warn_if_unbounded(train, config)
    dtype = model_dtype(model)
    train, val = cast_floats(train, dtype, "train_data"), cast_floats(val, dtype, "val_data")
    loss_fn = objective.loss_fn
    train, val = cast_class_labels(train, loss_fn, "train_data"), cast_class_labels(val, loss_fn, "val_data")
    if objective.step_fn is None and dtype is not None and next(model.parameters()).device.type != "meta":
        with Untouched(model, device):
            _check_batch(model, objective, precision, train, device, config, "train_data", training=True)
            if val is not None:
                _check_batch(model, objective, precision, val, device, config, "val_data", training=False)
    return train, val


def check_not_empty(data, config, what: str, drop_last: bool) -> None:
    n = data_length(data)
    if n == 0:
        purpose = "train" if what == "train_data" else "validate"
        raise GpunbError(f"{what} is empty: it holds 0 samples, so there is nothing to {purpose} on.",
                         f"check how `{what}` was built (a filter or split that kept nothing?).")
    if isinstance(data, DataLoader):
        drop_last, batch = data.drop_last, data.batch_size
    else:
        batch = config.batch_size
    if drop_last and isinstance(batch, int) and n is not None and batch > n:
        raise GpunbError(f"{what} holds {n} samples and the batch size is {batch}; with `drop_last=True` "
                         "every batch is dropped, so an epoch has 0 steps.",
                         f"use a batch size of at most {n} (`batch_size={n}`), or `drop_last=False`.")


def warn_if_unbounded(data, config) -> None:
    """Data without a length may be a stream that never ends: only max_steps would stop it."""
    if data_length(data) is None and config.max_steps is None:
        warnings.warn(f"train_data ({type(data).__name__}) has no length, so each epoch lasts until "
                      "it runs out; if it never does, training never stops. Set `max_steps` "
                      "(`--max-steps N` in %%gputrain) to bound the run.", UserWarning, stacklevel=2)


def model_dtype(model) -> torch.dtype | None:
    """The dtype of the model's first floating parameter (None: it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def cast_floats(data, dtype, what: str):
    """Tensors of a wider float type than the model's are cast to it (a copy), said once."""
    if not isinstance(data, tuple) or dtype is None or dtype == torch.float64:
        return data
    wide = [i for i, t in enumerate(data) if t.dtype == torch.float64]
    if not wide:
        return data
    warnings.warn(f"{what} holds float64 tensors; gpunb casts them to {dtype_name(dtype)}, the model's "
                  f"dtype (a copy). Pass {dtype_name(dtype)} data to skip the copy, e.g. "
                  "`x.astype('float32')` or `torch.as_tensor(x, dtype=torch.float32)`.",
                  UserWarning, stacklevel=2)
    return tuple(t.to(dtype) if i in wide else t for i, t in enumerate(data))


def cast_class_labels(data, loss_fn, what: str):
    """Integer labels narrower than int64 (int32 from NumPy on Windows or from a pandas column),
    which CrossEntropyLoss and NLLLoss refuse, are cast to int64 (a copy of the labels), said once."""
    if not isinstance(data, tuple) or len(data) < 2 or not _is_class_loss(loss_fn):
        return data
    labels = data[-1]
    if labels.is_floating_point() or labels.dtype in (torch.int64, torch.uint8, torch.bool):
        return data
    warnings.warn(f"The labels of {what} are {dtype_name(labels.dtype)}, and {_loss_name(loss_fn)} takes int64: "
                  "gpunb casts them (a copy). Pass int64 labels (`y.long()`) to skip the copy.",
                  UserWarning, stacklevel=2)
    return (*data[:-1], labels.long())


def _loss_name(loss_fn) -> str:
    return getattr(loss_fn, "__name__", None) or type(loss_fn).__name__


def _check_batch(model, objective, precision, data, device, config, what, training: bool) -> None:
    __tracebackhide__ = True  # noqa: F841
    try:
        batch = first_batch(data, config.batch_size if isinstance(config.batch_size, int) else AUTO_PROBE, device)
    except RuntimeError as error:
        problem = explain.ragged(error, data, what, config.batch_size)
        if problem is None:
            raise
        raise problem from error
    transforms = [t for t in config.transforms if training or not getattr(t, "train_only", False)]
    if transforms:  # as the feed applies them (build_feed): the model sees transformed batches
        batch = apply_transforms(batch, transforms)
    model.train(training)
    sample = small_sample(batch, CHECKED_SAMPLES)
    if sample is not batch and _passes(model, objective, precision, sample, training):
        return
    trace = explain.LayerTrace(model)
    try:
        with torch.no_grad(), precision.autocast(), trace:
            if training:
                objective.loss(model, batch)
            else:
                objective.evaluate(model, batch)
                if objective.stateful is not None:
                    objective.stateful.reset()  # a check: this batch counts in no validation
    except GpunbError as error:
        raise _name_the_data(error, batch, model, objective, what) from error.__cause__
    except Exception as error:
        if devices.out_of_memory(error):
            return  # training's own OOM handling (smaller micro-batches) takes it from here
        _explain_failure(error, batch, model, objective, what, trace.failed_in_torch_layer(error))


def small_sample(batch, samples: int):
    """The first `samples` samples of `batch`, or the batch itself when it is no larger or its
    tensors do not all hold one row per sample (it cannot be cut)."""
    size = batch_size_of(batch)
    shapes = [tuple(t.shape) for t in batch_tensors(batch)]
    if size <= samples or not shapes or any(not shape or shape[0] != size for shape in shapes):
        return batch
    return slice_batch(batch, 0, samples)


def _passes(model, objective, precision, sample, training: bool) -> bool:
    """Whether `sample` goes through model and loss (an error: the whole batch explains it)."""
    try:
        with torch.no_grad(), precision.autocast():
            if training:
                objective.loss(model, sample)
            else:
                objective.evaluate(model, sample)
                if objective.stateful is not None:
                    objective.stateful.reset()
    except Exception as error:  # noqa: BLE001 - the whole batch runs next and explains the error
        return devices.out_of_memory(error)  # an OOM: training's own handling (smaller micro-batches)
    return True


def _name_the_data(error: GpunbError, batch, model, objective, what) -> GpunbError:
    """gpunb's own refusal of the batch, saying which data it came from (an earlier cell's
    val_data is otherwise a mystery), with the better fix where one is known."""
    missing = explain.missing_labels(error, batch, model, objective, what)
    if missing is not None:
        return missing
    hint = explain.own_loss_instead(model, batch, objective.loss_fn) or error.hint
    return GpunbError(f"One batch of {what} failed before training: {error.what}", hint)


def _explain_failure(error, batch, model, objective, what, layer) -> None:
    """Raises one GpunbError that leads with the fix (the torch error chained), or, when the cause
    is unknown and inside the user's own code, the error itself with what the batch held."""
    __tracebackhide__ = True  # noqa: F841
    hint = diagnose(error, batch, model, objective.loss_fn)
    found = (f"{explain.how_batch_was_read(batch, objective.loss_fn)}\n"
             f"The batch: {explain.describe_batch(batch)}. The model expects: {describe_model(model)}.")
    if layer is not None:
        name, module, args = layer
        found = f"It failed in `{name}` ({type(module).__name__}), given {explain.describe_args(args)}.\n{found}"
        hint = hint or explain.reorder_hint(batch, objective.loss_fn) or explain.layer_hint(name, module, args)
    else:
        hint = hint or explain.reorder_hint(batch, objective.loss_fn)
    if hint is None:
        error.add_note(f"gpunb ran one batch of {what} through the model and loss before "
                       f"training, and it failed. {found}")
        raise error
    raise GpunbError(f"One batch of {what} failed in the model or the loss before training "
                     f"started: {type(error).__name__}: {_first_line(error)}\n{found}", hint) from error


def diagnose(error: Exception, batch, model, loss_fn) -> str | None:
    """The fix for the everyday causes of `error`, or None when it is none of them."""
    text = str(error)
    own_loss = explain.own_loss_instead(model, batch, loss_fn)
    if own_loss is not None:
        return own_loss
    inputs, target = _inputs_and_target(batch, loss_fn)
    dtype = model_dtype(model)
    floats = [t for t in inputs if t.is_floating_point()]
    if floats and dtype is not None and any(t.dtype != dtype for t in floats) and (
            "dtype" in text or "scalar type" in text or "Double" in text):
        wrong = next(t.dtype for t in floats if t.dtype != dtype)
        return (f"the inputs are {dtype_name(wrong)} and the model's weights {dtype_name(dtype)}: cast the "
                f"inputs, e.g. return `x.float()` from the Dataset (or `model.to({dtype_name(dtype, True)})`"
                " the other way round).")
    if _is_class_loss(loss_fn) and isinstance(target, torch.Tensor):
        if target.is_floating_point() and (target.ndim == 1 or (target.ndim == 2 and target.shape[1] == 1)):
            fix = "`y.squeeze(1).long()`" if target.ndim == 2 else "`y.long()`"
            return (f"{type(loss_fn).__name__} takes integer class labels (int64), and the labels "
                    f"are {dtype_name(target.dtype)} of shape {tuple(target.shape)}: use {fix}.")
        if target.ndim == 2 and target.shape[1] == 1:
            return (f"{type(loss_fn).__name__} takes labels of shape (N,), and these are "
                    f"{tuple(target.shape)}: use `y.squeeze(1)` (or `y.view(-1)`).")
        if not target.is_floating_point() and target.dtype not in (torch.int64, torch.uint8, torch.bool):
            return (f"{type(loss_fn).__name__} takes int64 class labels, and the labels are "
                    f"{dtype_name(target.dtype)}: use `y.long()` (e.g. return `torch.tensor(label)` or "
                    "`label.long()` from the Dataset).")
    return _shape_hint(model, inputs)


def _shape_hint(model, inputs) -> str | None:
    first = next((m for m in model.modules() if isinstance(m, _FIRST_LAYERS)), None)
    if first is None or not inputs:
        return None
    x = inputs[0]
    if isinstance(first, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and x.is_floating_point():
        return (f"the model starts with an {type(first).__name__}, which takes integer indices, and the "
                f"inputs are {dtype_name(x.dtype)}: use `x.long()`.")
    if isinstance(first, torch.nn.Linear):
        per_sample = x[0].numel() if x.ndim > 1 else 1
        if x.ndim and x.shape[-1] != first.in_features and per_sample != first.in_features:
            return (f"the model's first Linear takes {first.in_features} features per sample, and the "
                    f"inputs have shape {tuple(x.shape)}: give the data {first.in_features} features "
                    f"(or build the model with `nn.Linear({x.shape[-1]}, ...)`).")
    if isinstance(first, torch.nn.modules.conv._ConvNd):
        dims = len(first.kernel_size)
        if x.ndim == dims + 1:
            return (f"the model's first {type(first).__name__} takes (N, C{', H, W' if dims == 2 else ', ...'}) "
                    f"batches, and the inputs have shape {tuple(x.shape)}: add the channel dimension "
                    "with `x.unsqueeze(1)`.")
        if x.ndim == dims + 2 and x.shape[1] != first.in_channels:
            return (f"the model's first {type(first).__name__} takes {first.in_channels} channels, and the "
                    f"inputs have {x.shape[1]} (shape {tuple(x.shape)}): channels go second, "
                    "(N, C, H, W); e.g. `x.permute(0, 3, 1, 2)` for (N, H, W, C) images.")
    return None


_FIRST_LAYERS = (torch.nn.Linear, torch.nn.modules.conv._ConvNd, torch.nn.Embedding, torch.nn.EmbeddingBag)


def _is_class_loss(loss_fn) -> bool:
    return isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)) or loss_fn in (
        torch.nn.functional.cross_entropy, torch.nn.functional.nll_loss)


def _inputs_and_target(batch, loss_fn):
    if isinstance(batch, torch.Tensor):
        return [batch], None
    if is_mapping(batch):
        return [v for v in batch.values() if isinstance(v, torch.Tensor)], None
    tensors = [t for t in batch if isinstance(t, torch.Tensor)] if isinstance(batch, (list, tuple)) else []
    if loss_fn is not None and len(tensors) >= 2:
        return tensors[:-1], tensors[-1]
    return tensors, None


def describe_model(model) -> str:
    first = next((m for m in model.modules() if isinstance(m, _FIRST_LAYERS)), None)
    dtype = model_dtype(model)
    weights = f"{dtype_name(dtype)} weights" if dtype is not None else "no floating weights"
    if isinstance(first, torch.nn.Linear):
        return f"first layer Linear(in_features={first.in_features}), {weights}"
    if isinstance(first, torch.nn.modules.conv._ConvNd):
        return f"first layer {type(first).__name__}(in_channels={first.in_channels}), {weights}"
    if isinstance(first, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return (f"first layer {type(first).__name__}({first.num_embeddings}, {first.embedding_dim}) "
                f"(integer inputs), {weights}")
    return weights


class Untouched:
    """Puts back what one forward pass may change: buffers, each module's mode, the RNGs."""

    def __init__(self, model, device):
        self.model, self.device = model, device

    def __enter__(self):
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.modes = [(m, m.training) for m in self.model.modules()]
        self.rng = devices.rng_state(self.device)

    def __exit__(self, *exc):
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        for module, training in self.modes:
            module.training = training
        devices.set_rng_state(self.rng, self.device)
        return False


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

