"""Read a torch.profiler chrome trace into the few kinds of event the analysis needs.

The chrome-trace JSON that `torch.profiler` exports is the interchange format (Perfetto,
chrome://tracing and Holistic Trace Analysis read it too). Working from it rather than
from profiler internals keeps the analysis a pure function of one dict, which tests can
also write by hand (that is how the GPU paths are tested on machines without a GPU).

Times are microseconds, as in the trace.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

PHASE_PREFIX = "gpunb/"  # record_function ranges the training loop opens when profiled
STEP_PREFIX = "ProfilerStep#"  # ranges torch.profiler opens around each profiled step
OWN_SYNC = "gpunb.profiler_sync"  # the profiler's own wait for the last step's kernels
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")


@dataclass(eq=False)
class Event:
    """One complete ("X") event. `self_us` and `parent` are filled in for cpu ops."""

    name: str
    cat: str
    start: float
    end: float
    tid: object
    args: dict
    self_us: float = 0.0
    parent: Event | None = None

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass
class Trace:
    steps: list[Event] = field(default_factory=list)  # ProfilerStep#N ranges, in order
    phases: list[Event] = field(default_factory=list)  # gpunb/* ranges, by start
    annotations: list[Event] = field(default_factory=list)  # other user ranges (Optimizer.step#...)
    ops: list[Event] = field(default_factory=list)  # cpu ops, by start
    device: list[Event] = field(default_factory=list)  # kernels, memcpys, memsets, by start
    runtime: list[Event] = field(default_factory=list)  # cudaLaunchKernel, cudaStreamSynchronize, ...
    memory: list[dict] = field(default_factory=list)  # [memory] instants: ts, tid, bytes, allocated, reserved, cuda

    @property
    def window(self) -> tuple[float, float]:
        """The profiled steps, first start to last end (all events when no step ranges)."""
        spans = self.steps or self.ops or self.phases or self.device
        if not spans:
            return (0.0, 0.0)
        return (min(e.start for e in spans), max(e.end for e in spans))


def load(source) -> Trace:
    """A Trace from a chrome-trace dict, or the path of its JSON file."""
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8") as handle:
            source = json.load(handle)
    trace = Trace()
    for raw in source.get("traceEvents", ()):
        cat = str(raw.get("cat", "")).lower()
        if raw.get("ph") == "i" and raw.get("name") == "[memory]":
            trace.memory.append(_memory(raw))
        elif raw.get("ph") == "X" and "dur" in raw:
            _file(trace, cat, raw)
    for events in (trace.steps, trace.phases, trace.annotations, trace.ops, trace.device, trace.runtime):
        events.sort(key=lambda e: (e.start, -e.end))
    trace.memory.sort(key=lambda m: m["ts"])
    _nest(trace.ops)
    return trace


def _file(trace: Trace, cat: str, raw: dict) -> None:
    """Put one complete event in the list of its kind (other kinds are dropped)."""
    start = float(raw["ts"])
    event = Event(str(raw.get("name", "")), cat, start, start + float(raw["dur"]), raw.get("tid"),
                  raw.get("args") or {})
    if cat == "cpu_op":
        trace.ops.append(event)
    elif cat == "user_annotation":
        if event.name.startswith(STEP_PREFIX):
            trace.steps.append(event)
        elif event.name.startswith(PHASE_PREFIX):
            trace.phases.append(event)
        else:
            trace.annotations.append(event)
    elif cat in DEVICE_CATS:
        trace.device.append(event)
    elif cat in RUNTIME_CATS:
        trace.runtime.append(event)


def _memory(raw: dict) -> dict:
    args = raw.get("args") or {}
    return {"ts": float(raw.get("ts", 0.0)), "tid": raw.get("tid"), "bytes": int(args.get("Bytes", 0)),
            "allocated": int(args.get("Total Allocated", 0)), "reserved": int(args.get("Total Reserved", 0)),
            "cuda": args.get("Device Type") == 1}


def _nest(ops: list[Event]) -> None:
    """Set each op's parent (the innermost op around it on its thread) and self time."""
    stacks: dict = {}
    for op in ops:  # sorted by start, outer before inner
        stack = stacks.setdefault(op.tid, [])
        while stack and stack[-1].end <= op.start:
            stack.pop()
        op.self_us += op.dur
        if stack:
            op.parent = stack[-1]
            op.parent.self_us -= op.dur
        stack.append(op)


# --- intervals: lists of (start, end) or (start, end, label), sorted and disjoint


def cover(intervals) -> list[tuple]:
    """Disjoint labelled cover of (start, end, label) intervals: where two overlap, the one
    that started first keeps the overlap."""
    out: list[tuple] = []
    cursor = float("-inf")
    for start, end, label in sorted(intervals, key=lambda i: (i[0], -i[1])):
        start = max(start, cursor)
        if end > start:
            out.append((start, end, label))
            cursor = end
    return out


def gaps(covered, lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of [lo, hi] outside the sorted, disjoint intervals `covered`."""
    out, cursor = [], lo
    for start, end, *_ in covered:
        if start > cursor:
            out.append((cursor, min(start, hi)))
        cursor = max(cursor, end)
        if cursor >= hi:
            break
    if cursor < hi:
        out.append((cursor, hi))
    return [(a, b) for a, b in out if b > a]


def overlap(free, labelled) -> list[tuple]:
    """Pieces of the disjoint intervals `free` that fall in the disjoint (start, end, label)
    intervals `labelled`, as (start, end, label); both sorted (a two-pointer merge)."""
    out, j = [], 0
    for a, b in free:
        while j < len(labelled) and labelled[j][1] <= a:
            j += 1
        k = j
        while k < len(labelled) and labelled[k][0] < b:
            start, end = max(a, labelled[k][0]), min(b, labelled[k][1])
            if end > start:
                out.append((start, end, labelled[k][2]))
            k += 1
    return out


def label_at(labelled, starts: list[float], t: float, default=None):
    """Label of the sorted, disjoint (start, end, label) interval holding t (`starts` = their starts)."""
    i = bisect.bisect_right(starts, t) - 1
    if i >= 0 and labelled[i][0] <= t < labelled[i][1]:
        return labelled[i][2]
    return default


class OpIndex:
    """Finds the innermost cpu op running on a thread at a given time."""

    def __init__(self, ops: list[Event]):
        self._by_tid: dict = {}
        for op in ops:  # sorted by start
            self._by_tid.setdefault(op.tid, []).append(op)
        self._starts = {tid: [op.start for op in group] for tid, group in self._by_tid.items()}

    def at(self, tid, t: float) -> Event | None:
        group = self._by_tid.get(tid)
        if not group:
            return None
        i = bisect.bisect_right(self._starts[tid], t) - 1
        op = group[i] if i >= 0 else None
        # The last op to start before t is the innermost one holding t, or a finished
        # sibling of it: climb the parents until one still runs at t.
        while op is not None and op.end <= t:
            op = op.parent
        return op
