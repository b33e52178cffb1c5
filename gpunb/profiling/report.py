"""ProfileResult: the numbers of a profile and the advice, as text and as self-contained HTML.

The text form is meant to be stable in shape for nbval: numbers are rounded to three
significant digits and there is no clock reading in it. The HTML uses inline styles
only (no CDN, no script), so it renders the same offline and in exported notebooks.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

from gpunb.render import html_table

PHASE_LABELS = {"data_wait": "data wait", "h2d": "h2d copy", "forward": "forward",
                "backward": "backward", "optimizer": "optimizer", "other": "other"}


@dataclass
class Phase:
    name: str  # data_wait, h2d, forward, backward, optimizer or other
    ms: float  # per step
    pct: float  # of the step; the phases of a profile add up to 100


@dataclass
class DeviceTime:
    busy_pct: float  # of the profiled wall time, some kernel running
    idle_host_pct: float  # idle, the host busy elsewhere (Python, launches, syncs)
    idle_data_pct: float  # idle while the loop waited for the next batch or copied it
    nvml_util_pct: float | None = None  # NVML's own utilisation reading, when there is one
    nvml_read: bool = False  # NVML was sampled; no reading then means the capture was too short


@dataclass
class OpRow:
    name: str
    calls: int
    self_ms: float  # summed over the profiled steps
    pct: float  # of profiled wall time
    mean_us: float  # self time per call
    shapes: str  # input shapes of the heaviest signature


@dataclass
class KernelRow:
    name: str
    calls: int
    total_ms: float
    pct: float  # of profiled wall time
    mean_us: float


@dataclass
class Memory:
    device: str  # "cuda" or "cpu"
    peak_allocated: int  # bytes
    peak_reserved: int | None  # bytes (CUDA caching allocator); None on CPU
    total: int | None  # bytes of device memory, when known
    largest: list = field(default_factory=list)  # (op, bytes, count), biggest first


@dataclass
class Advice:
    rule: str  # stable id, e.g. "data_wait"
    message: str  # what to change
    evidence: str  # what in the profile shows it
    est_gain: float  # rough share of step time it could save, 0..1

    def __repr__(self) -> str:
        return f"Advice({self.rule!r}, est_gain≈{_pct(self.est_gain * 100)})"


@dataclass
class ProfileResult:
    """Where the time of the profiled steps went, and what to change (`advice`)."""

    kind: str  # "training" (steps of a Trainer) or "callable"
    device: str
    steps: int
    step_ms: float  # mean wall time of a profiled step
    phases: list[Phase] = field(default_factory=list)  # training only
    device_time: DeviceTime | None = None  # GPU runs only
    top_ops: list[OpRow] = field(default_factory=list)
    top_kernels: list[KernelRow] = field(default_factory=list)
    memory: Memory | None = None
    advice: list[Advice] = field(default_factory=list)
    trace_path: str | None = None
    notes: list[str] = field(default_factory=list)
    signals: dict = field(default_factory=dict, repr=False)  # the evidence the rules read

    @property
    def rules(self) -> list[str]:
        """The ids of the advice that fired, most valuable first."""
        return [a.rule for a in self.advice]

    def __repr__(self) -> str:
        return "\n".join(self._text_lines())

    def _what(self) -> str:
        noun = "training step" if self.kind == "training" else "call"
        return f"{self.steps} {noun}{'' if self.steps == 1 else 's'}"

    def _text_lines(self) -> list[str]:
        lines = [f"gpunb profile: {self._what()} on {self.device}, {_num(self.step_ms)} ms per step"]
        if self.phases:
            lines.append("step phases:")
            for p in self.phases:
                lines.append(f"  {PHASE_LABELS.get(p.name, p.name):<10} {_num(p.ms):>7} ms {_pct(p.pct):>6}  "
                             + "#" * round(p.pct / 5))
        if self.device_time:
            lines.append("device: " + _device_text(self.device_time))
        if self.top_ops:
            lines.append("top ops by self time:")
            lines += [f"  {r.name:<32} {r.calls:>6} calls {_num(r.self_ms):>7} ms {_pct(r.pct):>6}  {r.shapes}"
                      for r in self.top_ops[:5]]
        if self.top_kernels:
            lines.append("top kernels:")
            lines += [f"  {_short(r.name, 48):<48} {r.calls:>6} calls {_num(r.total_ms):>7} ms {_pct(r.pct):>6}"
                      for r in self.top_kernels[:5]]
        if self.memory:
            lines.append("memory: " + _memory_text(self.memory))
        lines.append("advice:" if self.advice else "advice: none fired")
        for a in self.advice:
            lines.append(f"  [{a.rule}] {a.message} (est. gain ~{_pct(a.est_gain * 100)} of step time)")
            lines.append(f"      evidence: {a.evidence}")
        lines += [f"note: {n}" for n in self.notes]
        if self.trace_path:
            lines.append(f"trace: {self.trace_path} (open in https://ui.perfetto.dev or chrome://tracing)")
        return lines

    def _repr_html_(self) -> str:
        parts = [(f"<div class='gpunb-profile' style='font-family:sans-serif;font-size:13px'>"
                  f"<b>gpunb profile</b>: {self._what()} on {_e(self.device)}, "
                  f"<b>{_num(self.step_ms)} ms</b> per step")]
        if self.phases:
            rows = [(PHASE_LABELS.get(p.name, p.name), _num(p.ms), _pct(p.pct), _bar(p.pct)) for p in self.phases]
            parts.append(_section("Step phases", html_table(rows, ("phase", "ms/step", "%", ""), raw=(3,))))
        if self.device_time:
            parts.append(_section("Device", _e(_device_text(self.device_time))))
        if self.top_ops:
            rows = [(r.name, r.calls, _num(r.self_ms), _pct(r.pct), _num(r.mean_us), r.shapes) for r in self.top_ops]
            parts.append(_section("Top ops (self time)",
                                  html_table(rows, ("op", "calls", "self ms", "% of time", "mean µs", "input shapes"))))
        if self.top_kernels:
            rows = [(_short(r.name, 90), r.calls, _num(r.total_ms), _pct(r.pct), _num(r.mean_us))
                    for r in self.top_kernels]
            parts.append(_section("Top kernels", html_table(rows, ("kernel", "calls", "ms", "% of time", "mean µs"))))
        if self.memory:
            rows = [(op, _bytes(size), count) for op, size, count in self.memory.largest]
            body = _e(_memory_text(self.memory, largest=False))
            if rows:
                body += html_table(rows, ("largest allocations (op)", "size", "times"))
            parts.append(_section("Memory", body))
        if self.advice:
            items = "".join(f"<li><b>{_code(a.message)}</b> <code>{_e(a.rule)}</code><br>"
                            f"<span style='color:#555'>evidence: {_e(a.evidence)}; "
                            f"est. gain ~{_pct(a.est_gain * 100)} of step time</span></li>" for a in self.advice)
            parts.append(_section("Advice", f"<ol style='margin:0'>{items}</ol>"))
        else:
            parts.append(_section("Advice", "none fired: no known bottleneck stands out."))
        for note in self.notes:
            parts.append(f"<div style='color:#555'>note: {_e(note)}</div>")
        if self.trace_path:
            parts.append(f"<div>trace: <code>{_e(self.trace_path)}</code> "
                         "(open in https://ui.perfetto.dev or chrome://tracing)</div>")
        return "".join(parts) + "</div>"


def _device_text(d: DeviceTime) -> str:
    idle = 100 - d.busy_pct
    text = (f"busy {_pct(d.busy_pct)}, idle {_pct(idle)} (waiting on the host {_pct(d.idle_host_pct)}, "
            f"on data {_pct(d.idle_data_pct)})")
    if d.nvml_util_pct is not None:
        text += f"; NVML utilisation {_pct(d.nvml_util_pct)}"
    elif d.nvml_read:  # no sample fell inside the capture: unknown, not 0%
        text += "; NVML utilisation n/a (capture shorter than NVML's 1 s sample period)"
    return text


def _memory_text(m: Memory, largest: bool = True) -> str:
    text = f"peak allocated {_bytes(m.peak_allocated)}"
    if m.device == "cpu":
        text += " (by ops in the profiled steps, CPU)"
    if m.peak_reserved is not None:
        text += f", reserved {_bytes(m.peak_reserved)}"
    if m.total:
        text += f" of {_bytes(m.total)}"
    if largest and m.largest:
        op, size, _count = m.largest[0]
        text += f"; largest allocation {_bytes(size)} in {op}"
    return text


def _num(x: float) -> str:
    """Three significant digits, never scientific: 0.0123, 1.23, 123, 12300."""
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}" if abs(x) >= 0.001 else "<0.001"


def _pct(x: float) -> str:
    return f"{x:.1f}%"


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{_num(n / size)} {unit}"
    return f"{n} B"


def _short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def _e(text) -> str:
    return html.escape(str(text))


def _code(text: str) -> str:
    """Escaped text with its `backticked` parts set as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", _e(text))


def _bar(pct: float) -> str:
    width = max(0.0, min(100.0, pct))
    return (f"<div style='background:#4c78a8;height:0.8em;width:{width * 1.6:.0f}px;"
            f"min-width:{1 if pct > 0 else 0}px'></div>")


def _section(title: str, body: str) -> str:
    return f"<div style='margin-top:0.6em'><b>{_e(title)}</b><div>{body}</div></div>"
