"""Whether compile="auto" compiles a run's step, and how: from eager timings and the steps left.

A step whose GPU is busy for less than half of it is launch-bound: the GPU waits on
Python. Such a step is captured whole, forward, backward and optimizer, as one CUDA graph
(step_graph.py: no compile, so it pays at once), or where that is not possible the model's
forward and backward are (`torch.compile(mode="reduce-overhead")`). Otherwise the default
mode fuses elementwise ops, when the time the remaining steps would save, at a modest
assumed speed-up, is well above the compile's expected cost (what the same model cost to
compile earlier in this process, else an estimate from its size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpunb.runtime.step.step_timing import COMPILED_WARMUP, TIMED_STEPS, WARMUP_STEPS

LAUNCH_BOUND = 0.5  # GPU busy time over step time below this: the GPU waits on the host
ASSUMED_SPEEDUP = {True: 1.3, "reduce-overhead": 1.8, "step-graph": 2.0}  # what deciding counts on (measured after)
CAPTURE_STEPS = 3  # a step graph's cost, in eager steps: its warm-up passes and the capture
BESIDE_STALL_SHARE = 0.25  # a compile from a warm cache over a cold one (measured 0.21 on a CPU, 0.3 on an H100)
PAYBACK_MARGIN = 1.5  # the saving must exceed the expected compile time this many times
SHORTEST_RUN = WARMUP_STEPS + 2 * TIMED_STEPS + COMPILED_WARMUP + 1  # time, compile, check, then gain

_measured_compile_s: dict = {}  # model signature -> seconds its last compile took in this process


@dataclass
class Decision:
    mode: object  # None (stay eager), True (default mode), "reduce-overhead" or "step-graph"
    reason: str


def decide(step_s: float, gpu_share: float | None, remaining_steps: int, expected_compile_s: float,
           cuda_graphs: bool = True, graph_blocker: str | None = None) -> Decision:
    """Whether to compile or capture, and how, from eager timings and the steps left.
    `gpu_share`: the GPU's busy time over the step time (None: not measured, taken as GPU-bound);
    `cuda_graphs=False`: the default mode even when launch-bound; `graph_blocker`: why the whole step
    cannot be one CUDA graph (None: it can)."""
    launch_bound = gpu_share is not None and gpu_share < LAUNCH_BOUND
    why = (f"launch-bound: the GPU was busy {100 * gpu_share:.0f}% of each step, waiting on the host the rest"
           if launch_bound else "GPU-bound" + (f": the GPU was busy {100 * gpu_share:.0f}% of each step"
                                               if gpu_share is not None else ""))
    if launch_bound and cuda_graphs and not graph_blocker:
        mode, expected_compile_s = "step-graph", CAPTURE_STEPS * step_s  # no compile: a capture
    elif launch_bound and cuda_graphs:
        mode, why = "reduce-overhead", f"{why}; the whole step is not one graph: {graph_blocker}"
    else:
        mode = True
    saving = remaining_steps * step_s * (1 - 1 / ASSUMED_SPEEDUP[mode])
    if saving < PAYBACK_MARGIN * expected_compile_s:
        return Decision(None, f"eager: the remaining {remaining_steps} steps (~{remaining_steps * step_s:.0f} s "
                              f"at {1000 * step_s:.1f} ms) would save ~{saving:.0f} s at a "
                              f"{ASSUMED_SPEEDUP[mode]}x speed-up, too little for a ~{expected_compile_s:.0f} s "
                              f"compile ({why})")
    return Decision(mode, why)


def auto_blocker(device, world_size: int, total_steps: int | None, strategy: str = "ddp") -> str | None:
    """Why compile="auto" keeps this run eager from the start; None: it times the steps."""
    if device.type != "cuda":
        return f"eager: compile='auto' compiles on CUDA only (this run is on {device.type})"
    if world_size > 1 and strategy == "fsdp":
        return "eager: FSDP runs compile only with compile=True"
    if total_steps is not None and total_steps < SHORTEST_RUN:
        return f"eager: {total_steps} steps are too few to time and then compile"
    return None


def expected_compile_s(model: torch.nn.Module, signature, beside: bool = False) -> float:
    """What the same model cost to compile earlier in this process (the caches only make it
    cheaper), else 10 s plus 0.25 s per leaf module (GPT-2 124M: ~30 s on an H100). `beside`:
    compiled beside eager steps, where the cost is the stall at the switch, the training
    process's own compile from the cache the worker warmed (BESIDE_STALL_SHARE of a cold one)."""
    if signature in _measured_compile_s:
        return _measured_compile_s[signature]
    leaves = sum(1 for m in model.modules() if next(m.children(), None) is None)
    return (10.0 + 0.25 * leaves) * (BESIDE_STALL_SHARE if beside else 1.0)


def signature_of(model: torch.nn.Module, batch_size) -> tuple:
    """The same model class, parameter shapes and batch size: what torch's caches key on."""
    shapes = tuple((name, tuple(p.shape), p.dtype) for name, p in model.named_parameters())
    return type(model).__qualname__, hash(shapes), batch_size


def record_compile_s(signature, seconds: float) -> None:
    """What a compile of this model cost: the next one in this process expects as much."""
    _measured_compile_s[signature] = seconds


def partial_last_batch(feed) -> bool:
    """Whether an epoch ends with a smaller batch (unknown lengths count as no)."""
    order, loader = getattr(feed, "order", None), getattr(feed, "loader", None)
    if order is not None:
        return not feed.drop_last and len(order) % feed.batch_size != 0
    try:
        return bool(not loader.drop_last and loader.batch_size and len(loader.dataset) % loader.batch_size)
    except TypeError:
        return False
