"""The step losses of a log interval, the first non-finite one, and what a run does about it.

The loop only appends each step's loss (a detached 0-dim device tensor) to a host-side
list: no device op per step. The log step, which syncs anyway, takes their mean with one
op; only when that mean is not finite are they searched for the first bad step. Before a
checkpoint, the losses not yet logged are checked with one sync (checkpoints sync
anyway). A checkpoint is never written after a non-finite loss, so the newest one on
disk is always the last good one, and a run that stops on NaN hands the user those
weights back.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch

from gpunb.errors import GpunbError

_NONE = 2**62  # "no bad step", also what a rank with no bad step votes


class StepLosses:
    """The loss of each step since the last log, and what checkpoints need to know of them."""

    def __init__(self):
        self.losses: list[torch.Tensor] = []  # one per step since the last log, at most log_every
        self.first_step = 0  # the step number of losses[0]
        self.checked = 0  # how many of them a checkpoint has judged already
        self.bad_step = _NONE  # first non-finite step a log found since the last checkpoint
        self.unsaved_warned = False

    def add(self, step_loss: torch.Tensor, step: int) -> None:
        """After each optimizer step (`step`: its number); host work only."""
        if not self.losses:
            self.first_step = step
        self.losses.append(step_loss)

    def __len__(self) -> int:
        return len(self.losses)

    def mean(self) -> torch.Tensor:
        return torch.stack(self.losses).mean()  # the interval's one op, read by the log's sync

    def end_interval(self, run, loss: float) -> None:
        """At the log step, with the synced mean `loss`: fail on (or note) a non-finite one."""
        config = run.config
        if not math.isfinite(loss) and (config.detect_nan or run.plan.checkpoint_dir):
            bad = self._first_bad(self.checked)  # one more sync, on this rare path only
            if config.detect_nan:
                fail(run.state, run.dist, run.model, run.stepper.optimizer, loss,
                     _agree(run.dist, bad) or run.state.step)  # raises
            self.bad_step = min(self.bad_step, bad)  # the next checkpoint check agrees on it
        self.losses.clear()
        self.checked = 0

    def first_bad_step(self, dist) -> int | None:
        """Before a checkpoint: the first non-finite step since the previous check, agreed on by
        all ranks. The losses not yet logged cost one sync. Later checks look only at later steps."""
        local = self.bad_step
        if local == _NONE and len(self.losses) > self.checked:
            pending = torch.stack(self.losses[self.checked:])
            if not bool(torch.isfinite(pending).all()):
                local = self._first_bad(self.checked)
        self.bad_step, self.checked = _NONE, len(self.losses)
        return _agree(dist, local)

    def warn_unsaved(self, bad_step: int) -> None:
        """detect_nan=False: training goes on, but no checkpoint is written over good ones."""
        if self.unsaved_warned:
            return
        self.unsaved_warned = True
        warnings.warn(f"The loss was not finite at step {bad_step}: a checkpoint is written only when "
                      "every step since the previous one had a finite loss, so the newest checkpoint "
                      "on disk stays the last good one.", RuntimeWarning, stacklevel=2)

    def _first_bad(self, start: int) -> int:
        """The step number of the first non-finite loss from losses[start] on, or _NONE."""
        if start >= len(self.losses):  # a checkpoint has judged them all already
            return _NONE
        values = torch.stack(self.losses[start:]).reshape(len(self.losses) - start, -1)
        bad = (~torch.isfinite(values)).any(dim=1).nonzero()
        return self.first_step + start + int(bad[0]) if len(bad) else _NONE


def _agree(dist, local: int) -> int | None:
    """The smallest of the ranks' first bad steps (a collective: every rank calls it), or None."""
    found = dist.smallest(local)
    return None if found >= _NONE else found


def fail(state, dist, model, optimizer, loss: float, bad_step: int) -> None:
    """Raise the NaN error, after giving the model its last good weights back."""
    restored, unreadable = restore_last_good(state, dist, model, optimizer)
    raise GpunbError(
        f"The training loss became {loss} at step {bad_step} (found at step {state.step}, "
        f"epoch {state.epoch}). {_where_the_weights_are(state, restored, unreadable)}",
        "lower the learning rate (`lr=`), clip gradients (`clip_grad_norm=1.0`), check the "
        "data for NaN/inf values, or use bf16 instead of fp16 (`precision='bf16-mixed'`). "
        "Set `detect_nan=False` to train on regardless.")


def _where_the_weights_are(state, restored: tuple[int, str] | None, unreadable: list[str]) -> str:
    skipped = (f" ({', '.join(unreadable)} could not be read, so an older one was taken)"
               if unreadable and restored else "")
    if restored:
        return f"The model holds the weights of the last good checkpoint, step {restored[0]} ({restored[1]}){skipped}."
    last_step = "the weights of the last step, which may be NaN"
    if unreadable:
        return (f"No checkpoint of this run could be read ({', '.join(unreadable)}), so the model holds "
                f"{last_step}.")
    config = state.config
    if not state.plan.checkpoint_dir:
        return (f"No good checkpoint exists, so the model holds {last_step}; set `checkpoint_dir` to get "
                "the last good weights back.")
    due = (f"every {config.checkpoint_every} steps" if config.checkpoint_every
           else "at the end of each epoch")
    return (f"No good checkpoint exists yet (they are written {due}), so the model holds {last_step}; "
            "save more often with `checkpoint_every=N` to get good weights back from earlier steps.")


def restore_last_good(state, dist, model, optimizer) -> tuple[tuple[int, str] | None, list[str]]:
    """Load the newest readable checkpoint of this run (or the one it resumed from) into the model
    and optimizer. Returns (its step and path, or None) and the newer ones that could not be read."""
    from gpunb.runtime.state.checkpoint_files import load_checkpoint
    from gpunb.runtime.trainable import load_weights

    if state.rank != 0 or getattr(dist, "strategy", "ddp") == "fsdp":
        return None, []  # FSDP would need every rank to take part; rank 0's weights are what is returned
    unreadable = []
    for path in _good_checkpoints(state):
        try:
            payload = load_checkpoint(path)
        except GpunbError:  # removed or damaged since it was written: take the one before
            unreadable.append(Path(path).name)
            continue
        with torch.no_grad():
            load_weights(model, payload["model"])  # it may hold only what trains
        try:
            optimizer.load_state_dict(payload["optimizer"])
        except (ValueError, KeyError):  # an optimizer state saved by index under another layout
            pass
        return (payload["step"], str(path)), unreadable
    return None, unreadable


def _good_checkpoints(state) -> list[str]:
    """This run's checkpoints, newest first (none is written after a bad loss), then the one it resumed."""
    from gpunb.runtime.state.checkpoint_files import run_checkpoints, run_directory

    found = [state.checkpoint_path] if state.checkpoint_path else []
    if state.checkpoint_run is not None and state.plan.checkpoint_dir:
        own = run_directory(state.plan.checkpoint_dir, state.checkpoint_run)
        found += [str(p) for p in reversed(run_checkpoints(own))] if own.is_dir() else []
    if state.resumed:
        found.append(state.resumed["path"])
    return list(dict.fromkeys(found))  # each once, in order
