"""Why one batch failed before training, in the user's terms: which layer failed on what input,
which batch item was taken as the target, which key the model wanted its labels under, that
the samples are ragged, that the model computes its own loss. The pre-training check
(preflight.py) turns these into one GpunbError that leads with the fix.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gpunb.errors import GpunbError
from gpunb.runtime import matching
from gpunb.runtime.feed.inputs import is_mapping

RAGGED = "stack expects each tensor to be equal size"


class LayerTrace:
    """Which module was running when a forward pass failed, and what it was given.

    Every module pushes itself on entry and pops on a clean exit; a failure leaves the chain
    of running modules on the stack, the innermost last. Hooks live only inside the `with`.
    """

    def __init__(self, model):
        self.model, self.stack, self.handles = model, [], []

    def __enter__(self):
        names = {id(m): name for name, m in self.model.named_modules()}
        for module in self.model.modules():
            name = names.get(id(module)) or type(module).__name__
            try:
                self.handles.append(module.register_forward_pre_hook(
                    lambda m, args, name=name: self.stack.append((name, m, args))))
                self.handles.append(module.register_forward_hook(lambda m, args, out: self._pop(m)))
            except (RuntimeError, AttributeError):  # a TorchScript module takes no Python hooks
                continue
        return self

    def _pop(self, module) -> None:
        # Down to the module's own entry: a child whose error the parent caught never popped itself.
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][1] is module:
                del self.stack[i:]
                return

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False

    def failed_in_torch_layer(self, error: Exception):
        """(name, module, args) of the torch layer that refused its input, or None: the failure is
        in the user's own forward code, outside the model, or not about the input (a device error)."""
        if not self.stack or not isinstance(error, (RuntimeError, ValueError, IndexError, TypeError)):
            return None
        if "CUDA" in str(error) or "device" in str(error):
            return None
        name, module, args = self.stack[-1]
        return (name, module, args) if type(module).__module__.startswith("torch.nn.") else None


def ragged(error: RuntimeError, data, what: str, batch_size) -> GpunbError | None:
    """Samples of different lengths that default collation cannot stack: name the padding fix."""
    if RAGGED not in str(error):
        return None
    first = _first_sample(getattr(data, "dataset", data))
    size = getattr(data, "batch_size", None) or (batch_size if isinstance(batch_size, int) else 32)
    name = "ds" if what == "train_data" else "val_ds"
    if isinstance(first, Mapping):
        collator = "transformers.DataCollatorWithPadding(tokenizer)"
        also = " or pad when tokenizing (`tokenizer(..., padding='max_length', truncation=True)`)."
    else:
        collator = "pad"
        also = " where `pad` stacks the items with `torch.nn.utils.rnn.pad_sequence(..., batch_first=True)`."
    shuffle = "" if what == "val_data" else ", shuffle=True"
    fix = (f"pad each batch with a collator and pass a DataLoader: `{what} = DataLoader({name}, "
           f"batch_size={size}{shuffle}, collate_fn={collator})`;{also}")
    return GpunbError(f"The samples of {what} differ in length (ragged), so gpunb cannot stack them into "
                      f"one batch: {str(error).strip().splitlines()[0]}.", fix)


def _first_sample(dataset):
    """The dataset's first sample, for the advice; None where it has none to give (a stream: torch's
    IterableDataset inherits a `__getitem__` that raises)."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    try:
        return dataset[0]
    except Exception:  # noqa: BLE001 - advice only: the error being explained is the one raised
        return None


def missing_labels(error: GpunbError, batch, model, objective, what: str) -> GpunbError | None:
    """A Hugging Face-style model that returned no loss because the batch has no `labels`."""
    own_loss = objective.loss_fn is None and objective.step_fn is None
    if not (own_loss and isinstance(batch, Mapping) and "not a loss tensor" in error.what):
        return None
    wanted = matching.takes_labels(model)
    if wanted is None or wanted in batch:
        return None
    keys = ", ".join(map(repr, batch))
    near = next((k for k in batch if isinstance(k, str) and ("label" in k.lower() or k in matching.TARGET_NAMES)),
                None)
    if near is not None:
        fix = (f"rename `{near}` to `{wanted}`: `ds = ds.rename_column({near!r}, {wanted!r})` for a "
               f"`datasets.Dataset`, or return the key {wanted!r} from your Dataset.")
    else:
        fix = (f"add the labels to the data under the key {wanted!r} (`ds = ds.add_column({wanted!r}, labels)` "
               "for a `datasets.Dataset`), or pass a `step(model, batch)` that computes the loss.")
    return GpunbError(f"The model computes its loss only when it is given `{wanted}`, and the batches of "
                      f"{what} have no {wanted!r} (keys: {keys}), so its forward returned no loss.", fix)


def own_loss_instead(model, batch, loss_fn) -> str | None:
    """With `loss_fn`, a model whose forward takes the target and returns its own loss: drop loss_fn."""
    target = matching.own_loss_target(model, batch) if loss_fn is not None else None
    if target is None:
        return None
    call = "model(**batch)" if isinstance(batch, Mapping) else "model(*batch)"
    return (f"drop `loss_fn`: the model computes its loss (its forward takes `{target}`). gpunb then "
            f"calls `{call}`, which passes the target, and trains on the loss it returns.")


def how_batch_was_read(batch, loss_fn) -> str:
    """Which batch items went to the model and which one was taken as the target."""
    if isinstance(batch, Mapping):
        return "gpunb called `model(**batch)`."
    if not isinstance(batch, (list, tuple)):
        return "gpunb called `model(batch)`."
    if loss_fn is None or len(batch) < 2:
        return f"gpunb called `model(*batch)` with {len(batch)} item{'s' * (len(batch) != 1)}."
    inputs = ", ".join(f"batch[{i}]" for i in range(len(batch) - 1))
    last = len(batch) - 1
    return (f"gpunb called `model({inputs})` and `loss_fn(output, batch[{last}])`: with `loss_fn`, the "
            f"last item, batch[{last}] ({describe_batch(batch[last])}), is the target.")


def reorder_hint(batch, loss_fn) -> str | None:
    """For batches of 3 or more items the target may not be last (the tutorial's `(label, text, offsets)`)."""
    if loss_fn is None or not isinstance(batch, (list, tuple)) or len(batch) < 3:
        return None
    return ("if the target is not the batch's last item (e.g. `(label, text, offsets)`), return "
            "`(text, offsets, label)` from the collate function or Dataset, or pass a `step(model, batch)` "
            "that unpacks it.")


def layer_hint(name: str, layer, args) -> str:
    """How to make the input a torch layer failed on fit it."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    shape = tuple(x.shape) if x is not None else None
    if isinstance(layer, torch.nn.Linear) and x is not None and x.ndim > 0:
        if x.ndim > 2 and x[0].numel() == layer.in_features:
            return (f"flatten the inputs: put `nn.Flatten()` before `{name}` (Linear takes (N, features), "
                    f"and gets {shape}), or `x.flatten(1)`.")
        return (f"`{name}` takes {layer.in_features} features and gets {shape}: build it with "
                f"`nn.Linear({x.shape[-1]}, {layer.out_features})` (or `nn.LazyLinear({layer.out_features})`, "
                "which infers them), or give it inputs of that size.")
    if isinstance(layer, torch.nn.modules.conv._ConvNd):
        return (f"`{name}` ({type(layer).__name__}, {layer.in_channels} in-channels) takes (N, C, ...) "
                f"with C={layer.in_channels} and gets {shape}: give it inputs of that shape.")
    if isinstance(layer, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return (f"`{name}` ({type(layer).__name__}({layer.num_embeddings}, {layer.embedding_dim})) takes integer "
                f"indices below {layer.num_embeddings}"
                + (" and, without 2-D input, 1-D offsets starting at 0" if isinstance(layer, torch.nn.EmbeddingBag)
                   else "") + f"; it got {describe_args(args)}.")
    return (f"`{name}` ({type(layer).__name__}) cannot take {describe_args(args)}: change the data or "
            "the layer so that they agree.")


def describe_args(args) -> str:
    return describe_batch(tuple(args)) if len(args) != 1 else describe_batch(args[0])


def describe_batch(batch) -> str:
    """`x float32 (8, 5), y int64 (8,)`-style: what each tensor of the batch is."""
    if isinstance(batch, torch.Tensor):
        return f"{dtype_name(batch.dtype)} {tuple(batch.shape)}"
    if is_mapping(batch):
        return "{" + ", ".join(f"{k!r}: {describe_batch(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        return "(" + ", ".join(describe_batch(v) for v in batch) + ")"
    return type(batch).__name__


def dtype_name(dtype, qualified: bool = False) -> str:
    name = str(dtype).replace("torch.", "")
    return f"torch.{name}" if qualified else name
