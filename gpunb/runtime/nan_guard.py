"""The first non-finite step loss, tracked on the device, and what a run does about it.

Every step adds a few device ops (no host sync): a step counter and the first step
whose loss was not finite. The host reads it only where it already syncs: at the log
interval and before a checkpoint is written. A checkpoint is never written after a
non-finite loss, so the newest one on disk is always the last good one, and a run
that stops on NaN hands the user those weights back.
"""

from __future__ import annotations

import warnings

import torch

from gpunb.errors import GpunbError

_NONE = 2**62  # "no bad step", also what a rank with no bad step votes


class NanGuard:
    def __init__(self):
        self._count = None  # device int64: optimizer steps completed
        self._first_bad = None  # device int64: first step whose loss was not finite, or -1

    def observe(self, step_loss: torch.Tensor, step_before: int) -> None:
        """After each optimizer step; device ops only."""
        if self._count is None:
            self._count = torch.tensor(step_before, dtype=torch.int64, device=step_loss.device)
            self._first_bad = torch.full_like(self._count, -1)
        self._count += 1
        bad = ~torch.isfinite(step_loss.detach()) & (self._first_bad < 0)
        self._first_bad = torch.where(bad, self._count, self._first_bad)

    def first_bad_step(self, dist) -> int | None:
        """The first non-finite step since the last reset, agreed on by all ranks (one sync)."""
        local = _NONE if self._first_bad is None else int(self._first_bad.item())
        found = dist.smallest(local if local >= 0 else _NONE)
        return None if found >= _NONE else found

    def reset(self) -> None:
        """After a good checkpoint: later checks look only at the steps after it."""
        if self._first_bad is not None:
            self._first_bad.fill_(-1)

    def fail(self, run, loss: float, bad_step: int | None = None) -> None:
        """Raise the NaN error, after giving the model its last good weights back."""
        state = run.state
        bad_step = bad_step or self.first_bad_step(run.dist) or state.step
        restored = restore_last_good(run)
        where = (f"The model holds the weights of the last good checkpoint, step {restored[0]} "
                 f"({restored[1]})." if restored else
                 "No good checkpoint exists, so the model holds the weights of the last step, "
                 "which may be NaN; set `checkpoint_dir` to get the last good weights back.")
        raise GpunbError(
            f"The training loss became {loss} at step {bad_step} (found at step {state.step}, "
            f"epoch {state.epoch}). {where}",
            "lower the learning rate (`lr=`), clip gradients (`clip_grad_norm=1.0`), check the "
            "data for NaN/inf values, or use bf16 instead of fp16 (`precision='bf16-mixed'`). "
            "Set `detect_nan=False` to train on regardless.")


def restore_last_good(run) -> tuple[int, str] | None:
    """Load the newest checkpoint this run wrote (or resumed from) into the model and optimizer."""
    from gpunb.runtime.checkpoint import load_checkpoint

    path = run.state.extras.get("checkpoint_path") or run.state.extras.get("resumed_from")
    if path is None or run.state.rank != 0 or getattr(run.dist, "strategy", "ddp") == "fsdp":
        return None  # FSDP would need every rank to take part; rank 0's weights are what is returned
    payload = load_checkpoint(path)
    with torch.no_grad():
        run.model.load_state_dict(payload["model"])
    try:
        run.stepper.optimizer.load_state_dict(payload["optimizer"])
    except (ValueError, KeyError):  # an optimizer state saved by index under another layout
        pass
    return payload["step"], path


def warn_unsaved(run, bad_step: int) -> None:
    """detect_nan=False: training goes on, but no checkpoint is written over good ones."""
    if run.state.extras.get("nan_unsaved_warned"):
        return
    run.state.extras["nan_unsaved_warned"] = True
    warnings.warn(f"The loss was not finite at step {bad_step}: a checkpoint is written only when "
                  "every step since the previous one had a finite loss, so the newest checkpoint "
                  "on disk stays the last good one.", RuntimeWarning, stacklevel=2)
