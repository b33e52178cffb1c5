"""Checkpoints: one file per save, written atomically, read with weights_only=True.

A checkpoint holds everything needed to continue exactly: model, optimizer,
scheduler, precision (GradScaler) and RNG states, and the position in the run
(epoch, optimizer step, batches consumed in the epoch).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import torch

from gpunb.errors import GpunbError

FORMAT = "gpunb-checkpoint"
VERSION = 1
_NAME = re.compile(r"^step-(\d{9})\.pt$")


def save_checkpoint(directory: str | os.PathLike, payload: dict, step: int, keep_last: int) -> Path:
    """Write `payload` as `step-<step>.pt` in `directory`; keep the newest `keep_last`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"step-{step:09d}.pt"
    payload = {"format": FORMAT, "version": VERSION, **payload}
    # Write to a temp file in the same directory, fsync, then rename: a crash at any
    # point leaves either the old checkpoint set or the new file, never half a file.
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    for old in list_checkpoints(directory)[:-keep_last]:
        old.unlink(missing_ok=True)
    return target


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def find_checkpoint(resume, checkpoint_dir) -> Path:
    """The file `resume` points at: True/"last" is the newest in checkpoint_dir."""
    if resume in (True, "last"):
        found = list_checkpoints(checkpoint_dir)
        if not found:
            raise GpunbError(f"resume='last' found no checkpoint in {checkpoint_dir!s}.",
                             "train once with `checkpoint_dir` set, or drop `resume` to start fresh.")
        return found[-1]
    path = Path(resume)
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise GpunbError(f"No checkpoint (step-*.pt) in the directory {path!s}.",
                             "point `resume` at a checkpoint file or at a directory that has one.")
        return found[-1]
    if not path.exists():
        raise GpunbError(f"The checkpoint {path!s} does not exist.",
                         "check the path, or use `resume='last'` with `checkpoint_dir`.")
    return path


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Read a gpunb checkpoint; a corrupt or foreign file is a GpunbError that says so."""
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:
        raise GpunbError(f"Cannot read the checkpoint {path!s}: it is corrupt or not a torch file "
                         f"({type(error).__name__}: {str(error).splitlines()[0][:200]}).",
                         "resume from an earlier checkpoint in the same directory, "
                         "or start fresh without `resume`.") from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise GpunbError(f"{path!s} is a torch file but not a gpunb checkpoint.",
                         "to load plain weights use `model.load_state_dict(torch.load(path))` "
                         "and train without `resume`.")
    if payload.get("version", 0) > VERSION:
        raise GpunbError(f"{path!s} was written by a newer gpunb (format {payload['version']}).",
                         "upgrade gpunb to resume from it.")
    payload["config"] = json.loads(payload.get("config", "{}"))
    return payload


def config_json(config) -> str:
    """The config as JSON text (weights_only loading accepts strings, not arbitrary objects)."""
    return json.dumps(config.to_dict(), default=repr)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX); harmless where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
