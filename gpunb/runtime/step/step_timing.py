"""Timing steps one by one for compile="auto": each step's wall time and, on CUDA, the GPU's busy time.

After a warm-up, each timed step runs between two syncs (the only syncs compile="auto"
adds, once per run). The last PROBED_STEPS eager ones are queued behind a short GPU sleep
(`Probed`, an engine for one step), so that the host has issued all of the step before the
GPU starts it: the time the GPU then takes is its busy time, free of any wait on the host.
"""

from __future__ import annotations

import statistics
import time

import torch

WARMUP_STEPS = 5  # eager steps before timing: allocator growth, cuDNN autotuning, lazy inits
TIMED_STEPS = 8  # steps timed one by one, eager and then compiled
PROBED_STEPS = 3  # of the eager ones on CUDA, the last few: timed behind a GPU sleep for the GPU's busy time
COMPILED_WARMUP = 3  # compiled steps before timing them: the compile, CUDA-graph recording


class StepTimings:
    """Times steps one by one after a warm-up: their wall time and, on CUDA, the GPU's busy time."""

    def __init__(self, device):
        self.device = device

    def restart(self, step: int, warmup: int, compiling: bool = False) -> None:
        """Time again from `step`; `compiling`: the next step compiles, and its time is kept (and
        the GPU's busy time is not probed: it is the eager step's that decides)."""
        self.start, self.warmup, self.samples, self.busy = step, warmup, [], []
        self.first_step_s, self.compiling = None, compiling
        self.probes = PROBED_STEPS if self.device.type == "cuda" and not compiling and _can_sleep() else 0
        self.probe = None  # the event after the sleep the step in progress is queued behind
        self.probing = False  # the next step is to be probed: it runs on a Probed engine (compiling.py)
        self.mark = self._synced_now() if compiling else None

    def record(self, step: int) -> bool:
        """Called at each step's end; True once TIMED_STEPS steps are timed."""
        if self.compiling:
            self.first_step_s, self.compiling = self._synced_now() - self.mark, False
        done = step - self.start
        if done < self.warmup:
            return False
        if done == self.warmup:
            self.mark = self._synced_now()
            return False
        if self.probe is not None:  # the GPU ran this step from the sleep's end, all of it queued
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            self.busy.append(self.probe.elapsed_time(end) / 1000)
            self.probe = None
        else:
            now = self._synced_now()
            self.samples.append(now - self.mark)
            self.mark = now
        if len(self.samples) + len(self.busy) >= TIMED_STEPS:
            return True
        self.probing = len(self.samples) >= TIMED_STEPS - self.probes
        return False

    def start_probe(self) -> None:
        """At a probed step's start (after any sync of the last step's end, such as a log's): the
        GPU sleeps while the host issues the step."""
        self.probe = _sleep_then_mark(self.device, 2 * statistics.median(self.samples))

    def result(self) -> tuple[float, float | None]:
        """(median step seconds, median GPU busy time over it; None where not probed)."""
        step_s = statistics.median(self.samples)
        busy = min(1.0, statistics.median(self.busy) / step_s) if self.busy and step_s else None
        return step_s, busy

    def _synced_now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class Probed:
    """The engine of one probed step: `engine`'s, queued behind a GPU sleep that starts with the
    step (after any sync of the last step's end, such as a log's). Otherwise it is `engine`."""

    whole_steps = True  # its whole_step starts the step: the stepper calls it first
    compiles = False

    def __init__(self, engine, timings: StepTimings):
        self.engine, self.timings, self.started = engine, timings, False
        self.model, self.eval_model, self.graphed, self.eager = engine.model, engine.eval_model, engine.graphed, None

    def whole_step(self, stepper, batch):
        if not self.started:  # once a step, whatever its micro-batches
            self.started = True
            self.timings.start_probe()
        return self.engine.whole_step(stepper, batch)

    def loss(self, piece):
        return self.engine.loss(piece)

    def close(self) -> None:
        pass  # the engine it probed goes on


_sleep_cycles_per_s: dict = {}  # device index -> the rate of torch.cuda._sleep, measured once


def _can_sleep() -> bool:
    return hasattr(torch.cuda, "_sleep")  # private, but in every release since 1.x


def _sleep_then_mark(device, seconds: float):
    """Queue a GPU sleep of about `seconds` (at most 0.5 s), then an event: work issued after
    it waits on the GPU, so its time from the event is the GPU's busy time alone."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sleep_cycles_per_s:
        cycles, begin, end = 20_000_000, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _sleep_cycles_per_s[index] = cycles / (begin.elapsed_time(end) / 1000)
    torch.cuda._sleep(int(_sleep_cycles_per_s[index] * min(seconds, 0.5)))
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark
