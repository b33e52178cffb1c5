"""Checkpoints: one file per save, written atomically, read with weights_only=True.

A checkpoint holds everything needed to continue exactly: the run's RunState
(run_state.py: model, optimizer, scheduler, scaler, weight average, RNG states, the
position in the run and its history) and a header saying which run wrote it. The model's
state of a model with frozen parameters is what trains, beside a fingerprint of the rest
(`frozen`, trainable.py).

Each run writes into a directory of its own, `<checkpoint_dir>/run-<run id>/`, so
that runs sharing a checkpoint_dir never prune each other's files, and holds the
directory's lock while it trains (run_lock.py). Where a resumed run writes is
decided in resume_target.py.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import secrets
import tempfile
import time
from pathlib import Path

import torch

from gpunb.errors import GpunbError

FORMAT = "gpunb-checkpoint"
# The newest format read here. 2: `model` may hold only what trains (see `frozen`); 3: `frozen`
# digests every value (trainable.py), which a gpunb that reads 2 would take for another base.
VERSION = 3
_NAME = re.compile(r"^step-(\d{9})\.pt$")
_ANY_NAME = re.compile(r"^(?:best-)?step-(\d{9})\.pt$")  # last-N and best checkpoints
_RUN_DIR = "run-"
_TMP_PREFIX = ".tmp-"


def new_run_id() -> str:
    """Sortable by start time, unique across processes sharing a directory."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def run_directory(checkpoint_dir: str | os.PathLike, run_id: str) -> Path:
    return Path(checkpoint_dir) / f"{_RUN_DIR}{run_id}"


def probe_writable(directory: str | os.PathLike) -> None:
    """Create `directory` and write (then remove) a probe file there; OSError when it cannot."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".probe-", dir=directory)
    os.close(fd)
    os.unlink(probe)


def check_writable(directory: str | os.PathLike) -> None:
    """Checkpoints can be written in `directory`, checked before any training is done."""
    try:
        probe_writable(directory)
    except OSError as error:
        raise GpunbError(f"Cannot write checkpoints to {directory!s}: "
                         f"{type(error).__name__}: {error.strerror or error}.",
                         "pass a `checkpoint_dir` you can write to (e.g. one under your home "
                         "directory), or `checkpoint_dir=None` to train without checkpoints.") from error


def remove_leftovers(directory: str | os.PathLike) -> None:
    """Temp files of a save that was killed half-way (only this run writes in its directory)."""
    directory = Path(directory)
    if directory.is_dir():
        for leftover in directory.glob(f"{_TMP_PREFIX}*.pt"):
            leftover.unlink(missing_ok=True)


def save_checkpoint(directory: str | os.PathLike, payload: dict, step: int, keep_last: int) -> Path:
    """Write `payload` as `step-<step>.pt` in `directory` (the run's own); keep its newest `keep_last`."""
    directory = Path(directory)
    target = write_checkpoint(directory, f"step-{step:09d}.pt", payload)
    for old in run_checkpoints(directory)[:-keep_last]:
        old.unlink(missing_ok=True)
    return target


def write_checkpoint(directory: Path, name: str, payload: dict) -> Path:
    """A checkpoint file (gpunb's format header, then `payload`), written atomically."""
    # Whole checkpoints stay version 1, which an older gpunb reads; one that leaves out the frozen
    # weights is 3, which it refuses, asking for an upgrade, instead of finding weights missing.
    version = 3 if payload.get("frozen") else 1
    return write_atomic(directory, name, {"format": FORMAT, "version": version, **payload})


def write_atomic(directory: Path, name: str, payload) -> Path:
    """torch.save `payload` (or write bytes) as `directory/name`: all of it or nothing."""
    directory.mkdir(parents=True, exist_ok=True)
    remove_leftovers(directory)
    target = directory / name
    # Write to a temp file in the same directory, fsync, then rename: a crash at any
    # point leaves either the old checkpoint set or the new file, never half a file.
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".pt", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; follow the umask like open() does
        with os.fdopen(fd, "wb") as f:
            if isinstance(payload, bytes):
                f.write(payload)
            else:
                torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return target


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def run_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints of one run (its directory `directory`), oldest step first."""
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def later_checkpoints(directory: str | os.PathLike, step: int) -> list[Path]:
    """The checkpoints (last-N and best) in `directory` saved after `step`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    later = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _ANY_NAME.match(p.name))]
    return [p for s, p in sorted(later) if s > step]


def run_id_of(directory: Path) -> str | None:
    """The run id a run directory is named after (None: not a run directory)."""
    return directory.name[len(_RUN_DIR):] if directory.name.startswith(_RUN_DIR) else None


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in `directory` and in its runs' sub-directories, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = run_checkpoints(directory)
    for sub in directory.iterdir():
        if sub.name.startswith(_RUN_DIR) and sub.is_dir():
            found += run_checkpoints(sub)
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))


class UnreadableCheckpoint(GpunbError):
    """A file that cannot be read as a torch file at all (truncated, empty, random bytes): a choice
    of the newest checkpoint may fall back to an older one (resume_target.open_checkpoint)."""

    def __init__(self, path, cause: str):
        self.path, self.cause = Path(path), cause  # cause: what torch said of the file
        super().__init__(f"Cannot read the checkpoint {path!s}: it is corrupt or not a torch file ({cause}).",
                         "resume from an earlier checkpoint in the same directory, or start fresh without "
                         "`resume`.")


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Read a gpunb checkpoint; a corrupt or foreign file is a GpunbError that says so."""
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        refused = _refused_object(error)
        if refused is None:  # a malformed stream, not a refused object: the bytes are damaged
            raise _unreadable(path, error) from None
        raise GpunbError(
            f"gpunb will not load {path!s}: it holds Python objects other than tensors and plain "
            f"containers, and unpickling those could run code ({refused}).",
            "if you trust the file, load it yourself and save only state: "
            "`torch.save({'model': model.state_dict()}, 'weights.pt')` (state_dicts, tensors, "
            "numbers and strings), then load the weights with `model.load_state_dict(...)`.") from None
    except Exception as error:
        raise _unreadable(path, error) from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise GpunbError(f"{path!s} is a torch file but not a gpunb checkpoint.",
                         "to load plain weights use `model.load_state_dict(torch.load(path))` "
                         "and train without `resume`.")
    if payload.get("version", 0) > VERSION:
        raise GpunbError(f"{path!s} was written by a newer gpunb (format {payload['version']}).",
                         "upgrade gpunb to resume from it.")
    missing = [key for key in REQUIRED if key not in payload]
    if missing:
        raise GpunbError(f"The checkpoint {path!s} is incomplete: it has no {', '.join(map(repr, missing))} "
                         f"(it has {', '.join(map(repr, sorted(payload)))}).",
                         "resume from another checkpoint of the run, or start fresh without `resume`.")
    payload["config"] = json.loads(payload.get("config", "{}"))
    return payload


def _unreadable(path, error: BaseException) -> UnreadableCheckpoint:
    # torch words a malformed stream as a refusal of weights_only; what it refused is the context
    inner = error.__context__ if isinstance(error, pickle.UnpicklingError) and error.__context__ else error
    said = _first_line(inner)
    said = type(inner).__name__ if said == type(inner).__name__ else f"{type(inner).__name__}: {said}"
    try:
        size = f"{os.path.getsize(path):,} bytes"
    except OSError:
        size = "no longer there"
    return UnreadableCheckpoint(path, f"{size}; {said}")


# What every checkpoint holds since format version 1 (RunState.state_dict writes these and more;
# a field added to RunState later is optional here: older files load without it).
REQUIRED = ("model", "optimizer", "scheduler", "precision", "rng", "epoch", "batch_in_epoch", "step",
            "samples_seen", "splits", "history", "epochs")


def _refused_object(error: BaseException) -> str | None:
    """What torch's weights_only unpickler refused (a global it would have imported or called),
    without its advice to turn the check off; None when it refused a malformed stream instead
    (an unknown opcode in random bytes), which says nothing about code."""
    for line in str(error).splitlines():
        line = line.split(" Please use")[0].strip().rstrip(".")
        if any(word in line for word in _REFUSALS) and "weights_only" not in line:
            return line
    return None


# How the weights_only unpickler words the refusal of an object (a GLOBAL it will not import, a
# class it will not build, a function it will not call); any other refusal is of damaged bytes.
_REFUSALS = ("GLOBAL ", "allowlisted", "unrecognized function")


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip() and "weights_only" not in line]
    return lines[0] if lines else type(error).__name__


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
