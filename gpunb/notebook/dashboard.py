"""The live dashboard of a %%gputrain run, and the static summary that replaces it.

Training code only calls the hooks below; widget values are set at most every
`min_interval_s` (never printed into an Output widget, never from a thread). When the
run ends, fails or is interrupted, the display is updated in place with plain HTML
and text that need no widget manager (nbconvert, GitHub, nbval). `HtmlDashboard` is the
same view for front ends without a widget manager: one HTML block re-sent through its
display handle (`update_display_data`), which every notebook front end applies.
"""

from __future__ import annotations

import html
import time
from collections import deque
from types import SimpleNamespace

from gpunb.charts import as_image, loss_chart, sparkline
from gpunb.render import epoch_table_html, flops_text, free_memory_text, memory_text, progress_parts


# ipywidgets' HTML widget sets a line height of one widget row (28 px): text that wraps in a
# narrow output area would read double-spaced.
TEXT_STYLE = "line-height:1.4;display:inline-block"


class Dashboard:
    """ipywidgets view: progress, metrics, loss curve, GPU sparklines. A plain callback."""

    def __init__(self, min_interval_s: float = 0.5):
        self.min_interval_s = min_interval_s
        self.handle = None
        self._last_draw = 0.0
        self.train_points: list = []
        self.val_points: list = []
        self.epoch_rows: list = []
        self.gpu_samples: deque = deque(maxlen=120)
        self.node_gpus: dict = {}  # a job's GPUs, "node N · host · GPU i" -> its newest samples
        self.draws = 0
        self._stop_drawn = False

    # --- events -------------------------------------------------------------
    def on_fit_start(self, state) -> None:
        import ipywidgets as w
        from IPython.display import display

        # A resumed or continued fit starts with the history so far: its curves go on from there.
        self.train_points = [(row["step"], row["loss"]) for row in state.history if "loss" in row]
        self.val_points = [(row["step"], row["val_loss"]) for row in state.validations if "val_loss" in row]
        self.epoch_rows = list(state.epochs)

        # Narrow output areas (a sidebar open beside the notebook) wrap the status line under
        # the bar instead of squeezing the bar to nothing or cutting the line off.
        self.progress = w.IntProgress(min=0, max=max(1, state.total_steps or 1), value=state.step,
                                      layout=w.Layout(flex="1 1 240px", min_width="160px", max_width="480px"))
        self.status = w.HTML(layout=w.Layout(flex="0 1 auto", min_width="0"))
        self.metrics = w.HTML()
        self.curve = w.HTML()
        self.gpu = w.HTML()
        self.epochs = w.HTML()
        header = w.HTML(_header_html(state))
        wrap = w.Layout(flex_flow="row wrap", align_items="center")
        self.box = _Dashboard([header, w.HBox([self.progress, self.status], layout=wrap), self.metrics,
                               w.HBox([self.curve, self.gpu], layout=w.Layout(flex_flow="row wrap")),
                               self.epochs], run_name=state.run_name)
        # The bundle by hand: ipywidgets 7 shows a widget through `_ipython_display_`, which
        # drops the display id, and the summary at the end could not take the widget's place.
        view = {"text/plain": repr(self.box), "application/vnd.jupyter.widget-view+json": self.box.get_view_spec()}
        self.handle = display(view, raw=True, display_id=True)
        self._draw(state)

    def on_step_end(self, state) -> None:
        now = time.monotonic()
        stopping = state.stop_reason is not None and not self._stop_drawn
        if stopping or now - self._last_draw >= self.min_interval_s:
            self._stop_drawn = state.stop_reason is not None  # a stop shows at once, not at the next redraw
            self._draw(state, now)

    def on_log(self, state, row) -> None:
        self.train_points.append((row["step"], row["loss"]))
        if "gpu" in state.extras:
            self.gpu_samples.append(state.extras["gpu"])

    def on_gpu_samples(self, state, samples) -> None:
        """A job's GPU samples, each with its node (jobs/follow.py): one view per node and GPU."""
        for sample in samples:
            name = f"node {sample['node']} · {sample['host']} · GPU {sample['index']}"
            self.node_gpus.setdefault(name, deque(maxlen=120)).append(sample)

    def on_validation_end(self, state, metrics) -> None:
        if "val_loss" in metrics:
            self.val_points.append((state.step, metrics["val_loss"]))
        self._draw(state)

    def on_epoch_end(self, state, row) -> None:
        self.epoch_rows.append(row)
        self.epochs.value = epoch_table_html(self.epoch_rows)

    def on_fit_end(self, state) -> None:
        self._finish(state.result)

    def on_exception(self, state, error) -> None:
        self._finish(FailedRun(state, error))

    # --- drawing ------------------------------------------------------------
    def _draw(self, state, now: float | None = None) -> None:
        self._last_draw = now or time.monotonic()
        self.draws += 1
        if state.total_steps:
            self.progress.max = state.total_steps
        self.progress.value = min(state.step, self.progress.max)
        line = " · ".join(progress_parts(state, with_loss=False))
        self.status.value = f"<span style='{TEXT_STYLE}'>{html.escape(line)}</span>"
        self.metrics.value = f"<span style='{TEXT_STYLE}'>{_metrics_html(state)}</span>"
        self.curve.value = loss_chart(self.train_points, self.val_points, x_max=state.total_steps)
        if self.gpu_samples or self.node_gpus:
            self.gpu.value = self._gpu_html()

    def _gpu_html(self) -> str:
        if self.node_gpus:
            return "".join(f"<div><b>{html.escape(name)}</b>{gpu_sparklines_html(list(samples))}</div>"
                           for name, samples in sorted(self.node_gpus.items()))
        return gpu_sparklines_html(list(self.gpu_samples)) if self.gpu_samples else ""

    def _finish(self, summary) -> None:
        if self.handle is not None:
            self.handle.update(summary)  # the widget's place now holds a static summary
            self.box.close()


class HtmlDashboard(Dashboard):
    """The dashboard as plain HTML, redrawn in place at most every `min_interval_s`."""

    def __init__(self, min_interval_s: float = 1.0):  # each redraw re-sends the whole block
        super().__init__(min_interval_s)

    def on_fit_start(self, state) -> None:
        from IPython.display import display

        self.handle = display(LiveHtml(self._html(state), state.run_name), display_id=True)
        self.draws += 1
        self._last_draw = time.monotonic()

    def on_epoch_end(self, state, row) -> None:
        self.epoch_rows.append(row)
        self._draw(state)

    def _draw(self, state, now: float | None = None) -> None:
        self._last_draw = now or time.monotonic()
        self.draws += 1
        self.handle.update(LiveHtml(self._html(state), state.run_name))

    def _html(self, state) -> str:
        total = max(1, state.total_steps or 1)
        line = html.escape(" · ".join(progress_parts(state, with_loss=False)))
        gpu = self._gpu_html()
        # a frame is stored in the notebook (the last one stays if the kernel dies): an image
        curve = as_image(loss_chart(self.train_points, self.val_points, x_max=state.total_steps), "loss")
        return (f"<div class='gpunb-live'><div>{_header_html(state)}</div>"
                f"<div style='display:flex;flex-wrap:wrap;gap:.2em .8em;align-items:center'>"
                f"<progress max='{total}' value='{min(state.step, total)}' "
                f"style='flex:1 1 240px;min-width:160px;max-width:480px'></progress>"
                f"<span class='gpunb-status' style='{TEXT_STYLE}'>{line}</span></div>"
                f"<div>{_metrics_html(state)}</div>"
                f"<div style='display:flex;flex-wrap:wrap;gap:1em'>{curve}<div>{gpu}</div></div>"
                f"{epoch_table_html(self.epoch_rows)}</div>")

    def _finish(self, summary) -> None:
        if self.handle is not None:
            self.handle.update(summary)


class LiveHtml:
    """One frame of the HTML dashboard; its text is stable for nbval and plain front ends."""

    def __init__(self, markup: str, run_name: str):
        self.markup, self.run_name = markup, run_name

    def __repr__(self) -> str:
        return f"gpunb: training {self.run_name!r} (live dashboard)"

    def _repr_html_(self) -> str:
        return self.markup


class _Dashboard:
    """Placeholder replaced by a VBox subclass on first use (ipywidgets imports lazily)."""

    def __new__(cls, children, run_name):
        import ipywidgets as w

        class Box(w.VBox):
            def __repr__(self):
                # What nbval and plain front ends see of the live widget: stable text.
                return f"gpunb: training {run_name!r} (live dashboard)"

        return Box(children)


class FailedRun:
    """What the display shows when fit raised: the history so far and the error."""

    def __init__(self, state, error):
        self.state, self.error = state, error

    def __repr__(self) -> str:
        return (f"gpunb: {self.state.run_name!r} failed at step {self.state.step}: "
                f"{type(self.error).__name__}: {str(self.error).splitlines()[0] if str(self.error) else ''}")

    def _repr_html_(self) -> str:
        points = [(row["step"], row["loss"]) for row in self.state.history]
        return (f"<div class='gpunb-failed'><b>{html.escape(repr(self))}</b>"
                f"{as_image(loss_chart(points, x_max=self.state.step), 'loss') if points else ''}</div>")


def _header_html(state) -> str:
    used = state.settings()  # the batch size and precision chosen
    batch = f"{used['batch_size']} x {used['grad_accum']} accumulation x {state.world_size} device(s)"
    return (f"<div style='{TEXT_STYLE}'><b>{html.escape(state.run_name)}</b> &middot; "
            f"{html.escape(str(state.device))} &middot; precision {html.escape(used['precision'])} &middot; "
            f"batch {batch}{_summary_html(state)}</div>")


def _summary_html(state) -> str:
    """Parameters, FLOPs and memory against free memory (measured before the first step)."""
    plain = state.summary
    if not plain:
        return ""
    summary = SimpleNamespace(**plain)
    lines = [f"{summary.params:,} parameters ({summary.trainable_params:,} trainable, "
             f"{summary.frozen_params:,} frozen) &middot; FLOPs per sample: {html.escape(flops_text(summary))}",
             f"memory: {html.escape(memory_text(summary))}", html.escape(free_memory_text(summary))]
    return "".join(f"<div style='font-size:90%'>{line}</div>" for line in lines)


def _metrics_html(state) -> str:
    latest = state.latest
    names = ["loss", "val_loss", *sorted(k for k in latest if k.startswith("val_") and k != "val_loss"), "lr"]
    labels = {"loss": "last loss"}  # the mean of the last log interval (train_loss is an epoch's mean)
    cells = [f"{labels.get(name, name)} <b>{latest[name]:.4g}</b>" for name in names if name in latest]
    if latest.get("skipped_steps"):
        cells.append(f"skipped fp16 steps <b>{latest['skipped_steps']}</b>")
    if latest.get("oom_recoveries"):
        cells.append(f"OOM recoveries <b>{latest['oom_recoveries']}</b>")
    return " &middot; ".join(cells) or "waiting for the first log interval"


def gpu_sparklines_html(samples: list) -> str:
    """Small SVG lines of GPU utilisation, memory, power and temperature from telemetry samples."""
    rows = []
    for key, label, unit in (("utilization_gpu", "GPU util", "%"), ("memory_used_mb", "memory", " MiB"),
                             ("power_w", "power", " W"), ("temperature_c", "temperature", " C")):
        values = [s[key] for s in samples if key in s]
        if not values:
            continue
        svg = sparkline(values)
        rows.append((label, f"{values[-1]:,.0f}{unit}", svg))
    return "".join(f"<div>{html.escape(label)} <b>{value}</b>{svg}</div>" for label, value, svg in rows)
