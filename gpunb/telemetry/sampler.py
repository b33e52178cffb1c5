"""A background thread that samples one GPU through NVML, and the energy it adds up.

Neither end of a run waits on it: `start()` only starts the thread (the thread initialises
NVML when the process has not yet, finds the device, and takes the first sample, the energy
baseline), and `stop()` wakes the thread with an Event
and reads the energy counter once for the end point. The thread uses the process's
NVML session (nvml.ensure_nvml, initialised once and kept), so starting and stopping
costs no nvmlInit/nvmlShutdown. NVML calls go through ctypes and release the GIL; the
Python work per sample is a dict of a handful of floats, at most twice a second.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import pynvml

from gpunb.telemetry.nvml import (ENERGY_READERS, SAMPLE_READERS, device_identity, ensure_nvml,
                                  nvml_index_for_cuda_device, read_fields)
from gpunb.telemetry.visible import DeviceId, handle_of, label

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.5  # at most 2 Hz: enough for a dashboard, invisible to training (callback.py repeats it)
STARTING_WAIT_S = 0.02  # what stop() waits for a thread that has not reached the device yet


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
    def counting(self) -> bool:
        """Whether the energy counter answered the latest sample: an end read can extend it."""
        return self._counter_now is not None

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
        self._stop = threading.Event()  # set by stop(): wakes the thread from its wait at once
        self._lock = threading.Lock()  # the thread's samples and stop()'s end point, one at a time
        self._ended = False  # after stop()'s end point the thread records nothing more
        self._handle = None  # set by the thread once it has the device; stop() reads energy through it
        self._thread: threading.Thread | None = None
        self._cuda_device = None  # (CUDA index, UUID): NVML's number for it is found on the thread

    @classmethod
    def of_cuda_device(cls, cuda_index: int, uuid: str | None = None, **options) -> GpuSampler:
        """The sampler of CUDA device `cuda_index`. NVML numbers devices its own way
        (nvml.nvml_index_for_cuda_device); the thread looks the number up after initialising
        NVML, so that neither lengthens `start()` (nvmlInit alone can take a second)."""
        sampler = cls(cuda_index, **options)
        sampler._cuda_device = (cuda_index, uuid)
        return sampler

    def start(self) -> GpuSampler:
        """Start the thread; returns at once (the thread takes the first sample)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"gpunb-gpu{label(self.index)}-sampler",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        """Wake and end the thread, then read the energy counter once: the end point of `energy_j`.

        The thread is woken from its wait, so the join lasts at most the NVML reads of a
        sample under way; `timeout` bounds it should a read hang (the thread is a daemon).
        A thread still starting (in nvmlInit, which nothing interrupts) is given STARTING_WAIT_S:
        a short run's end does not wait for it, and it ends by itself, having sampled nothing.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout if self._handle is not None else min(timeout, STARTING_WAIT_S))
        with self._lock:
            if self._ended:
                return
            self._ended = True
            if self._handle is not None and self._energy.counting:
                self._energy.add(read_fields(self._handle, ENERGY_READERS) | {"monotonic": time.monotonic()})

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
        reason = ensure_nvml()
        if reason is not None:
            self._fail(reason)
            return
        try:
            if self._cuda_device is not None:
                self.index = nvml_index_for_cuda_device(*self._cuda_device)
            handle = handle_of(self.index)
            identity = device_identity(self.index, handle)
            self._handle = handle
            while not self._stop.is_set():
                self._record(identity, handle)
                self._stop.wait(self.interval)
        except pynvml.NVMLError as error:
            self._fail(f"NVML failed on GPU {label(self.index)}: {error}")

    def _fail(self, reason: str) -> None:
        self.error = reason
        log.warning("gpunb: GPU sampling is off: %s", reason)

    def _record(self, identity: dict, handle) -> None:
        sample = {"time": time.time(), "monotonic": time.monotonic(), **identity,
                  **read_fields(handle, SAMPLE_READERS)}
        with self._lock:
            if self._ended:  # stop() has taken the end point: a later sample would move it
                return
            self._samples.append(sample)
            self._energy.add(sample)
        if self._on_sample is not None:
            try:
                self._on_sample(sample)
            except Exception:  # a bad observer must not end sampling
                log.exception("gpunb: GPU sample observer failed")
