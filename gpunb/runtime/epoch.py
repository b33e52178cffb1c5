"""An epoch's batches grouped into optimizer steps, and the run's clock."""

from __future__ import annotations

import contextlib
import time

from gpunb.runtime.step.stepper import phase_range


class EpochSteps:
    """Iterates (batch, ends_an_optimizer_step) over an epoch's batches.

    `remaining` (batches left in the epoch) says where the epoch ends; when the data has
    no length, it looks one batch ahead instead (holding one more batch in memory). A
    class rather than a generator so that no suspended frame keeps the batch alive
    while the optimizer step runs.
    """

    def __init__(self, batches, grad_accum, timer, marks, remaining):
        self.batches, self.grad_accum, self.timer, self.marks = batches, grad_accum, timer, marks
        self.remaining, self.in_group = remaining, 0
        self.ended = False  # the data ran out before the announced count (or it had none)
        self.ahead = self._fetch() if remaining is None else None

    @property
    def exhausted(self) -> bool:
        """Every batch of the epoch has been handed out (a stop on the last step counts)."""
        if self.ended:
            return True
        return self.remaining == 0 if self.remaining is not None else self.ahead is None

    def __iter__(self):
        return self

    def __next__(self):
        if self.remaining is not None:
            batch = self._fetch()
            if batch is None:
                self.ended = True
                raise StopIteration
            self.remaining -= 1
            if self.grad_accum == 1:  # every batch ends a step: no group to count
                return batch, True
            ends = self._count() or self.remaining == 0
        else:
            batch, self.ahead = self.ahead, None
            if batch is None:
                raise StopIteration
            self.ahead = self._fetch()
            ends = self._count() or self.ahead is None
        if ends:
            self.in_group = 0
        return batch, ends

    def _count(self) -> bool:
        self.in_group += 1
        return self.in_group == self.grad_accum

    def _fetch(self):
        begin = time.perf_counter()
        batch = self._fetch_marked() if self.marks.profile else next(self.batches, None)
        self.timer.data_wait += time.perf_counter() - begin
        return batch

    def _fetch_marked(self):
        with phase_range("data_wait"):
            return next(self.batches, None)


class Timer:
    """Wall time of the run, split into waiting for data, validation, and the rest."""

    def __init__(self):
        self.start = self.last_lap = time.perf_counter()
        self.data_wait = self.validation = 0.0

    @contextlib.contextmanager
    def validating(self):
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.validation += time.perf_counter() - begin
            self.last_lap += time.perf_counter() - begin  # keep validation out of step times

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last_lap = now - self.last_lap, now
        return seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
