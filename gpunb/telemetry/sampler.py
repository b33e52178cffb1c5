"""A background thread that samples one GPU through NVML, and the energy it adds up.

The thread owns its NVML session (its own nvmlInit/nvmlShutdown pair, which NVML
reference-counts) and its device handle, so nothing about it leaks into the
training thread. NVML calls go through ctypes and release the GIL; the Python work
per sample is a dict of a handful of floats, at most twice a second.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import pynvml

from gpunb.telemetry.nvml import SAMPLE_READERS, device_identity, read_fields
from gpunb.telemetry.visible import DeviceId, handle_of, label

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.5  # at most 2 Hz: enough for a dashboard, invisible to training


class EnergyMeter:
    """Energy since the first sample: the GPU's total-energy counter when it has one
    at both ends, otherwise power integrated over time (trapezoid rule)."""

    def __init__(self) -> None:
        self.samples = 0
        self._counter_at_start: float | None = None
        self._counter_now: float | None = None
        self._integrated_j = 0.0
        self._power_points = 0
        self._last_power: tuple[float, float] | None = None  # (monotonic s, W)

    def add(self, sample: dict) -> None:
        counter = sample.get("energy_j")
        if self.samples == 0:
            self._counter_at_start = counter
        self._counter_now = counter  # None when this read failed: the counter cannot be trusted at the end
        self.samples += 1
        power = sample.get("power_w")
        if power is not None:
            now = sample["monotonic"]
            if self._last_power is not None:
                then, last = self._last_power
                self._integrated_j += 0.5 * (last + power) * (now - then)
            self._last_power = (now, power)
            self._power_points += 1

    @property
    def joules(self) -> float | None:
        start, end = self._counter_at_start, self._counter_now
        # A counter that went backwards was reset (driver reload): use power instead.
        if start is not None and end is not None and end >= start and self.samples >= 2:
            return end - start
        if self._power_points >= 2:
            return self._integrated_j
        return None


class GpuSampler:
    """Samples NVML device `index` (a GPU, or (GPU, MIG) for a MIG instance) every `interval` s (>= 0.5) on a daemon thread.

    `samples()` is a ring buffer of the most recent `history` samples; `energy` covers
    the whole time between `start()` and `stop()` however long the run. `on_sample` is
    called on the sampler thread with each new sample (keep it trivial).
    """

    def __init__(self, index: DeviceId, interval: float = MIN_INTERVAL_S, history: int = 600,
                 on_sample: Callable[[dict], None] | None = None):
        self.index = index
        self.interval = max(float(interval), MIN_INTERVAL_S)
        self.error: str | None = None  # why sampling failed, when it did
        self._on_sample = on_sample
        self._samples: collections.deque = collections.deque(maxlen=history)
        self._energy = EnergyMeter()
        self._stop = threading.Event()
        self._first_sample_taken = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, wait_s: float = 2.0) -> GpuSampler:
        """Start the thread and wait (up to `wait_s`) for the first sample, the energy baseline."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"gpunb-gpu{label(self.index)}-sampler",
                                            daemon=True)
            self._thread.start()
            self._first_sample_taken.wait(wait_s)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Take a last sample and end the thread (joined, so its NVML session is closed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def latest(self) -> dict | None:
        return self._samples[-1] if self._samples else None

    def samples(self) -> list[dict]:
        return list(self._samples)

    @property
    def energy_j(self) -> float | None:
        return self._energy.joules

    def _run(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            self.error = f"NVML failed to initialise: {error}"
            self._first_sample_taken.set()
            return
        try:
            handle = handle_of(self.index)
            identity = device_identity(self.index, handle)
            while True:
                self._record(identity, handle)
                if self._stop.wait(self.interval):
                    break
            self._record(identity, handle)  # the end point, so energy covers the whole run
        except pynvml.NVMLError as error:
            self.error = f"NVML failed on GPU {label(self.index)}: {error}"
        finally:
            self._first_sample_taken.set()
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass

    def _record(self, identity: dict, handle) -> None:
        sample = {"time": time.time(), "monotonic": time.monotonic(), **identity,
                  **read_fields(handle, SAMPLE_READERS)}
        self._samples.append(sample)
        self._energy.add(sample)
        self._first_sample_taken.set()
        if self._on_sample is not None:
            try:
                self._on_sample(sample)
            except Exception:  # a bad observer must not end sampling
                log.exception("gpunb: GPU sample observer failed")
