"""batch_size="auto": try growing batches, keep the fastest that fits.

Each candidate runs real forward + backward + optimizer steps; afterwards the model,
optimizer and RNG states are put back exactly as they were, so probing leaves no
trace on training. On a GPU a candidate must stay under MEMORY_MARGIN of the device's
memory; on a CPU the search stops when throughput stops growing (a plateau).
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, default_collate

from gpunb.errors import GpunbError
from gpunb.runtime import snapshot
from gpunb.runtime.inputs import data_length, move_batch
from gpunb.runtime.precision import Precision

MEMORY_MARGIN = 0.85  # a candidate may use at most this share of GPU memory
START, CPU_CAP, GPU_CAP = 8, 1024, 65536
MIN_STEPS_PER_EPOCH = 8  # never choose a batch so large that an epoch has fewer steps
PLATEAU_GAIN = 1.10  # on CPU, stop doubling once throughput grows by less than 10%


def find_batch_size(model, optimizer, objective, precision, data, device, config) -> int:
    """The batch size to train with; records the probes in config.extras['batch_probe']."""
    if isinstance(data, DataLoader):
        raise GpunbError("batch_size='auto' cannot change the batch size of a DataLoader.",
                         "pass the Dataset (or tensors) as train_data so gpunb builds the loader, "
                         "or give the DataLoader's batch size explicitly.")
    n = data_length(data)
    if not n:
        raise GpunbError("batch_size='auto' needs data with a known length.",
                         "pass an int batch size, e.g. `batch_size=64`.")
    cap = min(CPU_CAP if device.type == "cpu" else GPU_CAP, max(1, n // MIN_STEPS_PER_EPOCH))
    saved = snapshot.capture(model, optimizer, device)
    probe_precision = Precision(precision.name, device)  # a throwaway scaler
    probes = []
    try:
        size = min(START, cap)
        while size <= cap:
            try:
                seconds, peak = _time_steps(model, optimizer, objective, probe_precision,
                                            _sample_batch(data, size, device), device)
            except torch.OutOfMemoryError:
                break
            probes.append({"batch_size": size, "samples_per_s": size / seconds, "peak_fraction": peak})
            if peak is not None and peak > MEMORY_MARGIN:
                probes[-1]["too_close"] = True
                break
            if device.type == "cpu" and len(probes) > 1 and (
                    probes[-1]["samples_per_s"] < PLATEAU_GAIN * probes[-2]["samples_per_s"]):
                break
            size *= 2
    finally:
        snapshot.restore(saved, model, optimizer, device)
    fitting = [p for p in probes if not p.get("too_close")]
    if not fitting:
        raise GpunbError(f"batch_size='auto' found no batch size that fits (tried {START}).",
                         "try `precision='bf16-mixed'`, `activation_checkpointing=True` or a "
                         "smaller batch such as `batch_size=4`.")
    config.extras["batch_probe"] = probes
    return max(fitting, key=lambda p: p["samples_per_s"])["batch_size"]


def _time_steps(model, optimizer, objective, precision, batch, device, repeats=3):
    """Seconds per training step at this batch size, and the peak share of GPU memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(repeats + 1):  # the first step warms up (allocations, kernels)
        if i == 1:
            _synchronize(device)
            begin = time.perf_counter()
        with precision.autocast():
            loss = objective.loss(model, batch)
        precision.backward(loss)
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    _synchronize(device)
    seconds = (time.perf_counter() - begin) / repeats
    peak = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_reserved(device) / torch.cuda.get_device_properties(device).total_memory
    return seconds, peak


def _sample_batch(data, size, device):
    if isinstance(data, tuple):
        return tuple(t[:size].to(device) for t in data)
    return move_batch(default_collate([data[i] for i in range(size)]), device)


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
