"""Checkpointing as a callback: when to save, what goes in, and how a run resumes."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from gpunb.errors import GpunbError
from gpunb.runtime import device as devices
from gpunb.runtime import trainable
from gpunb.runtime.state import checkpoint_files as ckpt
from gpunb.runtime.state import resume_check, resume_target
from gpunb.runtime.state.best_k import entry_path
from gpunb.runtime.state.nan_guard import fail
from gpunb.runtime.state.run_lock import RunLock


class Checkpointer:
    """Saves every `checkpoint_every` steps (or at each epoch end), and when a run stops early.

    The directory is checked writable when the run is set up, before any training. A
    save that still fails later (a full disk) warns once and training goes on. The run
    holds its directory's lock (run_lock.py) from its first save, or from resuming into
    it, to the end of the fit, so that no other run adopts it meanwhile. What it
    saves comes from its collaborators: the user's `model`, the `stepper` (optimizer,
    schedule, weight average, splits), `precision` (the scaler), the run's `losses` (no checkpoint after
    a non-finite one), `dist` (state dicts, gathered across ranks) and `events`, which
    hears `on_checkpoint`. `batches_per_epoch` (None: unknown) says whether an epoch is done.
    """

    def __init__(self, config, *, dist, model, stepper, precision, losses, batches_per_epoch, events, rank,
                 best=None):
        self.config, self.dist, self.model, self.stepper = config, dist, model, stepper
        self.precision, self.losses, self.events = precision, losses, events
        self.best = best  # a BestCheckpoints when save_top_k is set
        self.batches_per_epoch = batches_per_epoch
        self.saved_step = None
        self.failed = False
        # A model with frozen parameters is saved as what trains plus a fingerprint of the rest
        # (trainable.py); FSDP's sharded state keeps whole checkpoints.
        self.trainable_only = getattr(dist, "strategy", None) != "fsdp" and trainable.has_frozen(model)
        self.lock: RunLock | None = None  # on the run's own directory (rank 0)
        if rank == 0:
            ckpt.check_writable(config.checkpoint_dir)

    def on_step_end(self, state) -> None:
        every = self.config.checkpoint_every
        if every and state.step % every == 0:
            self.save(state)

    def on_epoch_end(self, state, metrics) -> None:
        if self.config.checkpoint_every is None:
            self.save(state)

    def on_validation_end(self, state, metrics) -> None:
        """A best checkpoint when the monitored metric enters the top k. The metric is reduced
        over ranks, so every rank decides alike and takes part in gathering the state."""
        value = self.best.monitor.value(metrics) if self.best is not None else None
        if self.best is None or not self.best.wants(value) or not self._loss_finite(state):
            return
        kept = self.best.with_entry(state.step, value)
        model_state, optimizer_state = self.dist.state_dicts(self.model, self.stepper.optimizer)
        if state.rank != 0:
            self.best.commit(kept, None)
            return
        payload = self._payload(state, model_state, optimizer_state, best=kept)
        try:
            path = self.best.write(self._directory(state), kept, state.step, payload)
        except (OSError, RuntimeError) as error:
            self._warn_failed(state, error)
            return
        self.events.call("on_checkpoint", state, path)

    def on_fit_end(self, state) -> None:
        try:
            if state.should_stop:  # interrupted or stopped: keep the latest weights on disk too
                self.save(state)
                state.result.checkpoint_path = state.checkpoint_path
            if self.best is not None:
                finish_best(self, state)
        finally:  # a failed save or best restore must not leave this kernel holding the directory
            self.release()

    def on_exception(self, state, error) -> None:
        self.release()

    def release(self) -> None:
        """Let other runs adopt the directory (the lock also goes when the process ends)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def save(self, state) -> None:
        if state.step == self.saved_step:
            return
        if not self._loss_finite(state):
            return
        # Every rank takes part (FSDP gathers its shards to rank 0 here); rank 0 writes.
        model_state, optimizer_state = self.dist.state_dicts(self.model, self.stepper.optimizer)
        self.saved_step = state.step
        if state.rank != 0:
            return
        try:
            path = ckpt.save_checkpoint(self._directory(state), self._payload(state, model_state, optimizer_state),
                                        state.step, self.config.keep_last)
        except (OSError, RuntimeError) as error:  # torch's zip writer reports a full disk as RuntimeError
            self._warn_failed(state, error)
            return
        state.checkpoint_path = str(path)
        self.events.call("on_checkpoint", state, path)

    def _directory(self, state) -> Path:
        """The run's own directory (rank 0 names the run at its first save)."""
        if state.checkpoint_run is None:
            state.checkpoint_run = ckpt.new_run_id()
        directory = ckpt.run_directory(self.config.checkpoint_dir, state.checkpoint_run)
        if self.lock is None:  # a new directory: its id is unique, so the lock is free
            self.lock = RunLock.acquire(directory, {"run_name": state.run_name})
        return directory

    def _loss_finite(self, state) -> bool:
        """No checkpoint after a non-finite loss: the newest on disk stays the last good one."""
        bad_step = self.losses.first_bad_step(self.dist)  # a sync, at checkpoint time only
        if bad_step is None:
            return True
        if self.config.detect_nan:
            fail(state, self.dist, self.model, self.stepper.optimizer, float("nan"), bad_step)  # raises
        self.losses.warn_unsaved(bad_step)  # the next check judges only the steps after this one
        return False

    def _payload(self, state, model_state, optimizer_state, best=None) -> dict:
        stepper = self.stepper
        if self.best is not None:
            best = {**self.best.state_dict(), "kept": best if best is not None else self.best.kept}
        epoch_complete = self.batches_per_epoch is not None and state.batch_in_epoch >= self.batches_per_epoch
        frozen, ema = None, stepper.ema.state_dict() if stepper.ema is not None else None
        if self.trainable_only:
            model_state, frozen = trainable.split_state(self.model, model_state)
            ema = trainable.trainable_part(self.model, ema) if ema is not None else None
        return {
            "model": model_state,
            "frozen": frozen,  # None: `model` is the whole state; else the fingerprint of what it leaves out
            "optimizer": optimizer_state,
            # the optimizer in backward saves the state of the optimizer it stands for (memory/in_backward.py)
            "optimizer_type": getattr(stepper.optimizer, "checkpoint_type", type(stepper.optimizer).__name__),
            "scheduler": stepper.schedule.state_dict() if stepper.schedule else None,
            "scheduler_type": type(stepper.schedule.scheduler).__name__ if stepper.schedule else None,
            "ema": {"weights": ema, "updates": stepper.ema.updates} if ema is not None else None,
            "total_steps": state.total_steps,
            "precision": self.precision.state_dict(),
            "rng": devices.rng_state(state.device),
            # Where to continue: the next epoch, or this one after the batches already used.
            "epoch": state.epoch + 1 if epoch_complete else state.epoch,
            "batch_in_epoch": 0 if epoch_complete else state.batch_in_epoch,
            "batches_per_epoch": self.batches_per_epoch,  # a resume with other data is told its epochs differ
            "step": state.step, "samples_seen": state.samples_seen, "splits": stepper.splits,
            "history": state.history, "epochs": state.epochs, "validations": state.validations,
            "best": best,
            "config": ckpt.config_json(self.config), "run_name": state.run_name,
            "run_id": state.checkpoint_run, "saved_at": time.time(), "world_size": state.world_size,
            "origin": (state.resumed or {}).get("origin"),  # the run directory this one was resumed from
        }

    def _warn_failed(self, state, error: BaseException) -> None:
        if self.failed:
            return
        self.failed = True
        why = "the disk is full" if ckpt.is_disk_full(error) else f"{type(error).__name__}: {error}"
        kept = state.checkpoint_path
        warnings.warn(f"Could not write the checkpoint at step {state.step} to "
                      f"{self.config.checkpoint_dir} ({why}); training goes on, and later saves "
                      f"are tried again. The newest checkpoint on disk is {kept or 'none'}.",
                      RuntimeWarning, stacklevel=2)


def finish_best(checkpointer, state) -> None:
    """The result names the best checkpoint; with restore_best its weights go into the model.

    Rank 0 reads the file (it wrote it); under FSDP every rank takes part in loading it.
    With DDP the other ranks keep their last weights (the notebook receives rank 0's)."""
    best, result, config = checkpointer.best.best, state.result, checkpointer.config
    if best is None:
        return
    result.best_monitor, result.best_value, result.best_step = (checkpointer.best.monitor.name,
                                                                best["value"], best["step"])
    if state.checkpoint_run is not None:
        directory = ckpt.run_directory(config.checkpoint_dir, state.checkpoint_run)
        result.best_checkpoint = str(entry_path(directory, best))
    sharded = getattr(checkpointer.dist, "strategy", None) == "fsdp"
    if not config.restore_best or not (state.rank == 0 or sharded):
        return
    if state.rank == 0 and not Path(result.best_checkpoint or "").is_file():
        warnings.warn(f"restore_best: the best checkpoint ({best['file']}) is no longer on disk; the model "
                      "keeps the weights of the last step.", RuntimeWarning, stacklevel=2)
        return  # (FSDP's other ranks would wait here: a file removed during the run is not expected)
    weights = _best_weights(ckpt.load_checkpoint(result.best_checkpoint)) if state.rank == 0 else {}
    checkpointer.dist.load_model_state(checkpointer.model, weights)
    result.restored_best = True


def _best_weights(payload: dict) -> dict:
    """The weights that were validated: the average when the run kept one (`ema`)."""
    return payload["ema"]["weights"] if payload.get("ema") else payload["model"]


def resume(run, path) -> None:
    """Load the checkpoint at `path` into the run's model, optimizer, schedule and RNGs.

    Everything is checked first (resume_check): on a mismatch nothing has been loaded.
    """
    payload = ckpt.load_checkpoint(path)
    resume_check.check_fits(run, payload, path)
    resume_check.check_schedule(run, payload, path)
    if run.state.rank == 0:
        resume_target.refuse_live_pick(run.config, Path(path))
    state, stepper = run.state, run.stepper
    try:
        run.dist.load_model_state(run.model, payload["model"])
    except RuntimeError as error:  # FSDP: its own check; keep torch's whole message
        raise GpunbError(f"The checkpoint {path!s} does not fit this model: {error}",
                         "resume with the model definition it was trained with, or start fresh "
                         "without `resume`.") from error
    try:
        run.dist.load_optimizer_state(run.model, stepper.optimizer, payload["optimizer"])
    except (ValueError, KeyError) as error:
        raise GpunbError(f"The optimizer state in {path!s} does not fit this optimizer: {error}",
                         "resume with the same optimizer type and parameter groups.") from error
    for note in (resume_check.load_schedule(run, payload, path), resume_check.data_layout_note(run, payload, path)):
        if note and state.rank == 0:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
    _load_ema(stepper.ema, payload.get("ema"))
    run.precision.load_state_dict(payload["precision"])
    devices.set_rng_state(payload["rng"], state.device)
    run.start_epoch, run.skip_batches = payload["epoch"], payload["batch_in_epoch"]
    state.batch_in_epoch = payload["batch_in_epoch"]  # so a stop before the first step saves the same place
    state.epoch, state.step, state.samples_seen = payload["epoch"], payload["step"], payload["samples_seen"]
    stepper.splits = payload["splits"]
    state.history[:] = payload["history"]
    # A stop mid-epoch wrote that epoch's partial row; the resumed epoch writes the whole one.
    state.epochs[:] = [row for row in payload["epochs"] if row["epoch"] < payload["epoch"]]
    state.validations[:] = payload.get("validations", [])
    if run.best is not None:
        run.best.load_state_dict(payload.get("best"))
    _adopt_run(run, payload, Path(path))


def _load_ema(ema, saved: dict | None) -> None:
    """The saved average goes on; without one (saved by a run without `ema`) it starts from the
    resumed weights."""
    if ema is None:
        return
    if saved is None:
        ema.reset()
        return
    ema.load_state_dict(saved["weights"])
    ema.updates = saved["updates"]


def _adopt_run(run, payload: dict, path: Path) -> None:
    """Where the resumed run writes (resume_target.py), and what it says about what it resumed."""
    state = run.state
    run_id = payload.get("run_id") or ckpt.run_id_of(path.parent)
    state.resumed = {"path": str(path), "run": run_id, "run_name": payload.get("run_name"),
                     "step": payload["step"], "epoch": payload["epoch"], "saved_at": payload.get("saved_at")}
    if state.rank != 0:
        return
    if run.checkpointer is not None:  # last: a fit that fails from here on releases the lock
        run.checkpointer.lock, target = resume_target.claim(run.config, state, path, payload)
        state.resumed.update(target)
        if run.checkpointer.lock is not None:
            ckpt.remove_leftovers(path.parent)  # a killed save's temp files, now that the directory is ours
        elif run.best is not None:
            run.best.kept_in(path.parent, run.config.checkpoint_dir)  # the best ones so far stay there
    # Deterministic text (tutorials show it): the time and run id are in result.resumed_from.
    print(f"Resuming run {payload.get('run_name')!r} at step {payload['step']} (epoch {payload['epoch']}) "
          f"from {path.name} (result.resumed_from says which run and when it was saved).", flush=True)
    if state.resumed.get("note"):
        print(state.resumed["note"], flush=True)
