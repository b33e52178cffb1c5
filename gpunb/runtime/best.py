"""The k best checkpoints of a run by a monitored validation metric.

They sit beside the last-N ones in the run's directory, as `best-step-<step>.pt`, in the
same exact-resume format. Pruning the best ones only ever removes `best-*` files, and
pruning the last-N ones only `step-*` files, so neither deletes a file the other keeps.
`best.json` in the directory lists the kept ones, best first, for `resume="best"`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from gpunb.errors import GpunbError
from gpunb.runtime import checkpoint as ckpt
from gpunb.runtime.monitor import Monitor

INDEX = "best.json"
_NAME = re.compile(r"^best-step-(\d{9})\.pt$")


def best_name(step: int) -> str:
    return f"best-step-{step:09d}.pt"


class BestCheckpoints:
    """Which checkpoints are the k best by `monitor`; every rank keeps the same list."""

    def __init__(self, monitor: Monitor, k: int):
        self.monitor, self.k = monitor, k
        self.kept: list[dict] = []  # {"step", "value", "file"}, best first

    def wants(self, value) -> bool:
        """Whether a checkpoint with this value enters the top k (ties keep the older one)."""
        if value is None or not self.monitor.better(value, self.monitor.worst):
            return False  # NaN/inf never ranks
        return len(self.kept) < self.k or self.monitor.better(value, self.kept[-1]["value"])

    def with_entry(self, step: int, value: float) -> list[dict]:
        """The list as it is once a checkpoint at `step` with `value` is kept."""
        entry = {"step": step, "value": float(value), "file": best_name(step)}
        ranked = [e for e in self.kept if e["step"] != step] + [entry]
        ranked.sort(key=lambda e: e["value"], reverse=self.monitor.mode == "max")  # stable: older first
        return ranked[:self.k]

    def commit(self, kept: list[dict], directory: Path | None) -> None:
        """Adopt `kept`; in `directory` (rank 0) drop the other best files and write the index."""
        self.kept = kept
        if directory is None:
            return
        names = {e["file"] for e in kept}
        for path in directory.iterdir():
            if _NAME.match(path.name) and path.name not in names:
                path.unlink(missing_ok=True)
        index = {"monitor": self.monitor.name, "mode": self.monitor.mode, "kept": kept}
        ckpt.write_atomic(directory, INDEX, json.dumps(index, indent=1).encode())

    @property
    def best(self) -> dict | None:
        return self.kept[0] if self.kept else None

    def state_dict(self) -> dict:
        return {"monitor": self.monitor.name, "mode": self.monitor.mode, "k": self.k, "kept": self.kept}

    def load_state_dict(self, state: dict | None) -> None:
        """From a checkpoint; values ranked by another metric or mode do not carry over."""
        if state and state["monitor"] == self.monitor.name and state["mode"] == self.monitor.mode:
            self.kept = [dict(e) for e in state["kept"]][:self.k]


def find_best(checkpoint_dir) -> Path:
    """The best checkpoint of the run (under `checkpoint_dir`) that most recently kept best ones."""
    directory = Path(checkpoint_dir)
    indexes = sorted(directory.glob(f"run-*/{INDEX}"), key=lambda p: p.stat().st_mtime_ns) if directory.is_dir() else []
    for index in reversed(indexes):
        kept = json.loads(index.read_text()).get("kept") or []
        present = [index.parent / e["file"] for e in kept if (index.parent / e["file"]).exists()]
        if present:
            return present[0]
    raise GpunbError(f"resume='best' found no best checkpoint in {checkpoint_dir!s}.",
                     "train with `save_top_k=1` (and validation data) first, or use `resume='last'`.")
