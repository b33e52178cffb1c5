"""Two fake NVIDIA GPUs for the processes of a job started by tests/test_jobs.py.

A job's tasks are processes of their own, out of reach of pytest's monkeypatch: the test puts
this folder first on PYTHONPATH, and Python imports this module at every start-up. NVML's
functions that gpunb calls answer for GPU i: utilisation 90 + i %, memory (i + 1) GiB of 80,
power 300 + 10 i W, 60 + i C, and an energy counter that gains 50 J at each read.
"""

import threading
from types import SimpleNamespace

import pynvml

_MB = 1024 * 1024
_lock = threading.Lock()
_energy_mj = {0: 1_000_000, 1: 2_000_000}


def _not_supported(*args):
    raise pynvml.NVMLError_NotSupported()


def _energy(handle):
    with _lock:
        _energy_mj[handle.i] += 50_000
        return _energy_mj[handle.i]


_FAKE = {
    "nvmlInit": lambda: None,
    "nvmlDeviceGetCount": lambda: 2,
    "nvmlDeviceGetHandleByIndex": lambda i: SimpleNamespace(i=i),
    "nvmlDeviceGetIndex": lambda h: h.i,
    "nvmlDeviceGetName": lambda h: "Fake GPU",
    "nvmlDeviceGetUUID": lambda h: f"GPU-0000000{h.i}-fake",
    "nvmlDeviceGetMigMode": _not_supported,
    "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=90 + h.i, memory=40),
    "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=(h.i + 1) * 1024 * _MB, total=81920 * _MB, free=0),
    "nvmlDeviceGetPowerUsage": lambda h: 300_000 + 10_000 * h.i,  # mW
    "nvmlDeviceGetTemperature": lambda h, sensor: 60 + h.i,
    "nvmlDeviceGetClockInfo": lambda h, kind: 1980,
    "nvmlDeviceGetTotalEnergyConsumption": _energy,
}
for _name, _function in _FAKE.items():
    setattr(pynvml, _name, _function)
