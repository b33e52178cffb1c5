"""A snapshot as plain text, for `gpunb status` and terminals: one line per GPU."""

from __future__ import annotations

from gpunb.telemetry.nvml import snapshot


def status_text(snap: dict | None = None) -> str:
    """`snap` (default: a fresh `snapshot()`) as a few lines; fields a GPU lacks are skipped."""
    snap = snapshot() if snap is None else snap
    if snap["nvidia"]:
        migs = sum("parent_index" in gpu for gpu in snap["gpus"])
        count = len(snap["gpus"]) - migs
        instances = f", {migs} MIG instance{'s' if migs != 1 else ''}" if migs else ""
        lines = [f"NVIDIA driver {snap.get('driver', 'unknown')}, {count} GPU{'s' if count != 1 else ''}{instances}"]
        lines += [_gpu_line(gpu) for gpu in snap["gpus"]]
    else:
        lines = [snap["reason"]]
    host = snap["host"]
    lines.append(f"host   CPU {host['cpu_percent']:.0f}% of {host['cpu_count']} cores   "
                 f"RAM {host['ram_used_mb'] / 1024:.1f}/{host['ram_total_mb'] / 1024:.1f} GiB "
                 f"({host['ram_percent']:.0f}%)")
    return "\n".join(lines)


def _gpu_line(gpu: dict) -> str:
    parts = [f"GPU {gpu['index']}", gpu.get("name", "unknown GPU")]
    if "utilization_gpu" in gpu:
        parts.append(f"util {gpu['utilization_gpu']:.0f}%")
    if "memory_used_mb" in gpu and "memory_total_mb" in gpu:
        parts.append(f"mem {gpu['memory_used_mb'] / 1024:.1f}/{gpu['memory_total_mb'] / 1024:.1f} GiB")
    if "power_w" in gpu:
        limit = f" / {gpu['power_limit_w']:.0f} W" if "power_limit_w" in gpu else ""
        parts.append(f"{gpu['power_w']:.0f} W{limit}")
    if "temperature_c" in gpu:
        parts.append(f"{gpu['temperature_c']:.0f} C")
    if gpu.get("processes"):
        parts.append("pids " + ", ".join(str(p["pid"]) for p in gpu["processes"]))
    return "   ".join(parts)
