"""A monitored validation metric: its name, which way is better, and whether a run produces it.

Best checkpoints (state/best_k.py) and EarlyStopping (early_stopping.py) both judge "better" here.
"""

from __future__ import annotations

import math

from gpunb.config import check_mode
from gpunb.errors import GpunbError

# A metric whose name holds one of these grows as the model improves; any other shrinks.
_HIGHER_IS_BETTER = ("acc", "f1", "auroc", "auc", "precision", "recall", "iou", "dice", "map", "r2", "score")


def default_mode(monitor: str) -> str:
    """"max" for accuracy-like names (acc, f1, auroc, precision, recall, ...), else "min"."""
    name = monitor.lower()
    return "max" if any(word in name for word in _HIGHER_IS_BETTER) else "min"


class Monitor:
    """`name` (e.g. "val_loss") judged by `mode` ("min"/"max"; None: by the name)."""

    def __init__(self, name: str, mode: str | None = None):
        self.name = name
        self.mode = check_mode(mode, "The monitor") or default_mode(name)

    @property
    def worst(self) -> float:
        return math.inf if self.mode == "min" else -math.inf

    def better(self, value: float, than: float, min_delta: float = 0.0) -> bool:
        """Strictly better by more than `min_delta`; a NaN/inf value never is."""
        if not math.isfinite(value):
            return False
        return value < than - min_delta if self.mode == "min" else value > than + min_delta

    def value(self, metrics: dict) -> float | None:
        return metrics.get(self.name)

    def check_produced(self, names, owner: str) -> None:
        """Raise before training when validation will never produce this metric.

        `names`: the metrics validation produces (None: no validation data)."""
        if names is None:
            raise GpunbError(f"{owner} monitors {self.name!r}, a validation metric, and the run has no "
                             "validation data, so it is never measured.",
                             "pass `val_data` (in %%gputrain: define `val_data` in the cell), "
                             "or drop the monitor.")
        if self.name not in names:
            listed = ", ".join(f"`{n}`" for n in names)
            raise GpunbError(f"{owner} monitors {self.name!r}, and validation produces only {listed}.",
                             f"monitor one of those (e.g. `monitor='{names[0]}'`), or add the metric "
                             f"(`metrics={{'{self.name.removeprefix('val_')}': fn}}`).")

    def describe(self, value: float, step: int) -> str:
        return f"{self.name}={value:.4g} at step {step}"


def validation_names(objective, has_val: bool) -> tuple | None:
    """The metric names validation produces (`val_loss`, `val_<metric>`), None without val data.

    The names seen when preflight evaluated a val batch are exact; without that check, a
    loss_fn without metrics may also give the default `val_acc` (classification outputs).
    """
    if not has_val:
        return None
    if objective.val_names is not None:
        return objective.val_names
    if objective.step_fn is not None:  # the metrics of what step returns (a warning if it cannot be scored)
        return ("val_loss", *(f"val_{name}" for name in objective.metrics),
                *(objective.stateful.names() if objective.stateful is not None else ()))
    if objective.loss_fn is None:
        return ("val_loss",)
    extra = objective.metrics or {"acc": None}
    return ("val_loss", *(f"val_{name}" for name in extra))


def monitor_of(config) -> Monitor | None:
    """The run's monitor for best checkpoints: `config.monitor`, or val_loss when validating."""
    if not config.save_top_k:
        return None
    return Monitor(config.monitor or "val_loss", config.mode)
