"""Plain renderers for results: an inline SVG loss curve and small HTML helpers.

Pure functions of their inputs (no clock, no randomness), so a rendered summary is
byte-for-byte the same for the same history: safe for nbval and nbconvert.
"""

from __future__ import annotations

import html
import math


def loss_curve_svg(series: dict[str, list[tuple[float, float]]], width: int = 420, height: int = 170,
                   y_label: str = "loss") -> str:
    """An SVG line chart of named (x, y) series, e.g. {"train": [(step, loss)], "val": [...]}."""
    points = [(x, y) for line in series.values() for x, y in line if _finite(y)]
    if not points:
        return ""
    pad_left, pad_right, pad_top, pad_bottom = 48, 12, 10, 26
    # A loss that falls by decades would hug the floor on a linear axis: use log10 then.
    log_y = all(p[1] > 0 for p in points) and max(p[1] for p in points) > 100 * min(p[1] for p in points)
    if log_y:
        series = {name: [(x, math.log10(y)) for x, y in line if _finite(y) and y > 0]
                  for name, line in series.items()}
        points = [(x, math.log10(y)) for x, y in points]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    plot_w, plot_h = width - pad_left - pad_right, height - pad_top - pad_bottom

    def sx(x):
        return pad_left + (x - x0) / (x1 - x0) * plot_w

    def sy(y):
        return pad_top + (1 - (y - y0) / (y1 - y0)) * plot_h

    colors = {"train": "#1f77b4", "val": "#ff7f0e"}
    # fill="currentColor": labels take the page's text colour, so dark themes stay readable.
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10" fill="currentColor">',
             f'<rect x="{pad_left}" y="{pad_top}" width="{plot_w}" height="{plot_h}" '
             'fill="none" stroke="#bbb"/>']
    for value in (y0, (y0 + y1) / 2, y1):
        parts.append(f'<text x="{pad_left - 4}" y="{sy(value) + 3:.1f}" text-anchor="end">'
                     f'{_short(10 ** value if log_y else value)}</text>')
    parts.append(f'<text x="{pad_left}" y="{height - 8}">{_short(x0)}</text>')
    parts.append(f'<text x="{width - pad_right}" y="{height - 8}" text-anchor="end">{_short(x1)} steps</text>')
    legend_x = pad_left + 8
    for i, (name, line) in enumerate(series.items()):
        line = [(x, y) for x, y in line if _finite(y)]
        color = colors.get(name, "#2ca02c")
        if not line:
            continue
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in line)
        if len(line) == 1:
            x, y = line[0]
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>')
        else:
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.6"/>')
        parts.append(f'<text x="{legend_x + i * 70}" y="{pad_top + 12}" fill="{color}">'
                     f'{html.escape(name)} {html.escape(y_label)}</text>')
    if log_y:
        parts.append(f'<text x="{width - pad_right - 4}" y="{pad_top + 12}" text-anchor="end">log scale</text>')
    parts.append("</svg>")
    return "".join(parts)


def html_table(rows: list[tuple[str, str]]) -> str:
    cells = "".join(f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(k)}</th>"
                    f"<td style='text-align:left'>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def _short(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))  # step counts: "1800", not "1.8e+03"
    if value == 0 or 0.01 <= abs(value) < 10_000:
        return f"{value:.3g}"
    return f"{value:.2g}"
