"""TrainResult: what a run did, for people (HTML, text, plot) and for code (fields)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from gpunb.charts import loss_chart
from gpunb.units import format_duration


@dataclass
class TrainResult:
    run_name: str
    history: list = field(default_factory=list)  # per log interval: step, epoch, loss (the interval's mean), lr, ...
    epochs: list = field(default_factory=list)  # per epoch: epoch, step, train_loss (the epoch's mean), val_*, elapsed_s
    final_metrics: dict = field(default_factory=dict)  # train_loss of the last epoch, the last val_* metrics
    config: dict = field(default_factory=dict)  # the config actually used
    device: str = "cpu"
    precision: str = "32"
    precision_reason: str = ""
    batch_size: int = 0  # samples per micro-batch as loaded
    batch_size_reason: str = ""  # how batch_size="auto" chose it ("" when it was given)
    micro_batch_size: int = 0  # after OOM recovery (== batch_size when none happened)
    grad_accum: int = 1  # loaded batches per optimizer step
    world_size: int = 1
    steps: int = 0
    total_steps: int | None = None  # optimizer steps the run was set to take, when known
    samples: int = 0
    wall_time_s: float = 0.0
    data_wait_s: float = 0.0  # host time spent waiting for the next batch
    compute_s: float = 0.0  # the rest of the training loop (steps, logging)
    validation_s: float = 0.0
    peak_memory_mb: float | None = None  # accelerator memory; None on CPU
    oom_recoveries: int = 0
    skipped_steps: int = 0  # fp16 steps skipped by the GradScaler (inf/NaN gradients)
    checkpoint_path: str | None = None
    resumed_from: dict | None = None  # path, run, step, epoch, saved_at of the checkpoint resumed
    interrupted: bool = False
    stop_reason: str | None = None
    energy_j: float | None = None  # GPU energy over the run (NVIDIA only)
    per_rank: list = field(default_factory=list)  # timings of each rank in multi-process runs

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step across all devices."""
        return self.batch_size * self.grad_accum * self.world_size

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_time_s if self.wall_time_s else 0.0

    @property
    def energy_wh(self) -> float | None:
        return None if self.energy_j is None else self.energy_j / 3600

    @property
    def joules_per_sample(self) -> float | None:
        return None if self.energy_j is None or not self.samples else self.energy_j / self.samples

    @property
    def status(self) -> str:
        if self.interrupted:
            return "interrupted"
        return "stopped" if self.stop_reason else "completed"

    def loss_series(self) -> dict:
        series = {"train": [(row["step"], row["loss"]) for row in self.history if "loss" in row]}
        val = [(row["step"], row["val_loss"]) for row in self.epochs if "val_loss" in row]
        if val:
            series["val"] = val
        return series

    def __repr__(self) -> str:
        """Deterministic for a given run: no clock readings, metrics rounded to 4 digits."""
        head = (f"TrainResult({self.run_name!r}: {self.status}, {len(self.epochs)} epochs, "
                f"{self.steps} steps, {self.samples} samples, device={self.device.split(':')[0]}, "
                f"precision={self.precision}, batch={self.effective_batch_size})")
        metrics = "  ".join(f"{k}={_fmt(v)}" for k, v in sorted(self.final_metrics.items()))
        lines = [head, f"  {metrics}" if metrics else "  no metrics"]
        if self.oom_recoveries or self.skipped_steps:
            lines.append(f"  oom_recoveries={self.oom_recoveries} (micro-batch {self.micro_batch_size}), "
                         f"skipped_fp16_steps={self.skipped_steps}")
        if self.stop_reason not in (None, self.status):
            lines.append(f"  stop: {self.stop_reason}")
        return "\n".join(lines)

    def summary_rows(self) -> list[tuple[str, str]]:
        reason = f" ({self.stop_reason})" if self.stop_reason not in (None, self.status) else ""
        rows = [("status", self.status + reason),
                ("device", self.device), ("precision", f"{self.precision} ({self.precision_reason})"),
                ("batch", f"{self.batch_size} x {self.grad_accum} accumulation x {self.world_size} "
                          f"device(s) (micro-batch {self.micro_batch_size})"),
                *([("batch size", self.batch_size_reason)] if self.batch_size_reason else []),
                ("progress", self.progress_text()),
                ("wall time", f"{self.wall_time_s:.1f} s ({self.samples:,} samples, {self.samples_per_s:,.0f}/s)")]
        if self.wall_time_s:
            share = 100 * self.data_wait_s / self.wall_time_s
            rows.append(("data wait", f"{self.data_wait_s:.2f} s ({share:.1f}% of wall time)"))
        if self.peak_memory_mb is not None:
            rows.append(("peak memory", f"{self.peak_memory_mb:,.0f} MiB"))
        if self.energy_j is not None:
            rows.append(("energy", f"{self.energy_wh:.3f} Wh ({self.joules_per_sample:.4f} J/sample)"))
        if self.oom_recoveries:
            rows.append(("OOM recoveries", f"{self.oom_recoveries} (micro-batch now {self.micro_batch_size})"))
        if self.skipped_steps:
            rows.append(("skipped fp16 steps", str(self.skipped_steps)))
        if self.checkpoint_path:
            rows.append(("checkpoint", self.checkpoint_path))
        if self.history:
            rows.append(("last loss", _fmt(self.history[-1]["loss"])))  # the last log interval's mean
        rows += [(k, _fmt(v)) for k, v in sorted(self.final_metrics.items())]
        return rows

    def progress_text(self) -> str:
        """`epoch 25 of 200, step 1,125 of 36,000`: how far the run got."""
        reached = max([row["epoch"] + 1 for row in [*self.epochs[-1:], *self.history[-1:]]], default=0)
        planned = self.config.get("epochs")
        epochs = f"epoch {reached}" + (f" of {planned}" if planned else "")
        steps = f"step {self.steps:,}" + (f" of {self.total_steps:,}" if self.total_steps else "")
        return f"{epochs}, {steps}"

    def _repr_html_(self) -> str:
        series = self.loss_series()
        svg = loss_chart(series["train"], series.get("val", []), x_max=self.steps)
        return (f"<div class='gpunb-result'><b>{html.escape(self.run_name)}</b>"
                f"<div style='display:flex;gap:1.5em;flex-wrap:wrap;align-items:flex-start'>"
                f"{html_table(self.summary_rows())}{svg}</div>{epoch_table_html(self.epochs)}</div>")

    def plot(self, ax=None):
        """Loss curves with matplotlib; returns the Axes."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as error:
            from gpunb.errors import GpunbError

            raise GpunbError("TrainResult.plot() needs matplotlib.",
                             "`pip install matplotlib`, or display the result for an inline SVG.") from error
        if ax is None:
            _fig, ax = plt.subplots(figsize=(6, 3.2))
        for name, points in self.loss_series().items():
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if name == "val" else None, label=f"{name} loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.legend()
        return ax


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def epoch_mean_loss(rows: list) -> float:
    """`train_loss`: the mean step loss over an epoch's log rows (each the mean of its interval)."""
    return sum(r["loss"] * r["steps"] for r in rows) / sum(r["steps"] for r in rows)


def last_epoch_train_loss(history: list) -> dict:
    """{"train_loss": the mean over the last epoch's log rows}, or {} before the first log."""
    if not history:
        return {}
    last = history[-1]["epoch"]
    return {"train_loss": epoch_mean_loss([row for row in history if row["epoch"] == last])}


def epoch_table_html(epochs: list[dict]) -> str:
    """One row per epoch: train_loss (the epoch's mean), the val_* metrics, the epoch's time."""
    if not epochs:
        return ""
    val = sorted({k for row in epochs for k in row if k.startswith("val_")}, key=lambda k: (k != "val_loss", k))
    columns = ["epoch", "train_loss", *val, "time"]
    head = "".join(f"<th style='text-align:right;padding:0 .6em'>{html.escape(c)}</th>" for c in columns)
    body, previous = [], 0.0
    for row in epochs:
        elapsed = row.get("elapsed_s")
        took = "-" if elapsed is None else format_duration(max(0.0, elapsed - previous))
        previous = elapsed if elapsed is not None else previous
        cells = [str(row["epoch"] + 1), *(_fmt(row[k]) if k in row else "" for k in ["train_loss", *val]), took]
        body.append("<tr>" + "".join(f"<td style='text-align:right;padding:0 .6em'>{html.escape(c)}</td>"
                                     for c in cells) + "</tr>")
    return (f"<table class='gpunb-epochs'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def html_table(rows: list[tuple[str, str]]) -> str:
    cells = "".join(f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(k)}</th>"
                    f"<td style='text-align:left'>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"
