"""Which checkpoint a resumed run starts from (`resume=`), and which run directory it writes into.

A resumed run goes on in the directory of the checkpoint it resumed when that checkpoint
is the directory's newest (nothing after it to lose) and no live run holds the
directory. Otherwise it starts a new run directory, and its checkpoints record where it
came from (`origin`). It never writes into the other directory: the checkpoints saved
there after the resumed step (the future the resume abandons) are kept as they are, and
a live run there goes on undisturbed. `resume="last"` and `resume="best"`, which pick a
checkpoint by themselves, refuse to pick a live run's.
"""

from __future__ import annotations

from pathlib import Path

from gpunb.errors import GpunbError
from gpunb.runtime.state import checkpoint_files as ckpt
from gpunb.runtime.state.best_k import find_best
from gpunb.runtime.state.run_lock import RunLock, describe, owner_of


def find_checkpoint(resume, checkpoint_dir) -> Path:
    """The file `resume` points at: True/"last" is the newest in checkpoint_dir (any run);
    "best" the best checkpoint of the newest run that kept best ones (best_k.py)."""
    return _candidates(resume, checkpoint_dir)[0]


def open_checkpoint(resume, checkpoint_dir) -> tuple[Path, dict, str | None]:
    """The checkpoint `resume` means, read: (its path, what it holds, a warning to show or None).

    Where `resume` picks the newest checkpoint itself (True, "last", a directory), a newest file
    that cannot be read at all (truncated, empty, random bytes) gives way to the newest one that
    can, and the warning names both; the unreadable files stay as they are. A file named by its
    path, and "best", are read as they are or refused: never swapped for another."""
    candidates = _candidates(resume, checkpoint_dir)
    if len(candidates) == 1 and not _picks_newest(resume):
        return candidates[0], ckpt.load_checkpoint(candidates[0]), None
    skipped = []
    for path in candidates:
        try:
            return path, ckpt.load_checkpoint(path), _fell_back(skipped, path)
        except ckpt.UnreadableCheckpoint as error:
            skipped.append(error)
    raise _none_readable(resume, checkpoint_dir if resume in (True, "last") else resume, skipped)


def _picks_newest(resume) -> bool:
    return resume in (True, "last") or (resume != "best" and Path(resume).is_dir())


def _candidates(resume, checkpoint_dir) -> list[Path]:
    """Where `resume` picks the newest checkpoint itself, every one it could pick, newest first;
    else the one file it names."""
    if resume == "best":
        return [find_best(checkpoint_dir)]
    if resume in (True, "last"):
        found = ckpt.list_checkpoints(checkpoint_dir)
        if not found:
            raise GpunbError(f"resume='last' found no checkpoint in {checkpoint_dir!s}.",
                             "train once with `checkpoint_dir` set, or drop `resume` to start fresh.")
        return found[::-1]
    path = Path(resume)
    if path.is_dir():
        found = ckpt.list_checkpoints(path)
        if not found:
            raise GpunbError(f"No checkpoint (step-*.pt) in the directory {path!s}.",
                             "point `resume` at a checkpoint file or at a directory that has one.")
        return found[::-1]
    if not path.exists():
        raise GpunbError(f"The checkpoint {path!s} does not exist.",
                         "check the path, or use `resume='last'` with `checkpoint_dir`.")
    return [path]


def _fell_back(skipped: list, path: Path) -> str | None:
    """The one warning of a resume that took an older checkpoint: which could not be read, which was taken."""
    if not skipped:
        return None
    named = "; ".join(f"{error.path} ({error.cause})" for error in skipped)
    newest = ("The newest checkpoint cannot be read" if len(skipped) == 1
              else f"The {len(skipped)} newest checkpoints cannot be read")
    return (f"{newest}: {named}. Resuming from {path}, the newest readable one, instead; the unreadable "
            "files are left as they are.")


def _none_readable(resume, directory, skipped: list) -> GpunbError:
    named = "; ".join(f"{error.path.name} ({error.cause})" for error in skipped)
    found = "the one checkpoint" if len(skipped) == 1 else f"any of the {len(skipped)} checkpoints"
    return GpunbError(f"resume={resume!r} cannot read {found} in {directory}: each is corrupt or not a "
                      f"torch file: {named}.",
                      "start fresh without `resume` (the unreadable files are left as they are), or point "
                      "`resume` at a readable checkpoint of another run.")


def refuse_live_pick(plan, path: Path) -> None:
    """Before anything loads: a checkpoint that `resume="last"`/`"best"` picked in a live run's
    directory is refused, naming that run (a path given on purpose starts a new directory)."""
    if plan.resume not in (True, "last", "best") or not plan.checkpoint_dir:
        return
    lock, live = _try_lock(path.parent, None)
    if lock is not None:
        lock.release()  # free: claim() takes it again once everything has loaded
    if live is not None:
        raise _live_run_error(plan.resume, path, live)


def claim(plan, state, path: Path, payload: dict) -> tuple[RunLock | None, dict]:
    """Decide where the run resumed from `path` writes (rank 0). Returns the lock on the
    directory it goes on in (None for a new directory, locked at its first save) and the notes
    for `result.resumed_from`: `directory`, `origin` and, for a new directory, `note`."""
    source = path.parent
    lock, live = _try_lock(source, state.run_name)
    later = ckpt.later_checkpoints(source, payload["step"])
    if lock is not None and not later and _own_run_directory(plan, source):
        state.checkpoint_run = ckpt.run_id_of(source)
        return lock, {"directory": str(source), "origin": payload.get("origin")}
    if lock is not None:
        lock.release()
    state.checkpoint_run = ckpt.new_run_id()
    directory = ckpt.run_directory(plan.checkpoint_dir, state.checkpoint_run)
    origin = {"run": payload.get("run_id") or ckpt.run_id_of(source), "path": str(path), "step": payload["step"]}
    return None, {"directory": str(directory), "origin": origin,
                  "note": _why_new(plan, source, directory, payload["step"], later, live)}


def _try_lock(directory: Path, run_name: str | None) -> tuple[RunLock | None, dict | None]:
    """The lock on a run directory, or (None, what the live run holding it recorded)."""
    if ckpt.run_id_of(directory) is None:
        return None, None
    try:
        lock = RunLock.acquire(directory, {"run_name": run_name})
    except OSError:  # a directory we may read but not write: not one to go on in
        return None, None
    return (lock, None) if lock is not None else (None, owner_of(directory))


def _own_run_directory(plan, directory: Path) -> bool:
    """Whether `directory` is a run directory of this run's checkpoint_dir."""
    inside = Path(plan.checkpoint_dir) / directory.name
    return inside.exists() and inside.resolve() == directory.resolve()


def _why_new(plan, source: Path, directory: Path, step: int, later: list[Path], live: dict | None) -> str:
    new = f"this run writes its checkpoints into a new directory, {directory.name}"
    if live is not None:
        who = describe(live)
        return f"{who[0].upper()}{who[1:]}, still trains in {source.name}: {new}."
    if later:
        return (f"{source.name} holds {len(later)} checkpoint(s) saved after step {step} (up to "
                f"{later[-1].name}); they are kept, and {new}, which records where it came from.")
    if not _own_run_directory(plan, source):
        return f"{source} is not a run directory of checkpoint_dir={str(plan.checkpoint_dir)!r}: {new}."
    return f"{source.name} cannot be written: {new}."


def _live_run_error(resume, path: Path, live: dict) -> GpunbError:
    return GpunbError(
        f"resume={resume!r} picked {path}, a checkpoint of {describe(live)}. That run is still "
        f"training in {path.parent}: resuming it here would have two runs write, and prune, the same "
        "checkpoints.",
        "wait for that run to end (or stop it), resume your own run's checkpoint by its path "
        f"(`resume='<path>'`), or use another `checkpoint_dir`. `resume='{path}'` starts a new run "
        "directory from that checkpoint and leaves the live run alone.")
