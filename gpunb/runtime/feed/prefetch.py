"""Prepare the next batch on a side stream while the current step computes.

timm's PrefetchLoader shape, with the fixes its users needed: the side stream is
created once and owned here; it waits on the consumer stream before each batch (so a
buffer the consumer still reads is never overwritten); each batch is
`record_stream`-ed on the consumer stream (so the caching allocator does not hand
its memory out again while the step still uses it), and the consumer waits on the
side stream before using it; an empty loader yields nothing.

What "prepare" means is the caller's: by default the copy of a host batch to the GPU.
The tensor feed also gathers the batch (rows of host tensors straight into pinned
memory, rows of GPU-resident tensors on the side stream), and the feeds run the device
transforms there (feeds.py), so augmentation is off the step's critical path too.
Temporaries a preparation allocates are freed on the side stream, which alone used them.

`in_thread` does the same preparations in a thread of their own (producer.py), so that
the host's time launching them overlaps with the step's: the feeds use it wherever the
preparation draws from no global RNG. Each batch then carries an event recorded on the
side stream after it, which the consumer stream waits on. The per-batch wait of the
side stream on the consumer is not needed there: each batch is new memory, and memory
a step still reads (record_stream) is handed out again only once the step is done.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from gpunb.runtime.feed.inputs import batch_tensors, map_tensors, move_batch
from gpunb.runtime.feed.producer import Producer


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

    def in_thread(self, items: Iterable, prepare: Callable | None = None) -> Iterator:
        """As calling it, with the preparations made in a thread, up to two items ahead."""
        prepare = prepare or self.copy
        consumer = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(consumer)  # what the consumer made for the epoch (its order) is there first

        def on_side_stream(item):
            with torch.no_grad():  # a batch needs no history, and the thread's grad mode is its own
                batch = prepare(item)
            ready = torch.cuda.Event()
            ready.record(self.stream)
            return batch, ready

        producer = Producer(items, on_side_stream, within=lambda: torch.cuda.stream(self.stream),
                            name="gpunb-prefetch")
        try:
            for batch, ready in producer:
                consumer.wait_event(ready)
                for tensor in batch_tensors(batch):
                    tensor.record_stream(consumer)
                yield batch
        finally:  # the loop stopped or broke off: so does the thread
            producer.close()

    @torch.no_grad()  # out= takes no tensor that requires grad; a batch needs no history
    def gather(self, tensors, rows: torch.Tensor) -> tuple:
        """Rows `rows` of host `tensors`, gathered straight into pinned memory. Gathering and then
        pinning would pass over the batch twice, the first time into fresh pageable memory that the
        OS maps page by page as it is written, which is several times slower than writing into
        memory already mapped, as torch's cache of pinned memory hands out (benchmarks/RESULTS.md).
        That cache gives a buffer out again only once the copy from it to the GPU has completed."""
        return tuple([torch.index_select(t, 0, rows, out=torch.empty((len(rows), *t.shape[1:]), dtype=t.dtype,
                                                                      pin_memory=True))
                      for t in tensors])

    def copy(self, host_batch):
        """The batch on the device, copied asynchronously (on the current stream)."""
        return move_batch(_pinned(host_batch), self.device, non_blocking=True)


def _pinned(batch):
    """Pinned host memory makes the copy truly asynchronous; DataLoader(pin_memory=True) did it already."""
    tensors = batch_tensors(batch)
    if all(t.device.type != "cpu" or t.is_pinned() for t in tensors):  # is_pinned is an op: host tensors only
        return batch
    return map_tensors(batch, lambda t: t.pin_memory() if t.device.type == "cpu" else t)
