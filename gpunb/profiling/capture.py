"""Capture: torch.profiler over `steps` steps after `warmup` unrecorded ones, kept as a
chrome trace (a temporary file, or one in the `save` directory).

One more step than asked for is recorded, first: it carries the profiler's own start-up
(tracing begins inside it) and is left out of the analysis (see `summarise`).

The Recorder is driven by whoever knows where steps end: the callable runner calls
`step()` after each call, ProfilerCallback after each optimizer step.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from gpunb.profiling import hardware
from gpunb.profiling.trace import OWN_SYNC


class Recorder:
    """One profiling session: `start()`, `step()` after every step, `stop()` (idempotent)."""

    def __init__(self, device, *, steps: int, warmup: int, save: str | os.PathLike | None = None):
        self.device = torch.device(device)
        self.steps, self.warmup, self.save = steps, warmup, save
        self.calls = 0  # steps ended so far, warmup included
        self.caps: hardware.DeviceCaps | None = None  # read at start(), after the Trainer's set-up (TF32)
        self.trace_path: str | None = None  # set once the trace is written
        self.nvml_util: float | None = None  # mean NVML utilisation over the recorded steps
        self.nvml_read = False  # NVML was sampled (a None nvml_util then means: capture too short)
        self.batch_size: int | None = None  # samples per step, when the Trainer says
        self._profiler = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._sampler = None
        self._recording_since: float | None = None
        self._recording_until: float | None = None  # the last recorded step's end
        self._sentinel = None

    @property
    def total_steps(self) -> int:
        return session_steps(self.steps, self.warmup)

    @property
    def done(self) -> bool:
        return self.calls >= self.total_steps

    def start(self) -> None:
        cuda = self.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings():  # warmup=0 is a choice here, not a mistake to warn about
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            schedule = torch.profiler.schedule(wait=0, warmup=self.warmup, active=1 + self.steps, repeat=1)
        self._profiler = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._write_trace,
            record_shapes=True, profile_memory=True, with_stack=False)
        self.caps = hardware.device_caps(self.device)
        self._sampler = _start_nvml_sampler(self.device) if cuda else None
        # Freeing a tensor made before recording starts makes torch warn once per process on
        # stderr; free this one where that warning is silenced (see _quiet_native_stderr).
        self._sentinel = torch.empty(1)
        with _quiet_native_stderr():
            self._profiler.start()
        if self.warmup == 0:
            self._begin_recording()

    def step(self) -> bool:
        """Mark the end of a step; True once the profiled steps are all recorded."""
        if self._profiler is None or self.done:
            return self.done
        self.calls += 1
        if self.done and self.device.type == "cuda":
            with torch.profiler.record_function(OWN_SYNC):  # marked: not the user's sync
                torch.cuda.synchronize(self.device)  # the last step's kernels belong in the window
        if self.done:  # before the trace is written: the GPU idles while it is
            self._recording_until = time.time()
        # Only the steps that start or end recording print; the others stay cheap.
        starts_or_ends = self.calls == self.warmup or self.done
        with _quiet_native_stderr() if starts_or_ends else contextlib.nullcontext():
            self._profiler.step()  # writes the trace after the last profiled step
        if self.calls == self.warmup:
            self._begin_recording()
        if self.done:
            self.stop()
        return self.done

    def stop(self) -> None:
        """End profiling (a partial window is still written)."""
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            with _quiet_native_stderr():
                profiler.stop()
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()
            self.nvml_read = True
            until = self._recording_until or time.time()  # a partial window ends now
            self.nvml_util = _mean_utilisation(sampler.samples(), self._recording_since, until)
        self._sentinel = None

    def cleanup(self) -> None:
        """Remove a temporary trace (a saved one stays)."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _begin_recording(self) -> None:
        self._recording_since = time.time()
        with _quiet_native_stderr():
            self._sentinel = None

    def _write_trace(self, profiler) -> None:
        if self.save is not None:
            folder = Path(self.save)
            folder.mkdir(parents=True, exist_ok=True)
            stem = f"gpunb-profile-{time.strftime('%Y%m%d-%H%M%S')}"
            path, counter = folder / f"{stem}.pt.trace.json", 1
            while path.exists():
                counter += 1
                path = folder / f"{stem}-{counter}.pt.trace.json"
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="gpunb-profile-")
            path = Path(self._tmp.name) / "trace.json"
        profiler.export_chrome_trace(str(path))
        self.trace_path = str(path.resolve())


def session_steps(steps: int, warmup: int) -> int:
    """Steps a session takes: the warmup, the extra start-up step, the profiled steps."""
    return warmup + 1 + steps


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence file descriptor 2 around the profiler's own start/stop calls.

    Kineto writes banners ("USDT: ... profiler_start") straight to fd 2 with no setting
    to turn them off; in a notebook they would land in the cell output. Only calls into
    the profiler run inside this block, never user code, so nothing of the user's is lost.
    """
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (some embedded interpreters)
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _start_nvml_sampler(device: torch.device):
    """NVML utilisation through gpunb.telemetry, or None where it or NVML is missing."""
    try:
        from gpunb.telemetry.nvml import ensure_nvml, nvml_index_for_cuda_device
        from gpunb.telemetry.sampler import GpuSampler
    except ImportError:
        return None
    if ensure_nvml() is not None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    sampler = GpuSampler(nvml_index_for_cuda_device(index)).start()
    return None if sampler.error else sampler


NVML_PERIOD_S = 1.0  # NVML averages utilisation over the last 1/6 to 1 s, by product


def _mean_utilisation(samples: list[dict], since: float | None, until: float = math.inf) -> float | None:
    """Mean of the samples that saw only recorded steps: taken a full NVML period after
    recording began (an earlier one also averages the idle time before it), and before it
    ended (a later one sees the GPU idle while the trace is written: seconds, for a large
    model). None when the capture was too short for any."""
    values = [s["utilization_gpu"] for s in samples
              if "utilization_gpu" in s and since is not None and since + NVML_PERIOD_S <= s["time"] <= until]
    return sum(values) / len(values) if values else None
