"""The sweep as the run registry knows it: each trial's tag, and a stop of the whole sweep.

Every trial's fit carries `trial_tag(...)` in its config (TrainConfig.sweep), so its registry
row says which sweep it belongs to, in the kernel or as a job alike; the sidebar groups the
rows by it. A stop of the sweep (the sidebar's, or `gpunb.stop(<sweep>)` from any kernel) is a
row in the registry that `SweepStop` reads from the sweep's loop: it asks no more trials and
stops the running ones at their next step, their checkpoints kept. Whoever asks for the stop
stops the trials it sees running too (gpunb.jobs.lookup.stop_sweep), so a sweep whose kernel
died still stops; this covers a trial that starts while the stop is asked.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

READ_EVERY_S = 1.0  # a running trial's steps look at the registry at most this often


def trial_tag(name: str, number: int, settings) -> dict:
    """What a trial's run records of its sweep: the sweep's name, the trial's number, and what the
    sweep's card needs to judge the trials (how many, their objective, its direction)."""
    return {"name": name, "trial": number, "trials": settings.trials, "monitor": settings.monitor,
            "direction": settings.resolved_direction()}


class SweepStop:
    """Whether the sweep `name` is asked to stop, read from the run registry; once asked, it stays
    asked. Also a callback of each trial's fit in the kernel, whose steps look at most once a second."""

    def __init__(self, name: str, registry=None):
        self.name = name
        self.registry = registry  # None: no registry (the sweep is not tracked), never asked
        self.reason: str | None = None
        self._read_at = float("-inf")  # when a step last looked
        self._warned = False

    def clear(self) -> None:
        """The sweep starts (or its cell runs again): an earlier stop of it no longer stands."""
        self._guarded(lambda: self.registry.clear_sweep_stop(self.name))

    def asked(self) -> bool:
        """Read now (the sweep's loop asks before each new trial: one read, no write)."""
        if self.reason is None and self.registry is not None:
            self.reason = self._guarded(lambda: self.registry.sweep_stops().get(self.name))
        return self.reason is not None

    def stops(self, followers) -> bool:
        """Asked: every followed trial's job not yet asked to stop is asked now; True."""
        if not self.asked():
            return False
        for follower in followers:
            if not follower.stop_asked:
                follower.stop(self.reason)
        return True

    def on_step_end(self, state) -> None:
        if self.reason is None and time.monotonic() - self._read_at < READ_EVERY_S:
            return
        self._read_at = time.monotonic()
        if self.asked() and state.stop_reason is None:
            state.request_stop(self.reason)

    def _guarded(self, read):
        """A locked or damaged registry neither stops nor breaks the sweep; the first problem is logged."""
        if self.registry is None:
            return None
        try:
            return read()
        except Exception as error:  # noqa: BLE001 - RegistryLocked, RegistryDamaged, OSError alike
            if not self._warned:
                self._warned = True
                log.warning("gpunb: the sweep %r cannot read its stop from the run registry (%s); "
                            "the notebook's stop button still stops it.", self.name, error)
            return None
