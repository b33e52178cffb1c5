"""NVML reads (nvidia-ml-py) and the host fallback, shaped as plain JSON-ready dicts.

NVML is initialised on first use, once per process, and never at import, so that
importing gpunb on a machine without a driver costs nothing and cannot fail. A GPU
that does not support a field (an NVMLError from its call) simply lacks that key.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import pynvml

from gpunb.telemetry.visible import DeviceId, cuda_to_nvml, label, mig_handles

NO_DRIVER_REASON = "No NVIDIA GPU: the NVIDIA driver (NVML) is not available on this machine."
NO_DEVICE_REASON = "No NVIDIA GPU: the NVIDIA driver is loaded but reports no devices."
_MB = 1024 * 1024

_init_lock = threading.Lock()
_initialised = False
_init_error: str | None = None


def ensure_nvml() -> str | None:
    """Initialise NVML once per process: None when it works, else the reason it does not.

    The outcome is cached either way: a machine without a driver does not grow one
    while a kernel runs, and retrying would cost a failed library load per poll.
    """
    global _initialised, _init_error
    with _init_lock:
        if not _initialised and _init_error is None:
            try:
                pynvml.nvmlInit()
                _initialised = True
            except (pynvml.NVMLError, OSError) as error:
                _init_error = _init_failure_reason(error)
        return _init_error


def known_failure() -> str | None:
    """Why NVML failed to initialise in this process, when it has been tried and failed; None
    otherwise (not tried yet, or working). Never initialises it."""
    return _init_error


def _init_failure_reason(error: Exception) -> str:
    if isinstance(error, (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded, OSError)):
        return NO_DRIVER_REASON
    if isinstance(error, pynvml.NVMLError_NoPermission):
        return "No NVIDIA GPU access: NVML refused this user (insufficient permissions)."
    return f"No NVIDIA GPU: NVML failed to initialise ({error})."


def _text(value: Any) -> str:
    # nvidia-ml-py returned bytes before version 11.5; accept both.
    return value.decode() if isinstance(value, bytes) else str(value)


# Each reader returns some keys of a GPU's dict; one raising NVMLError is skipped.
def _utilization(handle) -> dict:
    rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
    return {"utilization_gpu": float(rates.gpu), "utilization_memory": float(rates.memory)}


def _memory(handle) -> dict:
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return {"memory_used_mb": info.used / _MB, "memory_total_mb": info.total / _MB}


def _power(handle) -> dict:
    return {"power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0}  # mW


def _power_limit(handle) -> dict:
    return {"power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0}  # mW


def _temperature(handle) -> dict:
    return {"temperature_c": float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))}


def _clock_sm(handle) -> dict:
    return {"clock_sm_mhz": float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))}


def _clock_mem(handle) -> dict:
    return {"clock_mem_mhz": float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM))}


def _pcie(handle) -> dict:
    # KB/s over NVML's short sampling window: the call waits out that window, so not in the sampler.
    return {"pcie_tx_kbps": float(pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)),
            "pcie_rx_kbps": float(pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES))}


def _energy(handle) -> dict:
    return {"energy_j": pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0}  # mJ since driver load


def _processes(handle) -> dict:
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    # usedGpuMemory is None where the driver cannot attribute memory (e.g. some containers).
    return {"processes": [{"pid": int(p.pid),
                           "used_memory_mb": None if p.usedGpuMemory is None else p.usedGpuMemory / _MB}
                          for p in procs]}


# The sampler reads only these (cheap, every half second); snapshot() reads all.
SAMPLE_READERS: tuple[Callable[[Any], dict], ...] = (
    _utilization, _memory, _power, _temperature, _clock_sm, _energy)
SNAPSHOT_READERS: tuple[Callable[[Any], dict], ...] = (
    _utilization, _memory, _power, _power_limit, _temperature, _clock_sm, _clock_mem, _pcie,
    _energy, _processes)
# stop()'s end point: the energy counter alone, one NVML call.
ENERGY_READERS: tuple[Callable[[Any], dict], ...] = (_energy,)
# A MIG instance has its own memory and processes; the rest belongs to its GPU.
MIG_READERS: tuple[Callable[[Any], dict], ...] = (_memory, _processes)


def read_fields(handle, readers=SAMPLE_READERS) -> dict:
    """The fields this GPU supports among `readers`; unsupported ones are left out."""
    out: dict = {}
    for reader in readers:
        try:
            out.update(reader(handle))
        except pynvml.NVMLError:
            pass
    return out


def device_identity(index: DeviceId, handle) -> dict:
    """index ("0:1" for MIG instance 1 of GPU 0), name and uuid (each left out when NVML cannot tell)."""
    out: dict = {"index": label(index)}
    for key, getter in (("name", pynvml.nvmlDeviceGetName), ("uuid", pynvml.nvmlDeviceGetUUID)):
        try:
            out[key] = _text(getter(handle))
        except pynvml.NVMLError:
            pass
    return out


def host_stats() -> dict:
    """CPU and RAM of this machine; cpu_percent is since the previous call (never blocks)."""
    memory = psutil.virtual_memory()
    return {"cpu_percent": float(psutil.cpu_percent(interval=None)),
            "cpu_count": int(psutil.cpu_count() or 1),
            "ram_used_mb": (memory.total - memory.available) / _MB,
            "ram_total_mb": memory.total / _MB,
            "ram_percent": float(memory.percent)}


def snapshot() -> dict:
    """Every GPU NVML sees plus host stats, or host stats and the reason there is no GPU."""
    out: dict = {"time": time.time(), "nvidia": False}
    reason = ensure_nvml()
    count = 0
    if reason is None:
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as error:
            reason = f"No NVIDIA GPU: NVML could not count devices ({error})."
    if reason is None and count == 0:
        reason = NO_DEVICE_REASON
    if reason is not None:
        out.update(reason=reason, host=host_stats(), gpus=[])
        return out
    out["nvidia"] = True
    try:
        out["driver"] = _text(pynvml.nvmlSystemGetDriverVersion())
    except pynvml.NVMLError:
        out["driver"] = "unknown"
    out["host"] = host_stats()
    out["gpus"] = [device for index in range(count) for device in _read_gpu(index)]
    return out


def _read_gpu(index: int) -> list[dict]:
    """The GPU's fields, then each of its MIG instances as a device of its own (its memory,
    its processes) after it."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError:
        return [{"index": index}]  # e.g. a GPU that fell off the bus: still listed, no fields
    gpu = device_identity(index, handle) | read_fields(handle, SNAPSHOT_READERS)
    migs = [device_identity((index, m), mig) | {"parent_index": index} | read_fields(mig, MIG_READERS)
            for m, mig in mig_handles(handle)]
    return [gpu, *migs]


def nvml_index_for_cuda_device(cuda_index: int, uuid: str | None = None) -> DeviceId:
    """The NVML device of CUDA device `cuda_index`: an index, or (GPU, MIG) for a MIG instance.

    CUDA numbers only the visible devices (CUDA_VISIBLE_DEVICES: indices, UUIDs or MIG
    ids) and, by default, fastest first, while NVML numbers all GPUs in PCI order; the
    UUID is the one sure link. Call after ensure_nvml() succeeded.
    """
    try:
        return cuda_to_nvml(cuda_index, uuid)
    except pynvml.NVMLError:
        return cuda_index
