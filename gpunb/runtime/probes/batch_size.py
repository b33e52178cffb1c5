"""batch_size="auto": the batch size to train with, chosen so that a re-run chooses it again.

On a GPU each candidate runs real forward + backward + optimizer steps and must stay
under MEMORY_MARGIN of the device's memory; among the sizes that fit, the smallest
within NEAR_BEST of the best measured throughput wins, so that timing noise between
neighbouring sizes does not flip the choice.

On a CPU memory is rarely the limit and step timings vary from run to run, so the size
is chosen from FLOPs instead (counted by torch.utils.flop_counter, the same on every
machine): the smallest size whose step does CPU_STEP_FLOPS of work, enough to make
the fixed per-step cost (optimizer, Python) small. One real step at that size checks
that it fits. The same seed therefore gives the same batch size, and the same result.

Afterwards the model, optimizer and RNG states are put back exactly as they were, so
probing leaves no trace on training. A DataLoader is rebuilt at each probed size (its
dataset, sampler, collate_fn and workers kept). The choice comes with its reason and what
the probes measured (a BatchChoice), which the run's plan keeps (runtime/plan.py).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader

from gpunb.errors import GpunbError
from gpunb.runtime.feed.feeds import with_batch_size
from gpunb.runtime.feed.inputs import data_length, first_batch
from gpunb.runtime.state import rewind
from gpunb.runtime.step.precision import Precision
from gpunb.runtime.step.stepper import Stepper

MEMORY_MARGIN = 0.85  # a candidate may use at most this share of GPU memory
START, CPU_CAP, GPU_CAP = 8, 1024, 65536
MIN_STEPS_PER_EPOCH = 8  # never choose a batch so large that an epoch has fewer steps
NEAR_BEST = 0.95  # on a GPU, the smallest size within 5% of the best throughput wins
# On a CPU a step has a fixed cost besides its FLOPs; from about this much work per step
# that cost is a small share of the step, and throughput plateaus (benchmarks/RESULTS.md).
CPU_STEP_FLOPS = 3e8


class BatchChoice(NamedTuple):
    size: int
    reason: str  # one line: how it was chosen
    probes: tuple  # what each probed size did (batch_size, samples_per_s or flops_per_step, ...)


def find_batch_size(model, optimizer, objective, precision, data, device, config) -> BatchChoice:
    """The batch size to train with, why, and what the probes measured."""
    if isinstance(data, DataLoader):
        with_batch_size(data, START)  # refused here, before probing, when it cannot be resized
    n = data_length(data)
    if not n:
        raise GpunbError("batch_size='auto' needs data with a known length.",
                         "pass an int batch size, e.g. `batch_size=64`.")
    cap = _largest_candidate(min(CPU_CAP if device.type == "cpu" else GPU_CAP,
                                 max(1, n // MIN_STEPS_PER_EPOCH)))
    probe = StepProbe(model, optimizer, objective, Precision(precision.name, device), data, device, config)
    saved = rewind.capture(model, optimizer, device)
    try:
        if device.type == "cpu":
            size, reason = _by_flops(probe, cap)
        else:
            size, reason = _by_throughput(probe, cap)
    finally:
        rewind.restore(saved, model, optimizer, device)
    return BatchChoice(size, reason, tuple(probe.records))


def _by_flops(probe: "StepProbe", cap: int) -> tuple[int, str]:
    """The smallest power of two from START whose step does CPU_STEP_FLOPS, checked to fit."""
    first = min(START, cap)
    flops = probe.count_flops(first)
    if flops is None:  # an op the counter cannot see through: fall back to timing
        size, reason = _by_throughput(probe, cap)
        return size, reason + " (FLOPs could not be counted)"
    per_sample = flops / first
    size = first
    while size < cap and size * per_sample < CPU_STEP_FLOPS:
        size *= 2
    size = min(size, cap)
    while not probe.fits(size):
        if size == first:
            raise _nothing_fits(first)
        size //= 2
    why = (f"capped so that an epoch has at least {MIN_STEPS_PER_EPOCH} steps"
           if size * per_sample < CPU_STEP_FLOPS else f"the smallest size with {CPU_STEP_FLOPS:.0e} FLOPs per step")
    return size, f"auto: {per_sample / 1e6:.3g} MFLOP per sample on CPU, {why}"


def _by_throughput(probe: "StepProbe", cap: int) -> tuple[int, str]:
    """Doubling sizes until memory runs short; the smallest near the best throughput."""
    size = min(START, cap)
    while size <= cap:
        record = probe.time(size)
        if record is None or record.get("too_close"):
            break
        size *= 2
    fitting = [r for r in probe.records if not r.get("too_close") and "samples_per_s" in r]
    if not fitting:
        raise _nothing_fits(START)
    best = max(r["samples_per_s"] for r in fitting)
    chosen = min((r for r in fitting if r["samples_per_s"] >= NEAR_BEST * best), key=lambda r: r["batch_size"])
    tried = f"{fitting[0]['batch_size']}-{fitting[-1]['batch_size']}"
    return chosen["batch_size"], f"auto: fastest of {tried} measured ({chosen['samples_per_s']:,.0f} samples/s)"


def _largest_candidate(limit: int) -> int:
    """The largest power of two from START that is <= limit (or limit itself when below START)."""
    size = START
    while size * 2 <= limit:
        size *= 2
    return min(size, limit)


def _nothing_fits(tried: int) -> GpunbError:
    return GpunbError(f"batch_size='auto' found no batch size that fits (tried {tried}).",
                      "try `precision='bf16-mixed'`, `activation_checkpointing=True` or a "
                      "smaller batch such as `batch_size=4`.")


class StepProbe:
    """Runs real training steps at a given batch size and keeps a record of each."""

    def __init__(self, model, optimizer, objective, precision, data, device, config):
        self.data, self.device = data, device
        # fit's own step, one batch per step; an OOM is the answer "does not fit", not split away
        self.stepper = Stepper(model, optimizer, objective, precision, None, config.replace(grad_accum=1),
                               split_on_oom=False)
        self.records: list[dict] = []

    def count_flops(self, size: int) -> int | None:
        """FLOPs of one forward + backward at this size (None when the counter fails)."""
        batch = self._batch(size)
        try:
            flops = count_flops(lambda: self._step(batch))
        except torch.OutOfMemoryError:
            raise _nothing_fits(size) from None
        if flops is None:
            return None
        self.records.append({"batch_size": size, "flops_per_step": flops})
        return flops

    def fits(self, size: int) -> bool:
        try:
            self._step(self._batch(size))
        except torch.OutOfMemoryError:
            return False
        if not any(r["batch_size"] == size for r in self.records):
            self.records.append({"batch_size": size})
        return True

    def time(self, size: int, repeats: int = 3) -> dict | None:
        """Seconds per step at this size and the peak share of GPU memory; None on OOM."""
        try:
            batch = self._batch(size)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self._step(batch)  # warm-up: allocations, kernels
            _synchronize(self.device)
            begin = time.perf_counter()
            for _ in range(repeats):
                self._step(batch)
            _synchronize(self.device)
        except torch.OutOfMemoryError:
            return None
        seconds = (time.perf_counter() - begin) / repeats
        record = {"batch_size": size, "samples_per_s": size / seconds, "peak_fraction": None}
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            record["peak_fraction"] = torch.cuda.max_memory_reserved(self.device) / total
            record["too_close"] = record["peak_fraction"] > MEMORY_MARGIN
        self.records.append(record)
        return record

    def _step(self, batch) -> None:
        self.stepper.accumulate(batch, last_in_step=True)
        self.stepper.update()

    def _batch(self, size: int):
        data = with_batch_size(self.data, size) if isinstance(self.data, DataLoader) else self.data
        return first_batch(data, size, self.device)


def count_flops(work) -> int | None:
    """FLOPs that `work()` runs, counted by torch.utils.flop_counter (the same on every machine);
    None when the counter cannot trace an op. An out-of-memory error is let through."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=_cpu_attention_formulas())
    try:
        with counter:
            work()
    except torch.OutOfMemoryError:
        raise
    except Exception:  # noqa: BLE001 - a counter that cannot trace an op is not the user's error
        return None
    return counter.get_total_flops()


def _cpu_attention_formulas() -> dict:
    """FLOP formulas for scaled_dot_product_attention's CPU kernel, which torch's counter does not
    know (it counts the CUDA kernels'): without them a transformer's attention counts as nothing on
    the CPU. The CUDA kernels' formulas (grouped keys and values included; backward with the
    recomputed scores, as the CPU kernel recomputes them too)."""
    from torch.utils import flop_counter

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
