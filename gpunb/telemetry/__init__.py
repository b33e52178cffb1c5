"""GPU telemetry through NVML (nvidia-ml-py) with a psutil host fallback.

Nothing here touches NVML or CUDA at import time; NVML is initialised on first use.
The names load on first use too, so that a CPU run (which composes TelemetryCallback)
imports neither NVML's bindings nor psutil.
"""

from __future__ import annotations

__all__ = ["EnergyMeter", "GpuSampler", "TelemetryCallback", "snapshot"]

_LAZY = {
    "EnergyMeter": "gpunb.telemetry.sampler",
    "GpuSampler": "gpunb.telemetry.sampler",
    "TelemetryCallback": "gpunb.telemetry.callback",
    "snapshot": "gpunb.telemetry.nvml",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpunb.telemetry' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
