"""TelemetryCallback: GPU samples for the dashboard and the energy a run used.

A plain callback (see gpunb/runtime/events.py). On a CPU or MPS run, or where NVML
is missing, every hook returns at once: no thread, no NVML call.
"""

from __future__ import annotations

import logging

from gpunb.telemetry.nvml import ensure_nvml, nvml_index_for_cuda_device
from gpunb.telemetry.sampler import MIN_INTERVAL_S, GpuSampler

log = logging.getLogger(__name__)


class TelemetryCallback:
    """Samples the run's CUDA device on a background thread while `fit` runs.

    Keeps `state.extras["gpu"]` set to the newest sample (utilisation, memory, power,
    temperature, ...) and, at the end, sets `state.result.energy_j` (Joules; left None
    when the GPU reports neither an energy counter nor power).
    `device_index` overrides the CUDA device to watch (default: the run's device).
    """

    def __init__(self, device_index: int | None = None, interval: float = MIN_INTERVAL_S):
        self.device_index = device_index
        self.interval = interval
        self.sampler: GpuSampler | None = None

    def on_fit_start(self, state) -> None:
        self._stop_sampler()  # a callback reused across fits never leaks a thread
        device = state.device
        if getattr(device, "type", None) != "cuda" or ensure_nvml() is not None:
            return
        cuda_index = self.device_index if self.device_index is not None else _cuda_index(device)
        extras = state.extras

        def publish(sample: dict) -> None:
            extras["gpu"] = sample  # one dict assignment: atomic under the GIL

        sampler = GpuSampler(nvml_index_for_cuda_device(cuda_index, _cuda_uuid(cuda_index)),
                             self.interval, on_sample=publish).start()
        if sampler.error:
            log.warning("gpunb: GPU telemetry is off for this run: %s", sampler.error)
            return
        self.sampler = sampler

    def on_fit_end(self, state) -> None:
        energy = self._stop_sampler()
        if energy is None:
            return
        state.extras["energy_j"] = energy
        if state.result is not None:
            state.result.energy_j = energy

    def on_exception(self, state, error) -> None:
        self._stop_sampler()

    def _stop_sampler(self) -> float | None:
        sampler, self.sampler = self.sampler, None
        if sampler is None:
            return None
        sampler.stop()
        return sampler.energy_j


def _cuda_index(device) -> int:
    if device.index is not None:
        return device.index
    import torch  # only reached on a CUDA run, where torch is loaded already

    return torch.cuda.current_device()


def _cuda_uuid(cuda_index: int) -> str | None:
    """The device's UUID as NVML spells it ("GPU-..."), or None when torch cannot tell."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
