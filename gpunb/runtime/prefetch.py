"""Copy the next batch to the GPU on a side stream while the current step computes.

timm's PrefetchLoader shape, with the fixes its users needed: the side stream is
created once and owned here; it waits on the consumer stream before copying (so a
buffer the consumer still reads is never overwritten); each batch is
`record_stream`-ed on the consumer stream (so the caching allocator does not hand
its memory out again while the step still uses it); an empty loader yields nothing.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from gpunb.runtime.inputs import batch_tensors, map_tensors, move_batch


class CudaPrefetcher:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)  # one per run, reused by every epoch

    def __call__(self, batches: Iterable) -> Iterator:
        consumer = torch.cuda.current_stream(self.device)
        pending = None
        for host_batch in batches:
            self.stream.wait_stream(consumer)
            with torch.cuda.stream(self.stream):
                next_batch = move_batch(_pinned(host_batch), self.device, non_blocking=True)
            if pending is not None:
                yield pending  # the step on `pending` overlaps with the copy just issued
            consumer.wait_stream(self.stream)
            for tensor in batch_tensors(next_batch):
                tensor.record_stream(consumer)
            pending = next_batch
        if pending is not None:
            yield pending


def _pinned(batch):
    """Pinned host memory makes the copy truly asynchronous; DataLoader(pin_memory=True) did it already."""
    tensors = batch_tensors(batch)
    if all(t.is_pinned() or t.device.type != "cpu" for t in tensors):
        return batch
    return map_tensors(batch, lambda t: t.pin_memory() if t.device.type == "cpu" else t)
