"""%gpustatus: the devices right now, as HTML and as plain text."""

from __future__ import annotations

import html
import json

from gpunb.render import html_table


class Status:
    def __init__(self, snapshot: dict):
        self.snapshot = snapshot

    @classmethod
    def now(cls) -> "Status":
        from gpunb.telemetry import snapshot

        return cls(snapshot())  # NVML only: CUDA is never initialised here

    def json(self) -> str:
        return json.dumps(self.snapshot, indent=1, sort_keys=True)

    def __repr__(self) -> str:
        from gpunb.telemetry.text import status_text

        return status_text(self.snapshot)

    def _repr_html_(self) -> str:
        snap = self.snapshot
        host = snap["host"]
        host_line = (f"host CPU {host['cpu_percent']:.0f}% of {host['cpu_count']} cores &middot; RAM "
                     f"{host['ram_used_mb'] / 1024:.1f} / {host['ram_total_mb'] / 1024:.1f} GiB")
        if not snap["nvidia"]:
            return (f"<div class='gpunb-status'><b>No NVIDIA GPU</b>: {html.escape(snap['reason'])}"
                    f"<br>{host_line}</div>")
        table = html_table([_gpu_row(gpu) for gpu in snap["gpus"]],
                           ("GPU", "name", "util", "memory", "power", "temp", "processes"))
        return (f"<div class='gpunb-status'>NVIDIA driver {html.escape(str(snap.get('driver', '?')))}"
                f"{table}{host_line}</div>")


def _gpu_row(gpu: dict) -> tuple[str, ...]:
    memory = (f"{gpu['memory_used_mb'] / 1024:.1f} / {gpu['memory_total_mb'] / 1024:.1f} GiB"
              if "memory_used_mb" in gpu and "memory_total_mb" in gpu else "n/a")
    power = f"{gpu['power_w']:.0f} W" if "power_w" in gpu else "n/a"
    if "power_limit_w" in gpu and "power_w" in gpu:
        power += f" / {gpu['power_limit_w']:.0f} W"
    processes = ", ".join(f"{p['pid']} ({p['used_memory_mb']:.0f} MiB)" if p.get("used_memory_mb") else str(p["pid"])
                          for p in gpu.get("processes", [])) or "none"
    return (str(gpu["index"]), gpu.get("name", "?"),
            f"{gpu['utilization_gpu']:.0f}%" if "utilization_gpu" in gpu else "n/a", memory, power,
            f"{gpu['temperature_c']:.0f} C" if "temperature_c" in gpu else "n/a", processes)
