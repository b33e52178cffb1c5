"""RunRecorder: the callback that keeps a run's row in the registry up to date.

A plain callback (see gpunb/runtime/events.py). It writes at most once a second
(always on the first log), answers stop requests from the sidebar at every log
interval (a single read between writes), and never lets a
registry problem (disk full, locked or corrupt file) reach the training loop: it
warns once and carries on without recording.
"""

from __future__ import annotations

import logging
import time

from gpunb.runs.registry import Registry, json_safe

log = logging.getLogger(__name__)

WRITE_EVERY_S = 1.0  # the registry's promise: at most one write per second per run
POINTS_PER_WRITE = 25  # log rows kept per write (evenly thinned): curves survive short runs
HEARTBEAT_S = 30.0  # without logs, still touch the row this often (others judge liveness by it)
RETRY_AFTER_S = 30.0  # after a failed write, leave the registry alone this long
_now = time.monotonic  # the clock for throttling (tests replace it)


class RunRecorder:
    """Records the run (rank 0 only) in `registry` (default: `Registry()`)."""

    def __init__(self, registry: Registry | None = None):
        self.registry = registry
        self._warned = False
        self._reset()

    def _reset(self) -> None:
        self.run_id: str | None = None
        self._rows: list = []  # (step, metrics) logged since the last write
        self._latest: dict = {}  # every metric's newest value
        self._last_write = 0.0  # monotonic time of the last write
        self._paused_until = 0.0  # after a failure, no registry calls before this
        self._first_log: tuple[float, int] | None = None  # (monotonic, step), for the ETA

    # ------------------------------------------------------------------ events
    def on_fit_start(self, state) -> None:
        self._reset()
        if state.rank != 0 or not getattr(state.config, "track", True):
            return
        config = state.config.to_dict() if hasattr(state.config, "to_dict") else state.config
        self.run_id = self._safely(lambda: self._registry().start_run(
            state.run_name, config=json_safe(config), device=str(state.device),
            total_steps=state.total_steps))
        if self.run_id is not None:
            state.extras["run_id"] = self.run_id
            self._last_write = _now()

    def on_train_batch_end(self, state) -> None:
        # Only a clock read per step; a long log interval still gets a heartbeat and stop checks.
        if self.run_id is not None and _now() - self._last_write >= HEARTBEAT_S:
            self._write(state, force=True)

    def on_log(self, state, metrics: dict) -> None:
        if self.run_id is None:
            return
        first = self._first_log is None
        if first:
            self._first_log = (_now(), state.step)
        self._collect(state.step, metrics)
        self._write(state, force=first)  # the first log is always written

    def on_validation_end(self, state, metrics: dict) -> None:
        if self.run_id is not None:
            self._collect(state.step, metrics)
            self._write(state)

    on_epoch_end = on_validation_end

    def on_fit_end(self, state) -> None:
        if self.run_id is None:
            return
        result = state.result
        if getattr(result, "interrupted", False) and state.stop_reason == "interrupted":
            status = "interrupted"
        elif state.stop_reason:
            status = "stopped"
        else:
            status = "completed"
        self._finish(state, status, energy_j=getattr(result, "energy_j", None))

    def on_exception(self, state, error: BaseException) -> None:
        if self.run_id is None:
            return
        if isinstance(error, KeyboardInterrupt):
            self._finish(state, "interrupted")
            return
        lines = str(error).strip().splitlines()
        summary = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        self._finish(state, "failed", error=summary[:500])

    # ------------------------------------------------------------------ internals
    def _registry(self) -> Registry:
        if self.registry is None:
            self.registry = Registry()
        return self.registry

    def _collect(self, step: int, metrics: dict) -> None:
        metrics = json_safe(metrics)
        self._latest.update(metrics)
        if self._rows and self._rows[-1][0] == step:  # validation at the step just logged
            self._rows[-1][1].update(metrics)
        else:
            self._rows.append((step, dict(metrics)))

    def _flush_rows(self, registry: Registry, limit: int) -> None:
        rows, self._rows = self._rows, []
        if len(rows) > limit:  # evenly spread, always keeping the newest
            stride = len(rows) / limit
            rows = [rows[int(i * stride)] for i in range(limit - 1)] + [rows[-1]]
        for step, metrics in rows:
            registry.add_metrics(self.run_id, step, metrics)

    def _write(self, state, force: bool = False) -> None:
        now = _now()
        if not force and now - self._last_write < WRITE_EVERY_S:
            # No write yet, but a stop request is still answered at this log interval (one read).
            if self._safely(lambda: self._registry().stop_requested(self.run_id)):
                state.request_stop("stopped from the sidebar")
            return
        self._last_write = now

        def write() -> bool:
            registry = self._registry()
            registry.update(self.run_id, step=state.step, epoch=state.epoch, progress=state.progress,
                            eta_s=self._eta(state, now), latest=self._latest)
            self._flush_rows(registry, POINTS_PER_WRITE)
            return registry.stop_requested(self.run_id)

        if self._safely(write):
            state.request_stop("stopped from the sidebar")

    def _finish(self, state, status: str, **fields) -> None:
        def finish() -> None:
            registry = self._registry()
            self._flush_rows(registry, 10 * POINTS_PER_WRITE)
            registry.finish(self.run_id, status, step=state.step, epoch=state.epoch,
                            progress=state.progress, latest=self._latest, **fields)

        self._paused_until = 0.0  # the final status is worth one more try
        self._safely(finish)
        self.run_id = None

    def _eta(self, state, now: float) -> float | None:
        if not state.total_steps or self._first_log is None:
            return None
        started, first_step = self._first_log
        done = state.step - first_step  # measured from the first log: excludes set-up and compile time
        if done <= 0:
            return None
        return max(0.0, (state.total_steps - state.step) * (now - started) / done)

    def _safely(self, action):
        if _now() < self._paused_until:
            return None
        try:
            return action()
        except Exception as error:  # any registry failure: training matters more than the record
            self._paused_until = _now() + RETRY_AFTER_S
            if not self._warned:
                self._warned = True
                log.warning("gpunb: could not write to the run registry (%s): %s. Training goes on; "
                            "this run may be missing from gpunb.runs() and the sidebar.",
                            self.registry.path if self.registry else "?", error)
            return None
