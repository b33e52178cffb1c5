"""Display for people: HTML tables, result summaries, plots and the terminal progress line.

Everything here works on plain values and on the fields of result and state objects
(duck-typed): no torch, no runtime import, so `runtime/` stays pure PyTorch and the
result classes render by delegating here.
"""

from __future__ import annotations

import html
import math
import sys
import time
from types import SimpleNamespace

from gpunb.charts import as_image, line_chart, loss_chart
from gpunb.units import format_duration


# ---------------------------------------------------------------------- tables
def html_table(rows, header=None, *, css_class: str | None = None, align: str = "left",
               pad: str = "0 .8em 0 0", raw: tuple[int, ...] = (), key_column: bool = False,
               row_titles=None) -> str:
    """The one HTML table of gpunb: escaped cells, one alignment and padding throughout.

    `raw` lists columns holding our own markup (not escaped); `key_column` sets each
    row's first cell as a <th> (key/value tables); `row_titles` gives each row a tooltip.
    """
    style = f" style='text-align:{align};padding:{pad}'"
    opening = f"<table class='{css_class}'>" if css_class else "<table style='border-collapse:collapse'>"
    parts = [opening]
    if header:
        head = "".join(f"<th{style}>{html.escape(str(h))}</th>" for h in header)
        parts.append(f"<thead><tr>{head}</tr></thead>")
    parts.append("<tbody>")
    for i, row in enumerate(rows):
        cells = [str(c) if j in raw else html.escape(str(c)) for j, c in enumerate(row)]
        tags = ["th" if key_column and j == 0 else "td" for j in range(len(cells))]
        title = f" title='{html.escape(row_titles[i], quote=True)}'" if row_titles else ""
        parts.append(f"<tr{title}>" + "".join(f"<{t}{style}>{c}</{t}>" for t, c in zip(tags, cells)) + "</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)


def fmt(value) -> str:
    """Floats to 4 significant digits, anything else as str."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# ---------------------------------------------------------------------- TrainResult
def result_text(result) -> str:
    """Deterministic for a given run: no clock readings, metrics rounded to 4 digits."""
    head = (f"TrainResult({result.run_name!r}: {result.status}, {len(result.epochs)} epochs, "
            f"{result.steps} steps, {result.samples} samples, device={result.device.split(':')[0]}, "
            f"precision={result.precision}, batch={result.effective_batch_size})")
    metrics = "  ".join(f"{k}={fmt(v)}" for k, v in sorted(result.final_metrics.items()))
    lines = [head, f"  {metrics}" if metrics else "  no metrics"]
    if result.frozen_params:  # a model with a frozen part (LoRA adapters on a base): what trained
        lines.append(f"  parameters: {parameters_text(result)}")
    strategy = strategy_line(getattr(result, "strategy", None), getattr(result, "strategy_reason", ASKED_FOR))
    if strategy:
        lines.append(f"  {strategy}")
    plan = getattr(result, "memory_plan", "")
    if plan:  # the measures the memory plan took, and any an OOM added
        lines.append(f"  {plan if plan.startswith('plan: ') else 'plan: ' + plan}")
    if result.oom_recoveries or result.skipped_steps:
        lines.append(f"  oom_recoveries={result.oom_recoveries} (micro-batch {result.micro_batch_size}), "
                     f"skipped_fp16_steps={result.skipped_steps}")
    if result.stop_reason not in (None, result.status):
        lines.append(f"  stop: {result.stop_reason}")
    if result.best_step is not None:
        lines.append(f"  best: {best_text(result)}")
    return "\n".join(lines)


ASKED_FOR = "asked for"  # the reason of a strategy the user set


def strategy_line(strategy: str | None, reason: str) -> str:
    """`strategy: fsdp — DDP needs 4.2 MiB per device of 3.0 MiB; sharded: 2.1 MiB` where
    strategy="auto" chose FSDP (the memory estimate fits only sharded); "" otherwise."""
    if strategy != "fsdp" or reason == ASKED_FOR:
        return ""
    return f"strategy: fsdp — {reason}"


def parameters_text(r) -> str:
    """`1,792 trainable (1.94%), 90,432 frozen`, and where the merged model is."""
    share = 100 * r.trainable_params / max(1, r.trainable_params + r.frozen_params)
    merged = "; adapters merged into result.model" if getattr(r, "model", None) is not None else ""
    return f"{r.trainable_params:,} trainable ({share:.3g}%), {r.frozen_params:,} frozen{merged}"


def best_text(r) -> str:
    """`val_loss=0.1234 at step 40 (restored into the model)`: the best of the kept checkpoints."""
    restored = "restored into the model" if r.restored_best else "on disk; restore_best=True would load it at the end"
    return f"{r.best_monitor}={fmt(r.best_value)} at step {r.best_step} ({restored})"


def _samples_text(r) -> str:
    """`7,190 samples`; a resumed or continued fit: `1,438 samples in this fit of 7,190`."""
    before = getattr(r, "start_samples", 0)
    if not before:
        return f"{r.samples:,} samples"
    return f"{r.samples - before:,} samples in this fit of {r.samples:,}"


def summary_rows(r) -> list[tuple[str, str]]:
    """(name, text) pairs describing a TrainResult: the HTML summary and `gpunb demo` print these."""
    reason = f" ({r.stop_reason})" if r.stop_reason not in (None, r.status) else ""
    # Only what is known: a job that has not started (or was cancelled before it set up) has no
    # precision, batch or timings yet.
    rows = [("status", r.status + reason), *([("device", r.device)] if r.device else []),
            *([("precision", r.precision + (f" ({r.precision_reason})" if r.precision_reason else ""))]
              if r.precision else []),
            *([("batch", f"{r.batch_size} x {r.grad_accum} accumulation x {r.world_size} "
                         f"device(s) (micro-batch {r.micro_batch_size})")] if r.batch_size else []),
            *([("batch size", r.batch_size_reason)] if r.batch_size_reason else []),
            ("progress", progress_text(r)),
            *([("parameters", parameters_text(r))] if r.frozen_params else []),
            *([("wall time", f"{r.wall_time_s:.1f} s ({_samples_text(r)}, {r.samples_per_s:,.0f}/s)")]
              if r.wall_time_s else [])]
    if r.wall_time_s:
        share = 100 * r.data_wait_s / r.wall_time_s
        rows.append(("data wait", f"{r.data_wait_s:.2f} s ({share:.1f}% of wall time)"))
    if r.achieved_tflops is not None:
        rows.append(("compute", compute_text(r.achieved_tflops, r.mfu, r.peak_tflops)
                     + f", {si(r.flops_per_step)} FLOPs per step"))
    if r.tokens_per_s is not None:
        rows.append(("tokens", f"{r.tokens_per_s:,.0f}/s"))
    if r.compilation:
        rows.append(("compile", compile_text(r.compilation)))
    if r.peak_memory_mb is not None:
        rows.append(("peak memory", f"{r.peak_memory_mb:,.0f} MiB"))
    if r.energy_j is not None:
        rows.append(("energy", f"{r.energy_wh:.3f} Wh ({r.joules_per_sample:.4f} J/sample)"))
    strategy = strategy_line(getattr(r, "strategy", None), getattr(r, "strategy_reason", ASKED_FOR))
    if strategy:
        rows.append(("strategy", strategy.removeprefix("strategy: ")))
    if getattr(r, "memory_plan", ""):
        rows.append(("memory plan", r.memory_plan))
    if r.oom_recoveries:
        rows.append(("OOM recoveries", f"{r.oom_recoveries} (micro-batch now {r.micro_batch_size})"))
    if r.skipped_steps:
        rows.append(("skipped fp16 steps", str(r.skipped_steps)))
    if r.checkpoint_path:
        rows.append(("checkpoint", r.checkpoint_path))
    if r.best_step is not None:
        rows.append(("best checkpoint", f"{best_text(r)}: {r.best_checkpoint}"))
    if r.history:
        rows.append(("last loss", fmt(r.history[-1]["loss"])))  # the last log interval's mean
    rows += [(k, fmt(v)) for k, v in sorted(r.final_metrics.items())]
    return rows


def compile_text(info: dict) -> str:
    """`CUDA graphs from step 13: compile 11.2 s, 1.93x faster (3.10 -> 1.61 ms a step); launch-bound: ...`"""
    if info.get("mode") is None:
        return info.get("reason", "")
    how = {"reduce-overhead": "CUDA graphs", "step-graph": "one CUDA graph a step"}.get(
        info["mode"], f"torch.compile ({info['mode']})")
    text = f"{how} from step {info['at_step']}"
    if info.get("speedup") is not None:
        cost = "capture" if info["mode"] == "step-graph" else "compile"
        text += (f": {cost} {info['compile_s']:.1f} s, {info['speedup']:.2f}x faster "
                 f"({info['eager_step_ms']:.2f} -> {info['compiled_step_ms']:.2f} ms a step)")
    return f"{text}; {info['reason']}"


def compute_text(achieved_tflops: float, mfu: float | None, peak_tflops: float | None) -> str:
    """`312 TFLOPS, MFU 31.5% of 989`: model FLOPs per second and their share of the dense peak.

    The unit follows the size (a CPU's `808 MFLOPS`, not `0.000808 TFLOPS`); the peak stays in TFLOPS.
    """
    number, _, prefix = si(achieved_tflops * 1e12).partition(" ")
    text = f"{number} {prefix}FLOPS"
    return text if mfu is None else f"{text}, MFU {100 * mfu:.1f}% of {peak_tflops:g}"


def live_compute_text(state) -> str | None:
    """compute_text from the summary's FLOPs and the last interval's step time; None when unknown."""
    per_sample = (getattr(state, "summary", None) or {}).get("train_flops")  # a stand-in may carry none
    step_ms = state.latest.get("step_time_ms")
    plan = getattr(state, "plan", None)
    batch = plan.batch_size if plan is not None else getattr(state.config, "batch_size", None)
    if not per_sample or not step_ms or not isinstance(batch, int):
        return None
    # FLOPs per optimizer step / seconds per step / 1e12
    achieved = per_sample * batch * state.config.grad_accum * getattr(state, "world_size", 1) / step_ms / 1e9
    peak = getattr(state, "peak_tflops", None)
    return compute_text(achieved, achieved / peak if peak else None, peak)


def progress_text(r) -> str:
    """`epoch 25 of 200, step 1,125 of 36,000`: how far the run got."""
    reached = max([row["epoch"] + 1 for row in [*r.epochs[-1:], *r.history[-1:]]], default=0)
    planned = r.config.get("epochs")
    epochs = f"epoch {reached}" + (f" of {planned}" if planned else "")
    steps = f"step {r.steps:,}" + (f" of {r.total_steps:,}" if r.total_steps else "")
    return f"{epochs}, {steps}"


def result_html(r) -> str:
    series = r.loss_series()
    chart = as_image(loss_chart(series["train"], series.get("val", []), x_max=r.steps), f"loss of {r.run_name}")
    return (f"<div class='gpunb-result'><b>{html.escape(r.run_name)}</b>"
            f"<div style='display:flex;gap:1.5em;flex-wrap:wrap;align-items:flex-start'>"
            f"{html_table(summary_rows(r), key_column=True)}{chart}</div>{epoch_table_html(r.epochs)}</div>")


def epoch_table_html(epochs: list[dict]) -> str:
    """One row per epoch: train_loss (the epoch's mean), the val_* metrics, the epoch's time."""
    if not epochs:
        return ""
    val = sorted({k for row in epochs for k in row if k.startswith("val_")}, key=lambda k: (k != "val_loss", k))
    rows, previous = [], 0.0
    for row in epochs:
        elapsed = row.get("elapsed_s")
        took = "-" if elapsed is None else format_duration(max(0.0, elapsed - previous))
        previous = elapsed if elapsed is not None else previous
        rows.append([str(row["epoch"] + 1), *(fmt(row[k]) if k in row else "" for k in ["train_loss", *val]), took])
    return html_table(rows, ["epoch", "train_loss", *val, "time"], css_class="gpunb-epochs",
                      align="right", pad="0 .6em")


def plot_losses(r, ax=None):
    """A TrainResult's loss curves with matplotlib; returns the Axes."""
    ax = _axes(ax, "TrainResult.plot()")
    for name, points in r.loss_series().items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if name == "val" else None, label=f"{name} loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    return ax


# ---------------------------------------------------------------------- RunSummary
def summary_text(s) -> str:
    """Deterministic for a model, data and settings: the free memory (a machine fact) is left
    out; `summary_html` and the progress output show it."""
    run = getattr(s, "run", "")  # older summaries have none
    named = f"{run!r}: {s.model}, " if run and run != s.model else f"{s.model!r}: "
    head = (f"RunSummary({named}{s.params:,} parameters ({s.trainable_params:,} trainable, "
            f"{s.frozen_params:,} frozen), batch {s.batch_size}, device={s.device}, precision={s.precision})")
    lines = [head, f"  FLOPs per sample: {flops_text(s)}", f"  memory: {memory_text(s)}"]
    if getattr(s, "strategy", ""):
        lines.append(f"  {s.strategy}")
    if getattr(s, "plan", ""):
        lines.append(f"  {s.plan}")
    return "\n".join(lines)


def flops_text(s) -> str:
    if s.train_flops is None and s.forward_flops is None:
        return "not counted" + (f" ({s.activations_note})" if s.activations_note.startswith("not") else "")
    both = f", {si(s.train_flops)} forward + backward" if s.train_flops is not None else ""
    return f"{si(s.forward_flops)} forward{both}"


def memory_text(s) -> str:
    """`weights 4.9 KiB + gradients ... = 54 KiB` with what each part is."""
    parts = [f"weights {format_bytes(s.weights_bytes)}", f"gradients {format_bytes(s.gradients_bytes)}"]
    if s.optimizer_bytes is not None:
        parts.append(f"optimizer {format_bytes(s.optimizer_bytes)} ({s.optimizer_note})")
    if s.ema_bytes:
        parts.append(f"weight average {format_bytes(s.ema_bytes)}")
    if s.activations_bytes is not None:
        parts.append(f"activations {format_bytes(s.activations_bytes)} ({s.activations_note})")
    return " + ".join(parts) + f" = {format_bytes(s.estimated_bytes)}"


def free_memory_text(s) -> str:
    """`of 70.2 GiB free GPU memory (fits)`: the estimate against the machine's memory."""
    if s.free_bytes is None:
        return f"free {s.memory_kind} memory unknown"
    verdict = "fits" if s.fits else "does NOT fit: lower the batch size or use bf16 / activation checkpointing"
    return f"{format_bytes(s.estimated_bytes)} of {format_bytes(s.free_bytes)} free {s.memory_kind} memory ({verdict})"


def summary_html(s) -> str:
    run = getattr(s, "run", "")
    rows = [("run", run)] if run and run != s.model else []
    rows += [("model", f"{s.model}: {s.params:,} parameters ({s.trainable_params:,} trainable, "
                      f"{s.frozen_params:,} frozen)"),
            ("batch", f"{s.batch_size} on {s.device}, precision {s.precision}"),
            ("FLOPs per sample", flops_text(s)), ("memory", memory_text(s)), ("against", free_memory_text(s))]
    if getattr(s, "strategy", ""):
        rows.append(("strategy", s.strategy.removeprefix("strategy: ")))
    if getattr(s, "plan", ""):
        rows.append(("memory plan", s.plan))
    return f"<div class='gpunb-summary'>{html_table(rows, key_column=True)}</div>"


def si(value) -> str:
    """`7.42 K`, `1.3 G`: counts with an SI prefix, 3 significant digits."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g}"


def format_bytes(count: int) -> str:
    """`512 B`, `4.9 KiB`, `1.2 GiB`."""
    for factor, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if count >= factor:
            return f"{count / factor:.1f} {unit}"
    return f"{count} B"


# ---------------------------------------------------------------------- LRFinderResult
def lr_find_text(r) -> str:
    rate = f"{r.suggestion:.2e}" if r.suggestion else "none (the loss never fell)"
    return (f"LRFinderResult: suggested lr {rate} after {len(r.lrs)} steps "
            f"({r.lrs[0]:.0e} to {r.lrs[-1]:.0e}"
            f"{', stopped when the loss diverged' if r.stopped_early else ''})"
            + (f"\nApply it with: %%gputrain --lr {r.suggestion:.2e}" if r.suggestion else ""))


def lr_find_html(r) -> str:
    # Plot against log10(lr) so the sweep reads evenly from left to right.
    points = [(math.log10(lr), loss) for lr, loss in zip(r.lrs, r.losses)]
    names, series = ["smoothed loss"], [points]
    if r.suggestion:
        names.append("suggested")
        series.append([min(points, key=lambda p: abs(p[0] - math.log10(r.suggestion)))])
    chart = as_image(line_chart("loss (smoothed)", names, series, x_label="log10(learning rate)",
                                width=420, height=210, legend=110), "learning-rate range test")
    text = html.escape(lr_find_text(r)).replace("\n", "<br>")
    return f"<div class='gpunb-lr-find'>{chart}<div>{text}</div></div>"


def plot_lr_find(r, ax=None):
    """The sweep's smoothed loss against the learning rate (log axis); returns the Axes."""
    ax = _axes(ax, "LRFinderResult.plot()")
    ax.plot(r.lrs, r.losses)
    ax.set_xscale("log")
    if r.suggestion:
        ax.axvline(r.suggestion, color="tab:orange", linestyle="--", label=f"{r.suggestion:.1e}")
        ax.legend()
    ax.set_xlabel("learning rate")
    ax.set_ylabel("smoothed loss")
    return ax


def _axes(ax, caller: str):
    if ax is not None:
        return ax
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        from gpunb.errors import GpunbError

        raise GpunbError(f"{caller} needs matplotlib.",
                         "`pip install matplotlib`, or display the result for an inline SVG.") from error
    return plt.subplots(figsize=(6, 3.2))[1]


# ---------------------------------------------------------------------- terminal progress
class ProgressPrinter:
    """One line per log interval (terminal IPython, scripts); rewritten in place on a TTY.

    A plain callback: it reads the fields of the run state it is handed.
    """

    def __init__(self, stream=None, min_interval_s: float = 0.5):
        self.stream = stream or sys.stdout
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._tty = getattr(self.stream, "isatty", lambda: False)()

    def on_fit_start(self, state) -> None:
        plain = getattr(state, "summary", None)
        if plain:  # the run's summary first: parameters, FLOPs, memory against free memory
            summary = SimpleNamespace(**plain)
            self._write(f"{summary_text(summary)}\n  {free_memory_text(summary)}", final=True)

    def on_log(self, state, metrics) -> None:
        now = time.monotonic()
        if now - self._last < self.min_interval_s:
            return
        self._last = now
        self._write(progress_line(state))

    def on_epoch_end(self, state, metrics) -> None:
        values = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()
                           if isinstance(v, float))
        self._write(f"epoch {state.epoch + 1}: {values}", final=True)

    def on_fit_end(self, state) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def _write(self, line: str, final: bool = False) -> None:
        if self._tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def progress_line(state) -> str:
    """`step 120/450 (27%)  epoch 1/3  loss 0.412  3,210 samples/s  elapsed 4s  ETA 12s`"""
    return "  ".join(progress_parts(state, with_loss=True))


def progress_parts(state, with_loss: bool) -> list[str]:
    """The pieces of a progress line: step, epoch, (loss), throughput, elapsed time, ETA."""
    latest = state.latest
    total = f"/{state.total_steps}" if state.total_steps else ""
    percent = f" ({100 * state.progress:.0f}%)" if state.progress is not None else ""
    parts = [f"step {state.step}{total}{percent}",
             f"epoch {state.epoch + 1}{epochs_suffix(state)}"]
    if with_loss and "loss" in latest:
        parts.append(f"loss {latest['loss']:.4g}")
    if latest.get("samples_per_s"):
        parts.append(f"{latest['samples_per_s']:,.0f} samples/s")
    compute = live_compute_text(state)
    if compute:
        parts.append(compute)
    parts.append(f"elapsed {format_duration(time.time() - state.started_at)}")
    stopping = getattr(state, "stop_reason", None)
    if stopping:  # the loop ends after this step; a checkpoint may still be written
        parts.append(f"stopping after this step ({stopping})")
        return parts
    eta = eta_left(state)
    if eta is not None:
        parts.append(f"ETA {format_duration(eta)}")
    elif not latest:  # before the first log: set-up, a compile or the first steps are running
        parts.append("warming up")
    return parts


def epochs_suffix(state) -> str:
    """"/3" when the run has a set number of epochs; nothing when max_steps decides."""
    plan = getattr(state, "plan", None)  # a continued fit's epochs count on (runtime/plan.py)
    epochs = plan.epochs if plan is not None else state.config.epochs
    return f"/{epochs}" if epochs else ""


def eta_left(state, now: float | None = None) -> float | None:
    """Seconds left: the runtime's newest estimate (runtime/eta.py), counted down since it was
    made. The dashboard and the run registry (so the sidebar) both read this."""
    eta = getattr(state, "eta", None)
    if eta is None or not state.total_steps:
        return None
    seconds, made_at = eta
    return max(0.0, seconds - ((time.time() if now is None else now) - made_at))
