"""predict and evaluate: a model over data, fed the way fit feeds it.

The device, the precision (autocast), the batching, GPU-resident tensors and the CUDA
prefetcher are training's own (device.select_device, precision.py, feeds.build_feed), with
validation's settings: no shuffling, no dropped batch, no train-only transforms. The model
runs in eval mode under inference_mode, and each module's mode is put back afterwards.

Inside an initialised process group (torchrun) each rank takes every world_size-th sample
(no padding duplicates), and the outputs (or metric sums) are gathered so that every rank
returns the whole answer, in the data's order.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, IterableDataset, Subset

from gpunb.config import TrainConfig
from gpunb.errors import GpunbError
from gpunb.runtime import device as devices
from gpunb.runtime.context import LocalContext
from gpunb.runtime.feed.feeds import build_feed, closing, rebuilt_loader
from gpunb.runtime.feed.inputs import adapt_data, data_length, is_mapping, map_tensors
from gpunb.runtime.probes.preflight import cast_floats, model_dtype
from gpunb.runtime.roles import check_model
from gpunb.runtime.step.metrics import divide_counted
from gpunb.runtime.step.objective import Objective, model_inputs
from gpunb.runtime.step.precision import Precision, resolve_precision
from gpunb.runtime.validation.sums import validation_sums

DEFAULT_BATCH = 256  # inference keeps no activations for backward: larger batches than training fit


def predict(model, data, *, batch_size: int = DEFAULT_BATCH, precision: str = "auto", devices: int = 1,
            accelerator: str = "auto", num_workers="auto", gpu_resident="auto", transforms=()):
    """The model's outputs on `data`, in order, concatenated on the host.

    `data` is what fit takes: a tensor, `(x,)`, `(x, y)` (the last item, the target, is not
    fed to the model), a Dataset, a DataLoader, or dict batches (`model(**batch)`). Outputs
    that are tensors come back as one tensor; tuples and dicts of tensors as a tuple or dict
    of concatenated tensors (0-d tensors, one per batch, are stacked).

    Outputs whose batches differ in a dimension other than the first (a causal LM's logits
    when the collator pads each batch to its own length) are not padded: they come back as a
    list of the per-batch tensors, in order (under a process group, one tensor per sample, each
    as long as its batch).
    """
    __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
    job = _Job(model, data, _config(batch_size, precision, devices, accelerator, num_workers,
                                    gpu_resident, transforms))
    outputs = []
    with _eval_mode(model), torch.inference_mode(), closing(job.feed.epoch(0)) as batches:
        for batch in batches:
            args, kwargs = model_inputs(batch)
            with job.precision.autocast():
                output = model(*args, **kwargs)
            # An asynchronous copy to the host: the next batch's work is queued meanwhile.
            outputs.append(map_tensors(_plain(output), lambda t: t.to("cpu", non_blocking=True)))
    if job.device.type == "cuda":
        torch.cuda.synchronize(job.device)  # the non_blocking copies have landed
    return job.gather_outputs(concatenate(outputs))


def evaluate(model, data, *, metrics=None, loss_fn=None, step=None, batch_size: int = DEFAULT_BATCH,
             precision: str = "auto", devices: int = 1, accelerator: str = "auto", num_workers="auto",
             gpu_resident="auto", transforms=()) -> dict:
    """The metrics fit's validation reports on `data` (val_loss, val_acc, val_<metric>), as floats.

    `loss_fn`, `step` and `metrics` are fit's: without `loss_fn` the model computes its own loss.
    """
    __tracebackhide__ = True  # noqa: F841
    objective = Objective(loss_fn, step, metrics)
    job = _Job(model, data, _config(batch_size, precision, devices, accelerator, num_workers,
                                    gpu_resident, transforms))
    if objective.stateful is not None:
        objective.stateful.to(job.device)
        objective.stateful.reset()
    with _eval_mode(model), closing(job.feed.epoch(0)) as batches:
        sums, count = validation_sums(model, batches, objective, job.precision)
    sums, count = job.gather_sums(sums, count)
    metrics = divide_counted(LocalContext().reduce_sums(sums, count))
    if objective.stateful is not None:
        metrics.update(objective.stateful.compute())  # over every rank's share under a process group
    return metrics


def _config(batch_size, precision, devices_, accelerator, num_workers, gpu_resident, transforms) -> TrainConfig:
    """Validated like fit's options; shuffle and drop_last are never used (train=False)."""
    return TrainConfig(batch_size=batch_size, precision=precision, devices=devices_, accelerator=accelerator,
                       num_workers=num_workers, gpu_resident=gpu_resident, transforms=tuple(transforms),
                       shuffle=False, track=False)


class _Job:
    """The device, precision and feed of one predict/evaluate call, and this rank's share."""

    def __init__(self, model, data, config: TrainConfig):
        __tracebackhide__ = True  # noqa: F841
        check_model(model)
        if config.batch_size == "auto":
            raise GpunbError("predict and evaluate take a fixed batch size, not 'auto'.",
                             f"pass e.g. `batch_size={DEFAULT_BATCH}`.")
        self.rank, self.world_size = _group()
        if config.devices != 1 and self.world_size == 1:
            raise GpunbError(f"devices={config.devices!r}: predict and evaluate use several devices only "
                             "inside a process group, and none is initialised.",
                             "run the script under `torchrun --nproc-per-node N` (each rank calls "
                             "predict and receives all outputs), or use `devices=1`.")
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = devices.select_device(config.accelerator, local_rank)
        name, _reason = resolve_precision(config.precision, self.device)
        self.precision = Precision(name, self.device)
        data = cast_floats(adapt_data(data, "data"), model_dtype(model), "data")
        self.n = data_length(data)
        model.to(self.device)
        self.feed = build_feed(self._share(data), batch_size=config.batch_size, device=self.device,
                               config=config, train=False)

    def _share(self, data):
        """This rank's samples: every world_size-th from its rank (all of them when alone)."""
        loader = data if isinstance(data, DataLoader) else None
        dataset = loader.dataset if loader is not None else data
        if isinstance(dataset, IterableDataset):
            if self.world_size > 1:
                raise GpunbError("An IterableDataset cannot be split between the ranks in order.",
                                 "pass a map-style Dataset or tensors, or call predict on one rank.")
            return data
        if isinstance(data, tuple):
            return tuple(t[self.rank::self.world_size] for t in data) if self.world_size > 1 else data
        indices = range(self.rank, self.n, self.world_size)
        if loader is not None:
            if loader.batch_size is None:  # the loader batches by its own rules: read it as it is
                if self.world_size > 1:
                    raise GpunbError("A DataLoader with a custom batch_sampler cannot be split between ranks.",
                                     "give the DataLoader a `batch_size`, or pass its Dataset.")
                return loader
            return rebuilt_loader(loader, indices)  # in order, even from a shuffling loader
        return Subset(data, indices) if self.world_size > 1 else data

    def gather_outputs(self, outputs):
        if self.world_size == 1:
            return outputs
        import torch.distributed as dist

        parts = [None] * self.world_size
        dist.all_gather_object(parts, outputs)
        return _interleave(parts, self.n)

    def gather_sums(self, sums: dict, count: int) -> tuple[dict, int]:
        if self.world_size == 1:
            return sums, count
        import torch.distributed as dist

        parts = [None] * self.world_size
        dist.all_gather_object(parts, ({k: v.cpu() for k, v in sums.items()}, count))
        totals = {name: sum(part[0][name] for part in parts) for name in sums}
        return totals, sum(part[1] for part in parts)


def _group() -> tuple[int, int]:
    """(rank, world size) of an initialised process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _eval_mode:
    """model.eval() for the block; each module's own mode is put back afterwards."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc):
        for module, training in self.modes:
            module.training = training
        return False


def _plain(output):
    """Hugging Face ModelOutput and other mappings as a plain dict."""
    return dict(output) if is_mapping(output) else output


def concatenate(outputs: list):
    """Per-batch outputs joined along the sample dimension: tensors, tuples, lists, dicts."""
    if not outputs:
        return []
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.ndim == 0:
            return torch.stack(outputs)
        if any(o.shape[1:] != first.shape[1:] for o in outputs):  # batches padded each to its own length
            return Ragged(outputs)
        return torch.cat(outputs)
    if is_mapping(first):
        return {key: concatenate([o[key] for o in outputs]) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(concatenate(list(items)) for items in zip(*outputs))
    return list(outputs)  # anything else: one item per batch


class Ragged(list):
    """Per-batch output tensors that differ beyond the sample dimension, in order."""


def _interleave(parts: list, n: int):
    """Rank r's outputs are samples r, r + world, ...: put them back in the data's order."""
    first = parts[0]
    if isinstance(first, Ragged):  # one tensor per sample, each its batch's length
        samples = [[row for batch in part for row in batch] for part in parts]
        if sum(len(s) for s in samples) == n:
            whole = [None] * n
            for rank, rows in enumerate(samples):
                whole[rank::len(parts)] = rows
            return whole
        return parts
    if isinstance(first, torch.Tensor):
        if first.ndim == 0 or sum(len(p) for p in parts) != n:
            return parts  # one value per rank (or per batch): nothing to put in sample order
        whole = first.new_empty((n, *first.shape[1:]))
        for rank, part in enumerate(parts):
            whole[rank::len(parts)] = part
        return whole
    if is_mapping(first):
        return {key: _interleave([p[key] for p in parts], n) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_interleave(list(items), n) for items in zip(*parts))
    return parts
