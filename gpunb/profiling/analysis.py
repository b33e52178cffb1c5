"""From a Trace to the numbers of a ProfileResult: phases, device time, top ops and
kernels, memory, and the signals the advice rules read.

How the step time is split into phases: at each instant of the profiled steps, when
some device work (kernel, copy, memset) is running, the instant belongs to the phase
that launched that work (forward, backward, ...); when the device is idle, or on a CPU
run where the host is the device, it belongs to the phase the host loop is in (data
wait, forward, ...), and to "other" outside every phase. Each instant counts once, so
the phases add up to the step time, and on a GPU a phase's share is the time it holds
the critical resource, not its (asynchronous) host time. A host-to-device copy belongs
to the h2d phase wherever it was launched from (the prefetcher copies the next batch
while the loop is in another phase), and only where no kernel runs beside it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from gpunb.profiling.report import DeviceTime, KernelRow, Memory, OpRow, Phase, ProfileResult
from gpunb.profiling.trace import OWN_SYNC, OpIndex, Trace, cover, gaps, label_at, overlap

PHASES = ("data_wait", "h2d", "forward", "backward", "optimizer")
# Ops that run a matrix product themselves; aten::linear and aten::matmul count only when
# nothing of this set runs inside them (under autocast their inputs are still fp32).
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::linear",
           "aten::matmul", "aten::_addmm_activation", "aten::addmv", "aten::mv"}
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
TINY_OP_US = 20.0  # a host op this short is mostly dispatch overhead
TINY_KERNEL_US = 10.0  # a kernel this short is about as long as its launch
TOP = 10
# Kernels torch.compile would fuse into its neighbours: pointwise math, copies and dtype
# casts (autocast's), and the memory-bound normalisations and softmaxes eager runs alone.
FUSIBLE = ("elementwise", "copy", "cast", "layer_norm", "layernorm", "softmax", "dropout", "gelu")
# Traces of a compiled model: Inductor's kernels and Dynamo's named regions.
COMPILED_MARKS = ("triton_", "Torch-Compiled Region", "CompiledFxGraph", "CompiledFunction")


def analyse(trace: Trace, *, kind: str, device: str, device_total: int | None = None,
            batch_size: int | None = None) -> ProfileResult:
    """The numbers of one profile (`advice` is left empty: see advice.py). `batch_size`:
    samples per step, when the caller knows it (the Trainer does)."""
    t0, t1 = trace.window
    wall = max(t1 - t0, 1e-9)
    steps = max(len(trace.steps), 1)
    ops = [op for op in trace.ops if t0 <= op.start < t1]
    phase_ranges = cover((max(p.start, t0), min(p.end, t1), p.name.split("/", 1)[1]) for p in trace.phases)
    device_work = _device_work(trace, phase_ranges, t0, t1)

    result = ProfileResult(kind=kind, device=device, steps=steps, step_ms=wall / steps / 1000)
    phase_us = _phase_time(device_work, phase_ranges, t0, t1)
    if trace.phases:
        result.phases = [Phase(name, us / steps / 1000, 100 * us / wall) for name, us in phase_us.items()]
    if device_work:
        result.device_time = _device_time(device_work, phase_ranges, t0, t1)
    result.top_ops = _top_ops(ops, wall)
    result.top_kernels = _top_kernels(device_work, wall)
    index = OpIndex(ops)
    result.memory = _memory(trace, index, device_total)
    result.signals = {
        "steps": steps, "wall_us": wall,
        "phase_share": {name: us / wall for name, us in phase_us.items()} if trace.phases else {},
        "device": bool(device_work),
        "idle_host_share": result.device_time.idle_host_pct / 100 if result.device_time else 0.0,
        "busy_share": result.device_time.busy_pct / 100 if result.device_time else 0.0,
        "idle_data_share": result.device_time.idle_data_pct / 100 if result.device_time else 0.0,
        "batch_size": batch_size,
        **_fp32_matmuls(ops, device_work, wall),
        **_syncs(trace, index, phase_ranges, t0, t1),
        **_optimizer(trace, ops, t0, t1),
        **_tiny(ops, device_work, phase_us, wall, steps),
        **_fusion(trace, device_work, wall, steps),
    }
    return result


def _device_work(trace: Trace, phase_ranges, t0, t1) -> list:
    """(start, end, phase that launched it, event) for each kernel/copy/memset in the window."""
    launches = {e.args["correlation"]: e for e in trace.runtime if "correlation" in e.args}
    starts = [p[0] for p in phase_ranges]
    out = []
    for work in trace.device:
        start, end = max(work.start, t0), min(work.end, t1)
        if end <= start:
            continue
        launch = launches.get(work.args.get("correlation"))
        phase = "h2d" if _is_h2d(work) else label_at(
            phase_ranges, starts, launch.start if launch else work.start, "other")
        out.append((start, end, phase, work))
    return out


def _is_h2d(work) -> bool:
    return work.cat == "gpu_memcpy" and "HtoD" in work.name


def _phase_time(device_work, phase_ranges, t0, t1) -> dict:
    """Microseconds of the window in each phase (see the module docstring); sums to the window."""
    # A copy overlapped by compute costs the step nothing: copies count only where no kernel runs.
    compute = cover((s, e, phase) for s, e, phase, work in device_work if not _is_h2d(work))
    copies = cover((s, e, phase) for s, e, phase, work in device_work if _is_h2d(work))
    copies = overlap(gaps(compute, t0, t1), copies)
    busy = sorted(compute + copies)
    host = overlap(gaps(busy, t0, t1), phase_ranges)
    totals = {name: 0.0 for name in PHASES}
    for start, end, name in busy + host:
        totals[name] = totals.get(name, 0.0) + end - start
    totals["other"] = max(0.0, (t1 - t0) - sum(v for k, v in totals.items() if k != "other"))
    return totals


def _device_time(device_work, phase_ranges, t0, t1) -> DeviceTime:
    wall = t1 - t0
    kernels = cover((s, e, None) for s, e, _, work in device_work if work.cat != "gpu_memcpy")
    idle = gaps(kernels, t0, t1)
    copies = [(s, e, "h2d") for s, e, _, work in device_work if _is_h2d(work)]
    feeding = cover([r for r in phase_ranges if r[2] in ("data_wait", "h2d")] + copies)
    idle_data = sum(e - s for s, e, _ in overlap(idle, feeding))
    busy = sum(e - s for s, e, _ in kernels)
    return DeviceTime(busy_pct=100 * busy / wall, idle_host_pct=100 * (wall - busy - idle_data) / wall,
                      idle_data_pct=100 * idle_data / wall)


SHAPES_WIDTH = 60  # characters of an op's input shapes in the top-ops table


def _shapes(op) -> str:
    """`[64, 10], [10]`; a list of tensors (a fused optimizer's every parameter) as its count."""
    dims = op.args.get("Input Dims") or []
    text = ", ".join(f"{len(d)} tensors" if isinstance(d[0], list) else str(d) for d in dims if d)
    return text if len(text) <= SHAPES_WIDTH else text[:SHAPES_WIDTH - 1] + "…"


def _top_ops(ops, wall) -> list[OpRow]:
    by_name: dict = defaultdict(lambda: [0, 0.0, defaultdict(float)])
    for op in ops:
        row = by_name[op.name]
        row[0] += 1
        row[1] += op.self_us
        row[2][_shapes(op)] += op.self_us
    rows = [OpRow(name, calls, self_us / 1000, 100 * self_us / wall, self_us / calls,
                  max(shapes, key=shapes.get)) for name, (calls, self_us, shapes) in by_name.items()]
    return sorted(rows, key=lambda r: -r.self_ms)[:TOP]


def _top_kernels(device_work, wall) -> list[KernelRow]:
    by_name: dict = defaultdict(lambda: [0, 0.0])
    for start, end, _, work in device_work:
        by_name[work.name][0] += 1
        by_name[work.name][1] += end - start
    rows = [KernelRow(name, calls, us / 1000, 100 * us / wall, us / calls) for name, (calls, us) in by_name.items()]
    return sorted(rows, key=lambda r: -r.total_ms)[:TOP]


def _memory(trace: Trace, index: OpIndex, device_total) -> Memory | None:
    cuda = [m for m in trace.memory if m["cuda"]]
    events = cuda or trace.memory
    if not events:
        return None
    groups: dict = defaultdict(int)
    for m in sorted((m for m in events if m["bytes"] > 0), key=lambda m: -m["bytes"])[:200]:
        op = index.at(m["tid"], m["ts"])
        groups[(op.name if op else "(outside any op)", m["bytes"])] += 1
    largest = sorted(((op, size, n) for (op, size), n in groups.items()), key=lambda g: (-g[1], g[0]))[:5]
    return Memory(device="cuda" if cuda else "cpu", peak_allocated=max(m["allocated"] for m in events),
                  peak_reserved=max(m["reserved"] for m in events) if cuda else None,
                  total=device_total if cuda else None, largest=largest)


def _fp32_matmuls(ops, device_work, wall) -> dict:
    """fp32 matrix products: calls, their share of the time (kernel time on a GPU, host self
    time otherwise) and the heaviest shapes."""
    inner: set = set()
    for op in ops:
        if op.name in MATMULS:
            parent = op.parent
            while parent is not None:
                inner.add(id(parent))  # a matmul runs inside: judge that one, not this
                parent = parent.parent
    fp32 = [op for op in ops if op.name in MATMULS and id(op) not in inner
            and "float" in (op.args.get("Input type") or [])[:3]]
    ids = {op.args.get("External id") for op in fp32}
    kernel_us = sum(e - s for s, e, _, work in device_work
                    if work.cat == "kernel" and work.args.get("External id") in ids)
    time_us = kernel_us if device_work else sum(op.self_us for op in fp32)
    heaviest = max(fp32, key=lambda op: op.self_us, default=None)
    return {"fp32_matmul_calls": len(fp32), "fp32_matmul_share": time_us / wall,
            "fp32_matmul_example": f"{heaviest.name}({_shapes(heaviest)})" if heaviest else ""}


def _syncs(trace: Trace, index: OpIndex, phase_ranges, t0, t1) -> dict:
    """Host-device synchronisations inside the steps, by the user-level op that caused them."""
    starts = [p[0] for p in phase_ranges]
    own = [(a.start, a.end) for a in trace.annotations if a.name == OWN_SYNC]
    where: dict = defaultdict(int)
    for call in trace.runtime:
        if call.name in SYNC_CALLS and t0 <= call.start < t1 and not any(a <= call.start < b for a, b in own):
            op = index.at(call.tid, call.start)
            while op is not None and op.parent is not None:
                op = op.parent
            where[(op.name if op else call.name, label_at(phase_ranges, starts, call.start, "other"))] += 1
    return {"syncs": sum(where.values()), "sync_sites": sorted(where.items(), key=lambda kv: -kv[1])}


def _optimizer(trace: Trace, ops, t0, t1) -> dict:
    """How the optimizer step runs: ops per step and whether they are fused/foreach ones."""
    ranges = [a for a in trace.annotations if a.name.startswith("Optimizer.step#") and t0 <= a.start < t1]
    if not ranges:
        ranges = [p for p in trace.phases if p.name.endswith("/optimizer") and t0 <= p.start < t1]
    inside = [op for r in ranges for op in ops
              if op.tid == r.tid and r.start <= op.start < r.end and (op.parent is None or op.parent.start < r.start)]
    fused = any("_foreach_" in op.name or "_fused_" in op.name for op in inside)
    return {"optimizer_steps": len(ranges), "optimizer_ops_per_step": len(inside) / max(len(ranges), 1),
            "optimizer_fused": fused, "optimizer_share": sum(r.dur for r in ranges) / (t1 - t0 or 1)}


def _tiny(ops, device_work, phase_us, wall, steps) -> dict:
    """How much of the step goes to ops and kernels too small to amortise their launch.

    On the host, a step made of many tiny ops spends most of its time between and around
    them (Python, dispatch, allocation), so the share counted is the time outside data
    loading that is not inside a heavy op. Whether an op is heavy goes by the median
    duration of its name, so that a tiny op the OS happened to preempt still counts as tiny.
    """
    top = [op for op in ops if op.parent is None]
    durations: dict = defaultdict(list)
    for op in top:
        durations[op.name].append(op.dur)
    heavy_names = {name for name, d in durations.items() if statistics.median(d) >= TINY_OP_US}
    heavy = sum(op.dur for op in top if op.name in heavy_names)
    feeding = phase_us.get("data_wait", 0.0) + phase_us.get("h2d", 0.0)
    kernels = [e - s for s, e, _, work in device_work if work.cat == "kernel"]
    return {"top_ops_per_step": len(top) / steps,
            "median_top_op_us": statistics.median(op.dur for op in top) if top else 0.0,
            "light_op_share": max(0.0, wall - heavy - feeding) / wall,
            "kernels_per_step": len(kernels) / steps,
            "tiny_kernel_fraction": sum(d < TINY_KERNEL_US for d in kernels) / len(kernels) if kernels else 0.0,
            "median_kernel_us": statistics.median(kernels) if kernels else 0.0}


def _fusion(trace: Trace, device_work, wall, steps) -> dict:
    """What torch.compile and CUDA graphs could take away: the share of the time in kernels
    that fusion removes, whether the model already runs compiled or as a CUDA graph, and
    how long the kernels are."""
    kernels = [(e - s, work.name) for s, e, _, work in device_work if work.cat == "kernel"]
    fusible = [(d, name) for d, name in kernels if any(k in name.lower() for k in FUSIBLE)]
    names = [w.name for w in trace.device] + [e.name for e in trace.annotations] + [op.name for op in trace.ops]
    return {"fusible_share": sum(d for d, _ in fusible) / wall,
            "fusible_kernels_per_step": len(fusible) / steps,
            "compiled": any(mark in name for name in names for mark in COMPILED_MARKS),
            "cuda_graphs": any(call.name.startswith("cudaGraphLaunch") for call in trace.runtime),
            "mean_kernel_us": sum(d for d, _ in kernels) / len(kernels) if kernels else 0.0}
