"""Feeds: where each epoch's batches come from, already on the training device.

- TensorFeed: tensors (moved to the GPU once when they fit) shuffled and batched by
  indexing on the device: no DataLoader, no host work per step.
- LoaderFeed: a DataLoader (pinned memory, workers, persistent workers, prefetching)
  wrapped in a CudaPrefetcher on CUDA.

Both draw their order from EpochOrder, so an epoch's order depends only on the seed
and the epoch number: a resumed run sees exactly the batches it would have seen. A user's own
DataLoader keeps its own order; a resumed epoch makes it again from the RNG states it was first
made from (epoch_start.py).
Device transforms run on each batch on the device (augmenter.py): on CUDA ahead of the
step on the prefetcher's side stream, elsewhere inline. On CUDA the preparation runs in
a thread of its own wherever it draws from no global RNG (the transforms take their
generator, and a DataLoader's own Python runs in its workers).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler,
                              SequentialSampler)

from gpunb.errors import GpunbError
from gpunb.runtime.feed.augmenter import Augmenter
from gpunb.runtime.feed.batch_seeds import SeededBatchSampler, SeededDataset, loader_generator
from gpunb.runtime.feed.epoch_start import EpochStart
from gpunb.runtime.feed.inputs import gather_rows, loader_batch_size, move_batch
from gpunb.runtime.feed.prefetch import CudaPrefetcher
from gpunb.runtime.feed.workers import SHIPPED, for_workers

RESIDENT_FRACTION = 0.25  # share of free GPU memory a dataset may take to live on the GPU


class EpochOrder:
    """Sample order of an epoch: seeded per epoch, sharded per rank like DistributedSampler."""

    def __init__(self, n: int, shuffle: bool, seed: int | None, rank: int = 0, world_size: int = 1):
        self.n, self.shuffle, self.seed = n, shuffle, seed or 0
        self.rank, self.world_size = rank, world_size

    def __len__(self) -> int:
        return -(-self.n // self.world_size)

    @property
    def padding(self) -> int:
        """Samples at the end of this rank's share that repeat others' (0 or 1): the shares are
        made equal by repeating the first samples, as DistributedSampler does."""
        return int(self.world_size > 1 and (len(self) - 1) * self.world_size + self.rank >= self.n)

    def indices(self, epoch: int) -> torch.Tensor:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.n, generator=generator)
        else:
            order = torch.arange(self.n)
        if self.world_size > 1:
            padding = len(self) * self.world_size - self.n
            repeats = -(-padding // max(1, self.n))  # fewer samples than ranks: repeat them all
            order = torch.cat([order, order.repeat(repeats)[:padding]])[self.rank::self.world_size]
        return order


class _EpochSampler(Sampler):
    """Yields EpochOrder's indices from a start position (set before each epoch)."""

    def __init__(self, order: EpochOrder):
        self.order, self.epoch, self.start = order, 0, 0

    def __iter__(self):
        return iter(self.order.indices(self.epoch)[self.start:].tolist())

    def __len__(self) -> int:
        return len(self.order) - self.start


class TensorFeed:
    def __init__(self, tensors, batch_size, order: EpochOrder, device, drop_last, augment: Augmenter):
        self.tensors, self.batch_size, self.order = tensors, batch_size, order
        self.device, self.drop_last, self.augment = device, drop_last, augment
        # Host tensors: copy (and transform) on a side stream. Resident tensors: only when there
        # are transforms to move off the step's stream. Gathering a batch alone is one small
        # kernel per tensor, far shorter than a step; on a side stream it would cost more host
        # time (two stream waits and a record_stream per batch) than it could hide, and small
        # launch-bound models are the ones that hold their data on the GPU.
        on_host = tensors[0].device.type == "cpu"
        self.prefetch = (CudaPrefetcher(device) if device.type == "cuda" and (on_host or augment) else None)
        self.padding = order.padding  # repeated samples at the end of each epoch (see EpochOrder)

    @property
    def num_batches(self) -> int:
        full, rest = divmod(len(self.order), self.batch_size)
        return full if self.drop_last or not rest else full + 1

    def epoch(self, epoch: int, skip: int = 0) -> Iterator:
        index = self.order.indices(epoch).to(self.tensors[0].device)
        positions = range(skip, self.num_batches)
        if self.prefetch:
            augment, tensors, size = self.augment, self.tensors, self.batch_size
            ahead = self.prefetch.in_thread if augment.own_rng else self.prefetch
            if index.is_cuda:  # resident: gathered and transformed on the side stream, which reads the order
                index.record_stream(self.prefetch.stream)
                return ahead(positions, lambda b: augment(_gathered(tensors, index, size, b), epoch, b))
            # on the host: gathered into pinned memory there, copied and transformed on the side stream
            gather, copy = self.prefetch.gather, self.prefetch.copy
            return ahead(positions, lambda b: augment(copy(gather(tensors, _rows(index, size, b))), epoch, b))
        batches = _indexed(self.tensors, index, self.batch_size, skip, self.num_batches)
        if self.tensors[0].device != self.device:
            batches = (move_batch(b, self.device) for b in batches)
        return _augmented_inline(batches, self.augment, epoch, skip)


@contextmanager
def closing(batches):
    """An epoch's batches, ended on leaving even when not exhausted: a thread preparing them
    stops then, not when the iterator is collected (an error's traceback can hold it long)."""
    try:
        yield batches
    finally:
        close = getattr(batches, "close", None)  # generators have it; a DataLoader's iterator has not
        if close is not None:
            close()


def _indexed(tensors, index, batch_size, first, end) -> Iterator[tuple]:
    """Batches `first` to `end` (exclusive) of `tensors` in the order `index`."""
    for b in range(first, end):
        yield _gathered(tensors, index, batch_size, b)


def _gathered(tensors, index, batch_size, b: int) -> tuple:
    """Batch `b`: one slice of the order and one gather per tensor (inputs.gather_rows, which
    the check before training gathers its batch with too)."""
    return gather_rows(tensors, _rows(index, batch_size, b))


def _rows(index, batch_size, b: int) -> torch.Tensor:
    """The sample numbers of batch `b` in the order `index`."""
    return index[b * batch_size:(b + 1) * batch_size]


class LoaderFeed:
    def __init__(self, loader: DataLoader, device, augment: Augmenter, sampler: _EpochSampler | None = None):
        self.loader, self.device, self.augment, self.sampler = loader, device, augment, sampler
        self.prefetch = CudaPrefetcher(device) if device.type == "cuda" else None
        self.batch_size = loader_batch_size(loader)
        self.padding = sampler.order.padding if sampler is not None else _sampler_padding(loader.sampler)
        # the user's own loader draws its order itself: the RNG states it began each epoch from
        self.start = EpochStart(loader) if sampler is None else None
        try:
            self.num_batches = len(loader)  # measured before any resume offset is set
        except TypeError:  # an IterableDataset without __len__
            self.num_batches = None

    def epoch(self, epoch: int, skip: int = 0) -> Iterator:
        if self.sampler is not None:
            self.sampler.epoch, self.sampler.start = epoch, skip * self.batch_size
            batches = iter(self.loader)
        else:  # the user's own DataLoader: its order is its own, so skip by reading (epoch_start.py)
            if hasattr(self.loader.sampler, "set_epoch"):  # a DistributedSampler of the user's
                self.loader.sampler.set_epoch(epoch)
            batches = self.start.batches(epoch, skip)
        if self.prefetch:  # copied and transformed on the side stream
            augment, copy = self.augment, self.prefetch.copy
            # in a thread where the loader's own Python (its Dataset, collate_fn) runs in its workers
            ahead = self.prefetch.in_thread if self.loader.num_workers and augment.own_rng else self.prefetch
            return ahead(enumerate(batches, start=skip), lambda item: augment(copy(item[1]), epoch, item[0]))
        if self.device.type != "cpu":
            batches = (move_batch(b, self.device, non_blocking=True) for b in batches)
        return _augmented_inline(batches, self.augment, epoch, skip)


def build_feed(data, *, batch_size, device, config, rank=0, world_size=1, train=True):
    """The feed for `data` (already adapted by inputs.adapt_data)."""
    augment = Augmenter([t for t in config.transforms if train or not getattr(t, "train_only", False)],
                        config.seed, device)
    if isinstance(data, tuple):
        order = EpochOrder(len(data[0]), config.shuffle and train, config.seed, rank, world_size)
        tensors = _maybe_resident(data, device, config.gpu_resident)
        return TensorFeed(tensors, batch_size, order, device, config.drop_last and train, augment)
    if isinstance(data, DataLoader):
        data = _workable(data)
        if world_size > 1 and _needs_sharding(data):
            sampler = _EpochSampler(EpochOrder(len(data.dataset), isinstance(data.sampler, RandomSampler),
                                               config.seed, rank, world_size))
            return LoaderFeed(rebuilt_loader(data, sampler), device, augment, sampler)
        return LoaderFeed(data, device, augment)
    if isinstance(data, IterableDataset):
        loader = _own_loader(data, _loader_options(config, device), batch_size=batch_size,
                             generator=loader_generator(config.seed))
        return LoaderFeed(loader, device, augment)
    sampler = _EpochSampler(EpochOrder(len(data), config.shuffle and train, config.seed, rank, world_size))
    batch_sampler = BatchSampler(sampler, batch_size, drop_last=config.drop_last and train)
    options = _loader_options(config, device)
    if options["num_workers"]:  # workers' randomness from (seed, epoch, batch): exact resume
        data = SeededDataset(data)
        batch_sampler = SeededBatchSampler(batch_sampler, sampler, config.seed)
    loader = _own_loader(data, options, batch_sampler=batch_sampler, generator=loader_generator(config.seed))
    return LoaderFeed(loader, device, augment, sampler)


def _sampler_padding(sampler) -> int:
    """A user's DistributedSampler repeats samples to even out the shares: 1 at the end of this
    rank's share, or 0 (as EpochOrder.padding)."""
    if not hasattr(sampler, "num_replicas") or getattr(sampler, "drop_last", True):
        return 0
    try:
        n = len(sampler.dataset)
    except TypeError:
        return 0
    return int((sampler.num_samples - 1) * sampler.num_replicas + sampler.rank >= n)


def _needs_sharding(loader: DataLoader) -> bool:
    """Whether a user's DataLoader must be rebuilt so that each rank reads its own share."""
    if isinstance(loader.dataset, IterableDataset) or hasattr(loader.sampler, "set_epoch"):
        return False  # a stream splits itself by rank; a DistributedSampler already does it
    if loader.batch_size is None or not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        custom = loader.sampler if loader.batch_size is not None else loader.batch_sampler
        raise GpunbError(
            f"The DataLoader uses a {type(custom).__name__}, which gpunb cannot split between "
            "the processes of a multi-device run.",
            "give the DataLoader `shuffle=True/False` and a `batch_size` (gpunb then gives each "
            "process its share), or a `torch.utils.data.DistributedSampler` of your own.")
    return True


def with_batch_size(loader: DataLoader, batch_size: int) -> DataLoader:
    """The same loader (dataset, sampler, collate_fn, workers, ...) yielding batches of `batch_size`."""
    if loader.batch_size is None:
        how = (f"its own batch_sampler ({type(loader.batch_sampler).__name__})"
               if loader.batch_sampler is not None else "`batch_size=None` (the dataset yields batches)")
        raise GpunbError(f"batch_size='auto' cannot resize this DataLoader: it batches with {how}, "
                         "which gpunb cannot rebuild at another size.",
                         "give the DataLoader `batch_size=` (with `shuffle=` or `sampler=`), pass the "
                         "Dataset itself as train_data, or set an int batch size, e.g. `batch_size=32`.")
    return rebuilt_loader(loader, loader.sampler, batch_size)


def rebuilt_loader(loader: DataLoader, sampler: Sampler | None = None, batch_size: int | None = None,
                   **changes) -> DataLoader:
    """The same loader (collate_fn, workers, pinning, ...) drawing its indices from `sampler` in
    batches of `batch_size` where given, with `changes` to its other arguments."""
    options = dict(dataset=loader.dataset, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                   pin_memory=loader.pin_memory, timeout=loader.timeout,
                   worker_init_fn=loader.worker_init_fn, generator=loader.generator,
                   multiprocessing_context=loader.multiprocessing_context)
    options.update(changes)
    if options["num_workers"]:
        options.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)
    if isinstance(loader.dataset, IterableDataset):  # a stream has no sampler to replace
        return DataLoader(batch_size=loader.batch_size, drop_last=loader.drop_last, **options)
    if sampler is None and batch_size is None and loader.batch_sampler is None:
        return DataLoader(sampler=loader.sampler, batch_size=None, **options)
    if sampler is None and batch_size is None:
        return DataLoader(batch_sampler=loader.batch_sampler, **options)
    batches = BatchSampler(sampler or loader.sampler, batch_size or loader.batch_size, drop_last=loader.drop_last)
    return DataLoader(batch_sampler=batches, **options)


def _workable(loader: DataLoader) -> DataLoader:
    """The user's loader, rebuilt only where its workers could not unpickle what it sends them."""
    sent = {name: getattr(loader, name) for name in SHIPPED}
    objects, workers, method = for_workers(sent, loader.num_workers, loader.multiprocessing_context)
    if objects is sent and workers == loader.num_workers:
        return loader
    return rebuilt_loader(loader, num_workers=workers, multiprocessing_context=method if workers else None,
                    **objects)


def _own_loader(dataset, options: dict, **arguments) -> DataLoader:
    """A loader gpunb builds, its dataset sent to workers by value where it must be."""
    objects, workers, method = for_workers({"dataset": dataset}, options["num_workers"])
    options = dict(options, num_workers=workers)
    if not workers:
        options.pop("persistent_workers", None)
        options.pop("prefetch_factor", None)
    if method:
        options["multiprocessing_context"] = method
    return DataLoader(objects["dataset"], **arguments, **options)


def resolve_num_workers(requested, device: torch.device) -> int:
    """ "auto": 0 on CPU (the cores are busy computing), else up to 8 per device."""
    if requested != "auto":
        return requested
    if device.type == "cpu":
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_device = cpus // max(1, torch.cuda.device_count() if device.type == "cuda" else 1)
    return max(1, min(8, per_device - 1))


def _loader_options(config, device) -> dict:
    workers = resolve_num_workers(config.num_workers, device)
    options = {"num_workers": workers, "pin_memory": device.type == "cuda"}
    if workers:
        options.update(persistent_workers=True, prefetch_factor=4)
    return options


def _maybe_resident(tensors, device, gpu_resident) -> tuple:
    """Move the tensors to the accelerator once when they fit in a fraction of free memory."""
    if device.type == "cpu" or gpu_resident is False:
        return tensors
    if gpu_resident == "auto" and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        if sum(t.nbytes for t in tensors) > RESIDENT_FRACTION * free:
            return tensors
    return tuple(t.to(device) for t in tensors)


def _augmented_inline(batches, augment: Augmenter, epoch: int, first: int) -> Iterator:
    """Batches transformed on the current stream as they are consumed (CPU, MPS)."""
    if not augment:
        return batches
    return (augment(batch, epoch, position) for position, batch in enumerate(batches, start=first))
