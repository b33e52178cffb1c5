"""TelemetryCallback: GPU samples for the dashboard and the energy a run used.

A plain callback (see gpunb/runtime/events.py). On a CPU or MPS run, or where NVML
is missing, every hook returns at once: no thread, no NVML call, and NVML's bindings
are not even imported (the Trainer composes this callback into every run).
"""

from __future__ import annotations

MIN_INTERVAL_S = 0.5  # gpunb.telemetry.sampler's floor, repeated so that a CPU run need not import it


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
        self.sampler = None  # the GpuSampler of the fit under way

    def on_fit_start(self, state) -> None:
        self._stop_sampler()  # a callback reused across fits never leaks a thread
        device = state.device
        if getattr(device, "type", None) != "cuda":
            return
        try:
            from gpunb.telemetry.nvml import known_failure
            from gpunb.telemetry.sampler import GpuSampler
        except ImportError:  # nvidia-ml-py missing: a run without telemetry
            return
        if known_failure() is not None:  # NVML failed earlier in this process: it will again
            return
        cuda_index = self.device_index if self.device_index is not None else _cuda_index(device)
        extras = state.extras

        def publish(sample: dict) -> None:
            extras["gpu"] = sample  # one dict assignment: atomic under the GIL

        # start() returns at once: NVML is initialised and the device found on the sampler's
        # thread, while the first step runs. A sampler that fails logs why and reports no energy.
        self.sampler = GpuSampler.of_cuda_device(cuda_index, _cuda_uuid(cuda_index), interval=self.interval,
                                                 on_sample=publish).start()

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
