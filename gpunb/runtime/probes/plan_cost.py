"""What the memory plan costs in step time, measured before the first step where that is cheap.

The run's first batch is timed without the plan's measures, with them, and without them again
(A/B/A: a machine that slows down or speeds up midway counts against neither), REPEATS steps
each after one untimed; the model, the optimizer and the RNGs are put back afterwards
(state/rewind.py), and prepare then puts the measures in place for training. The plan says the
measured cost beside the expected one, or why it was not measured: where the step without the
measures may not fit in the device's memory (the budget is the device's own), where the plan
makes the weights bf16 (that cannot be undone), with several processes (their steps go
together), with checkpointing set by hand (the model's wrapper does it, later), or where a
step takes over MAX_STEP_S (too dear to repeat).
"""

from __future__ import annotations

import statistics

from gpunb.runtime.memory.measures import BF16_WEIGHTS
from gpunb.runtime.memory.plan import SAFETY
from gpunb.runtime.memory.planning import apply_plan, device_room
from gpunb.runtime.probes.batch_size import StepProbe
from gpunb.runtime.state import rewind
from gpunb.runtime.step.precision import Precision

REPEATS = 3  # timed steps each way, after one untimed
MAX_STEP_S = 2.0  # a slower step is not repeated a dozen times only to measure the plan


def measure_plan_cost(memory, summary, model, optimizer, objective, precision, data, device, config,
                      world_size: int) -> None:
    """Sets `memory.measured` (the plan's step time over the plain step's, less 1) and
    `memory.measured_note`; or only the note, saying why it was not measured."""
    why = _why_not(memory, summary, device, world_size)
    if why:
        memory.measured_note = f"not measured: {why}"
        return
    size = summary.batch_size
    saved = rewind.capture(model, optimizer, device)
    try:
        plain = StepProbe(model, optimizer, objective, Precision(precision.name, device), data, device, config)
        first = _seconds(plain, size)
        if first is None or first > MAX_STEP_S:
            memory.measured_note = "not measured: " + (f"a step takes over {MAX_STEP_S:g} s" if first else
                                                       "out of memory without the measures")
            return
        planned = _seconds_planned(memory, model, optimizer, objective, precision, data, device, config, size)
        again = _seconds(plain, size)
    finally:
        rewind.restore(saved, model, optimizer, device)
    if planned is None or again is None:
        memory.measured_note = "not measured: out of memory while timing"
        return
    memory.measured = planned / statistics.mean((first, again)) - 1
    memory.measured_note = f"{REPEATS} steps with and 2 x {REPEATS} without, before the first step"


def _seconds_planned(memory, model, optimizer, objective, precision, data, device, config, size) -> float | None:
    planned, undo = apply_plan(memory, model, optimizer, objective)
    try:
        probe = StepProbe(model, planned, objective, Precision(precision.name, device), data, device, config)
        probe.stepper.splits = memory.micro_batches
        return _seconds(probe, size)
    finally:
        undo()


def _seconds(probe: StepProbe, size: int) -> float | None:
    record = probe.time(size, repeats=REPEATS)
    return None if record is None else size / record["samples_per_s"]


def _why_not(memory, summary, device, world_size: int) -> str:
    if not memory.changes:
        return "nothing to measure"
    if world_size > 1:
        return "several processes"
    if memory.has(BF16_WEIGHTS):
        return "bf16 weights cannot be undone after timing"
    if "checkpointing" in memory.kept:
        return "activation checkpointing was set by hand"
    room = device_room(summary, device)
    if room is None or memory.before > SAFETY * room:
        return "without its measures the step may not fit in the device's memory"
    return ""
