"""SVG line charts: pure functions of their data (no clock, no randomness, no torch).

The same data gives the same bytes, so rendered summaries are stable under nbval and
nbconvert; `fill="currentColor"` lets labels follow the page's text colour (dark themes).
What a notebook stores goes through `as_image`, which survives untrusted front ends.
"""

from __future__ import annotations

import base64
import html
import math
import re

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
MAX_CURVE_POINTS = 300  # a run's train curve is thinned to this many points


def line_chart(metric: str, names: list[str], series: list[list[tuple[float, float]]], *,
               x_label: str = "step", width: int = 560, height: int = 280, legend: int = 180,
               empty: str = "for these runs", x_range: tuple[float, float] | None = None,
               integer_x: bool | None = None, log_y: bool | None = None) -> str:
    """An SVG line chart of `series` (lists of (x, y)), one colour per name, legend on the right.

    `x_range` fixes the x axis (data outside it widens it); `integer_x` puts ticks on whole
    numbers only (default: when x_label is "step"); `log_y` forces the y scale (default:
    `log_scale` of the values).
    """
    points = [point for line in series for point in line if math.isfinite(point[1])]
    series = [[point for point in line if math.isfinite(point[1])] for line in series]
    total_width = width + legend
    parts = [(f"<svg xmlns='http://www.w3.org/2000/svg' width='{total_width}' height='{height}' "
              f"viewBox='0 0 {total_width} {height}' font-family='sans-serif' font-size='11' "
              "fill='currentColor'>")]
    if not points:
        parts.append(f"<text x='{_LEFT}' y='{height / 2}'>No {html.escape(metric)} values recorded "
                     f"{html.escape(empty)}.</text></svg>")
        return "".join(parts)
    xs, ys = [x for x, _ in points], [y for _, y in points]
    if log_y is None:
        log_y = log_scale(ys)
    if integer_x is None:
        integer_x = x_label == "step"
    to_y = math.log10 if log_y else float
    if x_range is not None:
        xs += list(x_range)
    frame = _Frame(width, height, _padded(min(xs), max(xs), 0.0), _padded(to_y(min(ys)), to_y(max(ys)), 0.05), to_y)
    parts += _grid(frame, integer_x, log_y)
    parts.append(_axes(frame, metric, x_label, log_y))
    parts += _lines_and_legend(frame, names, series)
    parts.append("</svg>")
    return "".join(parts)


_LEFT, _RIGHT, _TOP, _BOTTOM = 60, 16, 12, 40  # the margins of a chart's plot area


class _Frame:
    """A chart's plot area, and where a data point (x, y) lands in it."""

    def __init__(self, width: int, height: int, x_span: tuple, y_span: tuple, to_y):
        self.width, self.height = width, height
        self.plot_w, self.plot_h = width - _LEFT - _RIGHT, height - _TOP - _BOTTOM
        (self.x_low, self.x_high), (self.y_low, self.y_high), self.to_y = x_span, y_span, to_y

    def px(self, x: float) -> float:
        return _LEFT + (x - self.x_low) / (self.x_high - self.x_low) * self.plot_w

    def py(self, y: float) -> float:
        return _TOP + (1 - (self.to_y(y) - self.y_low) / (self.y_high - self.y_low)) * self.plot_h


def _grid(frame: _Frame, integer_x: bool, log_y: bool) -> list[str]:
    """Grid lines with their tick labels: x ticks below the plot, y ticks on its left."""
    px, py, plot_w, plot_h = frame.px, frame.py, frame.plot_w, frame.plot_h
    parts = []
    for tick in _ticks(frame.x_low, frame.x_high, integers=integer_x):
        label = f"{int(tick)}" if integer_x else f"{tick:g}"
        parts.append(f"<line x1='{px(tick):.1f}' x2='{px(tick):.1f}' y1='{_TOP}' y2='{_TOP + plot_h}' "
                     f"stroke='currentColor' stroke-opacity='0.15'/><text x='{px(tick):.1f}' "
                     f"y='{_TOP + plot_h + 14}' text-anchor='middle'>{label}</text>")
    y_low, y_high = frame.y_low, frame.y_high
    y_ticks = [10 ** t for t in _ticks(y_low, y_high, integers=True)] if log_y else _ticks(y_low, y_high)
    for tick in y_ticks:
        parts.append(f"<line x1='{_LEFT}' x2='{_LEFT + plot_w}' y1='{py(tick):.1f}' y2='{py(tick):.1f}' "
                     f"stroke='currentColor' stroke-opacity='0.15'/><text x='{_LEFT - 6}' "
                     f"y='{py(tick) + 4:.1f}' text-anchor='end'>{tick:.3g}</text>")
    return parts


def _axes(frame: _Frame, metric: str, x_label: str, log_y: bool) -> str:
    """The plot's border and the two axis titles (the y one turned upright)."""
    plot_w, plot_h = frame.plot_w, frame.plot_h
    return (f"<rect x='{_LEFT}' y='{_TOP}' width='{plot_w}' height='{plot_h}' fill='none' "
            "stroke='currentColor' stroke-opacity='0.5'/>"
            f"<text x='{_LEFT + plot_w / 2}' y='{frame.height - 6}' text-anchor='middle'>{html.escape(x_label)}</text>"
            f"<text x='14' y='{_TOP + plot_h / 2}' text-anchor='middle' "
            f"transform='rotate(-90 14 {_TOP + plot_h / 2})'>{html.escape(metric)}"
            f"{' (log)' if log_y else ''}</text>")


def _lines_and_legend(frame: _Frame, names: list[str], series: list) -> list[str]:
    """One line per series (a dot where it has one point), and its legend entry right of the plot."""
    px, py, width = frame.px, frame.py, frame.width
    parts = []
    for i, (name, line) in enumerate(zip(names, series)):
        colour = PALETTE[i % len(PALETTE)]
        if len(line) == 1:
            parts.append(f"<circle cx='{px(line[0][0]):.1f}' cy='{py(line[0][1]):.1f}' r='3' fill='{colour}'/>")
        elif line:
            coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in line)
            parts.append(f"<polyline points='{coords}' fill='none' stroke='{colour}' stroke-width='1.5'/>")
        label = name if len(name) <= 24 else name[:23] + "…"
        y = _TOP + 8 + 16 * i
        parts.append(f"<line x1='{width + 4}' x2='{width + 22}' y1='{y}' y2='{y}' stroke='{colour}' "
                     f"stroke-width='2'/><text x='{width + 28}' y='{y + 4}'>{html.escape(label)}"
                     f"{'' if line else ' (no data)'}</text>")
    return parts


IMAGE_INK = "#808080"  # labels and grid inside an <img>: readable on light and dark pages


def as_image(svg: str, alt: str) -> str:
    """The chart as an `<img>` holding its SVG, for HTML that a notebook stores.

    JupyterLab and Notebook 7 sanitize the HTML of an untrusted notebook (any notebook
    reopened, downloaded or received) and drop inline `<svg>`, leaving its labels as
    loose text; GitHub's viewer does the same. An image is kept by all of them. The page's
    text colour does not reach into an image, hence a grey that reads on either theme.
    The bytes stay a pure function of the chart, so stored outputs compare under nbval.
    """
    width, height = re.search(r"width='(\d+)' height='(\d+)'", svg).groups()
    data = base64.b64encode(svg.replace("currentColor", IMAGE_INK).encode()).decode("ascii")
    return (f"<img src='data:image/svg+xml;base64,{data}' width='{width}' height='{height}' "
            f"alt='{html.escape(alt, quote=True)}' style='max-width:100%;height:auto'>")


def loss_chart(train: list, val: list = (), *, x_max: int | None = None) -> str:
    """The loss curves of one run: the live dashboard and the final summary both draw this.

    One size, one x axis (optimizer steps from 0 to `x_max` or the last point, whole-number
    ticks) and one y scale, decided by `log_scale` over every point before the train curve
    is thinned to MAX_CURVE_POINTS, so a chart does not change scale when the run ends.
    """
    names, series = ["train loss"], [thin(list(train))]
    if val:
        names.append("val loss")
        series.append(list(val))
    values = [y for line in (train, val) for _, y in line if math.isfinite(y)]
    return line_chart("loss", names, series, width=420, height=210, legend=90, empty="yet",
                      x_range=(0, x_max or 0), integer_x=True, log_y=bool(values) and log_scale(values))


def log_scale(values: list[float]) -> bool:
    """Values spanning more than two decades (a falling loss) read better on a log axis."""
    return min(values) > 0 and max(values) / min(values) > 100


def thin(points: list) -> list:
    """At most MAX_CURVE_POINTS of `points`, evenly spread, the last always kept."""
    if len(points) <= MAX_CURVE_POINTS:
        return points
    stride = len(points) / MAX_CURVE_POINTS
    return [points[int(i * stride)] for i in range(MAX_CURVE_POINTS)] + [points[-1]]


def sparkline(values: list, width: int = 160, height: int = 32) -> str:
    """A bare line of recent values scaled to the box: no axes, just the shape."""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    step = width / max(1, len(values) - 1)
    coords = " ".join(f"{i * step:.1f},{height - 2 - (v - low) / span * (height - 4):.1f}"
                      for i, v in enumerate(values))
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>"
            f"<polyline points='{coords}' fill='none' stroke='{PALETTE[0]}' stroke-width='1.5'/></svg>")


def _padded(low: float, high: float, fraction: float) -> tuple[float, float]:
    if high == low:
        return low - 1, high + 1
    pad = (high - low) * fraction
    return low - pad, high + pad


def _ticks(low: float, high: float, integers: bool = False) -> list[float]:
    """About five round values in [low, high]: steps of 1, 2 or 5 times a power of ten."""
    raw = (high - low) / 5
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if step * m >= raw)
    if integers:
        step = max(1.0, round(step))
    first = math.ceil(low / step) * step
    return [round(first + k * step, 10) for k in range(int((high - first) / step) + 1)]
