"""The k best checkpoints of a run by a monitored validation metric.

They sit beside the last-N ones in the run's directory, as `best-step-<step>.pt`, in the
same exact-resume format. Pruning the best ones only ever removes `best-*` files, and
pruning the last-N ones only `step-*` files, so neither deletes a file the other keeps.
`best.json` in the directory lists the kept ones, best first, for `resume="best"`; a run
resumed into a new directory lists the best ones of the run it came from with the
directory that holds them (`dir`, relative to checkpoint_dir), and never removes them.
Each best file holds its own value, so an index that disagrees with the files (a kill
between two writes, a file deleted by hand, a truncated index) is rebuilt from them, with
a warning.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import torch

from gpunb.errors import GpunbError
from gpunb.runtime.state import checkpoint_files as ckpt
from gpunb.runtime.validation.monitor import Monitor

INDEX = "best.json"
_NAME = re.compile(r"^best-step-(\d{9})\.pt$")


def best_name(step: int) -> str:
    return f"best-step-{step:09d}.pt"


class BestCheckpoints:
    """Which checkpoints are the k best by `monitor`; every rank keeps the same list."""

    def __init__(self, monitor: Monitor, k: int):
        self.monitor, self.k = monitor, k
        self.kept: list[dict] = []  # {"step", "value", "file"[, "dir": another run's directory]}, best first

    def wants(self, value) -> bool:
        """Whether a checkpoint with this value enters the top k (ties keep the older one)."""
        if value is None or not self.monitor.better(value, self.monitor.worst):
            return False  # NaN/inf never ranks
        return len(self.kept) < self.k or self.monitor.better(value, self.kept[-1]["value"])

    def with_entry(self, step: int, value: float) -> list[dict]:
        """The list as it is once a checkpoint at `step` with `value` is kept."""
        entry = {"step": step, "value": float(value), "file": best_name(step)}
        ranked = [e for e in self.kept if e["step"] != step or e.get("dir")] + [entry]
        ranked.sort(key=lambda e: e["value"], reverse=self.monitor.mode == "max")  # stable: older first
        return ranked[:self.k]

    def write(self, directory: Path, kept: list[dict], step: int, payload: dict) -> Path:
        """Rank 0: write the checkpoint of `step` (one of `kept`), then the index, then drop the rest."""
        name = next(e["file"] for e in kept if e["step"] == step and not e.get("dir"))
        path = ckpt.write_checkpoint(directory, name, payload)
        self.commit(kept, directory)
        return path

    def commit(self, kept: list[dict], directory: Path | None) -> None:
        """Adopt `kept`; in `directory` (rank 0) write the index, then drop the best files it no
        longer lists: a kill in between leaves a file too many, never an index naming a lost one."""
        self.kept = kept
        if directory is None:
            return
        index = {"monitor": self.monitor.name, "mode": self.monitor.mode, "k": self.k, "kept": kept}
        ckpt.write_atomic(directory, INDEX, json.dumps(index, indent=1).encode())
        names = {e["file"] for e in kept if not e.get("dir")}
        for path in directory.iterdir():
            if _NAME.match(path.name) and path.name not in names:
                path.unlink(missing_ok=True)

    def kept_in(self, source: Path, checkpoint_dir) -> None:
        """After a resume from the run directory `source` into a new directory of `checkpoint_dir`:
        the kept files stay where they are, and the entries say where from there."""
        def where(entry: dict) -> str:
            directory = entry_path(source, entry).parent
            try:
                return os.path.relpath(directory, checkpoint_dir)
            except ValueError:  # another drive (Windows)
                return str(directory.resolve())

        # the entries whose file the abandoned run pruned since are gone: they rank nothing
        self.kept = [{**e, "dir": where(e)} for e in self.kept if entry_path(source, e).is_file()]

    @property
    def best(self) -> dict | None:
        return self.kept[0] if self.kept else None

    def state_dict(self) -> dict:
        return {"monitor": self.monitor.name, "mode": self.monitor.mode, "k": self.k, "kept": self.kept}

    def load_state_dict(self, state: dict | None) -> None:
        """From a checkpoint; values ranked by another metric or mode do not carry over."""
        if state and state["monitor"] == self.monitor.name and state["mode"] == self.monitor.mode:
            self.kept = [dict(e) for e in state["kept"]][:self.k]


def entry_path(directory: Path, entry: dict) -> Path:
    """Where a kept best checkpoint of the run in `directory` lies."""
    if entry.get("dir"):
        return Path(os.path.normpath(directory.parent / entry["dir"] / entry["file"]))
    return directory / entry["file"]


def find_best(checkpoint_dir) -> Path:
    """The best checkpoint of the run (under `checkpoint_dir`) that most recently kept best ones."""
    directory = Path(checkpoint_dir)
    runs = ([run for run in directory.glob("run-*") if _best_files(run) or (run / INDEX).is_file()]
            if directory.is_dir() else [])
    for run in sorted(runs, key=_last_change, reverse=True):
        kept = read_index(run)
        if kept:
            return entry_path(run, kept[0])
    raise GpunbError(f"resume='best' found no best checkpoint in {checkpoint_dir!s}.",
                     "train with `save_top_k=1` (and validation data) first, or use `resume='last'`.")


def read_index(run: Path) -> list[dict]:
    """The kept best checkpoints of the run directory `run`, best first: best.json's list when it
    agrees with the files, else the list rebuilt from the files, with a warning saying why."""
    index, problem = _load_index(run)
    rebuilt, monitor = _rank_files(run, index)
    listed = index.get("kept") if index else None
    if listed is not None and _ids(listed) == _ids(rebuilt):
        return listed
    problem = problem or _disagreement(run, listed, rebuilt)
    shown = (f"; the best now is {rebuilt[0]['file']} ({monitor}={rebuilt[0]['value']:.6g})" if rebuilt
             else "; no best checkpoint is left")
    warnings.warn(f"{run / INDEX} {problem}: the best checkpoints were ranked again from the files "
                  f"themselves{shown}.", RuntimeWarning, stacklevel=3)
    return rebuilt


def _disagreement(run: Path, listed: list[dict], rebuilt: list[dict]) -> str:
    missing = [e["file"] for e in listed if not entry_path(run, e).is_file()]
    if missing:
        return f"names {', '.join(missing)}, no longer on disk"
    left_out = [e["file"] for e in rebuilt if (e.get("dir"), e["step"]) not in _ids(listed)]
    if left_out:
        return f"leaves out {', '.join(left_out)}"
    return "ranks the files in another order than their values"


def _load_index(run: Path) -> tuple[dict | None, str | None]:
    try:
        index = json.loads((run / INDEX).read_text())
    except FileNotFoundError:
        return None, "is missing"
    except (OSError, ValueError) as error:
        return None, f"cannot be read ({type(error).__name__}: {error})"
    if not isinstance(index, dict) or not isinstance(index.get("kept"), list):
        return None, "is not a best-checkpoint index"
    return index, None


def _rank_files(run: Path, index: dict | None) -> tuple[list[dict], str | None]:
    """The k best of the checkpoints on disk: the run's own best files (each holds its value)
    and the other runs' ones its files or index list, ranked as BestCheckpoints ranks them."""
    found, ranking = {}, None
    if index is not None and {"monitor", "mode"} <= set(index):
        ranking = index  # unless the newest readable best file says otherwise
    for path in sorted(_best_files(run), reverse=True):  # newest first: its settings rank
        saved = _saved_best(path)
        if saved is None:
            continue  # unreadable: no longer one of the best
        if ranking is None or ranking is index:
            ranking = saved
        if (saved["monitor"], saved["mode"]) != (ranking["monitor"], ranking["mode"]):
            continue  # ranked by another metric
        for entry in saved["kept"]:
            own = not entry.get("dir") and entry["file"] == path.name
            if own or entry.get("dir"):
                found.setdefault((entry.get("dir"), entry["step"]), entry)
    for entry in (index or {}).get("kept", []):
        if entry.get("dir"):
            found.setdefault((entry["dir"], entry["step"]), entry)
    if ranking is None:
        return [], None
    entries = [e for e in found.values() if entry_path(run, e).is_file()]
    sign = -1 if ranking["mode"] == "max" else 1
    entries.sort(key=lambda e: (sign * e["value"], e["step"]))  # ties: the older first, as when kept
    return entries[:ranking.get("k") or (index or {}).get("k") or len(entries)], ranking["monitor"]


def _saved_best(path: Path) -> dict | None:
    """The best-k state a best file was saved with (its own entry among `kept`); reads no tensor
    data (mmap)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        saved = payload["best"]
        saved["monitor"], saved["mode"], saved["kept"]  # noqa: B018 - the fields it must have
    except Exception:  # noqa: BLE001 - any unreadable file is simply not counted
        return None
    return saved


def _best_files(run: Path) -> list[Path]:
    return [p for p in run.iterdir() if _NAME.match(p.name)] if run.is_dir() else []


def _last_change(run: Path) -> int:
    times = []
    for path in [*_best_files(run), run / INDEX]:
        try:
            times.append(path.stat().st_mtime_ns)
        except FileNotFoundError:  # pruned meanwhile by a run that lives in the same checkpoint_dir
            pass
    return max(times, default=0)


def _ids(entries: list[dict]) -> list:
    return [(e.get("dir"), e["step"]) for e in entries]
