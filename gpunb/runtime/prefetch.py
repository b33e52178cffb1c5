"""Prepare the next batch on a side stream while the current step computes.

timm's PrefetchLoader shape, with the fixes its users needed: the side stream is
created once and owned here; it waits on the consumer stream before each batch (so a
buffer the consumer still reads is never overwritten); each batch is
`record_stream`-ed on the consumer stream (so the caching allocator does not hand
its memory out again while the step still uses it), and the consumer waits on the
side stream before using it; an empty loader yields nothing.

What "prepare" means is the caller's: by default the copy of a host batch to the GPU;
the feeds also gather a batch of GPU-resident tensors and run the device transforms
there (data.py), so augmentation is off the step's critical path too. Temporaries a
preparation allocates are freed on the side stream, which alone used them.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from gpunb.runtime.inputs import batch_tensors, map_tensors, move_batch


class CudaPrefetcher:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)  # one per run, reused by every epoch

    def __call__(self, items: Iterable, prepare: Callable | None = None) -> Iterator:
        """`prepare(item)` for each item, run on the side stream one item ahead of the consumer."""
        prepare = prepare or self.copy
        consumer = torch.cuda.current_stream(self.device)
        pending = None
        for item in items:
            self.stream.wait_stream(consumer)
            with torch.cuda.stream(self.stream):
                next_batch = prepare(item)
            if pending is not None:
                yield pending  # the step on `pending` overlaps with the preparation just issued
            consumer.wait_stream(self.stream)
            for tensor in batch_tensors(next_batch):
                tensor.record_stream(consumer)
            pending = next_batch
        if pending is not None:
            yield pending

    def copy(self, host_batch):
        """The batch on the device, copied asynchronously (on the current stream)."""
        return move_batch(_pinned(host_batch), self.device, non_blocking=True)


def _pinned(batch):
    """Pinned host memory makes the copy truly asynchronous; DataLoader(pin_memory=True) did it already."""
    tensors = batch_tensors(batch)
    if all(t.device.type != "cpu" or t.is_pinned() for t in tensors):  # is_pinned is an op: host tensors only
        return batch
    return map_tensors(batch, lambda t: t.pin_memory() if t.device.type == "cpu" else t)
