"""Durations as people read them, one format everywhere (progress line, dashboard, run table).

The sidebar's `duration()` in labextension/src/format.ts writes the same text.
"""

from __future__ import annotations


def format_duration(seconds: float) -> str:
    """`45s`, `12m 05s`, `1h 02m` (seconds are dropped once there are hours)."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"
