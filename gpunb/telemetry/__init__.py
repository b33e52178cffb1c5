"""GPU telemetry through NVML (nvidia-ml-py) with a psutil host fallback.

Nothing here touches NVML or CUDA at import time; NVML is initialised on first use.
"""

from gpunb.telemetry.callback import TelemetryCallback
from gpunb.telemetry.nvml import snapshot
from gpunb.telemetry.sampler import EnergyMeter, GpuSampler

__all__ = ["EnergyMeter", "GpuSampler", "TelemetryCallback", "snapshot"]
