"""Durations as people read them, one format everywhere (progress line, dashboard, run table);
byte counts as people write them ("24GiB").

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


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int | None:
    """`"24GiB"` -> 25769803776, `"80 GB"` -> 80e9, `"512MiB"`; None when `text` is not a byte count."""
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        return None
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])
