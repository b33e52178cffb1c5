"""Checkpointing as a callback: when to save, what goes in, and how a run resumes."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

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
    it, to the end of the fit, so that no other run adopts it meanwhile. What it saves
    is the run's `state` (RunState.state_dict: weights gathered across ranks by `dist`),
    with a header saying which run wrote it and with which settings; `losses` keep it
    from saving after a non-finite loss, and `events` hear `on_checkpoint`.
    """

    def __init__(self, config, *, dist, state, losses, events):
        self.config, self.dist, self.losses, self.events = config, dist, losses, events
        self.checkpoint_dir = state.plan.checkpoint_dir  # the config's, else the placement's (a job's folder)
        self.best = state.best  # a BestCheckpoints when save_top_k is set
        self.model = state.model
        self.saved_step = None
        self.failed = False
        self.lock: RunLock | None = None  # on the run's own directory (rank 0)
        if state.rank == 0:
            ckpt.check_writable(self.checkpoint_dir)

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
        payload = self._payload(state)
        if payload is None:
            self.best.commit(kept, None)
            return
        payload["best"]["kept"] = kept
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
        payload = self._payload(state)
        self.saved_step = state.step
        if payload is None:
            return
        try:
            path = ckpt.save_checkpoint(self._directory(state), payload, state.step, self.config.keep_last)
        except (OSError, RuntimeError) as error:  # torch's zip writer reports a full disk as RuntimeError
            self._warn_failed(state, error)
            return
        state.checkpoint_path = str(path)
        self.events.call("on_checkpoint", state, path)

    def _directory(self, state) -> Path:
        """The run's own directory (rank 0 names the run at its first save)."""
        if state.checkpoint_run is None:
            state.checkpoint_run = ckpt.new_run_id()
        directory = ckpt.run_directory(self.checkpoint_dir, state.checkpoint_run)
        if self.lock is None:  # a new directory: its id is unique, so the lock is free
            self.lock = RunLock.acquire(directory, {"run_name": state.run_name})
        return directory

    def _loss_finite(self, state) -> bool:
        """No checkpoint after a non-finite loss: the newest on disk stays the last good one."""
        bad_step = self.losses.first_bad_step(self.dist)  # a sync, at checkpoint time only
        if bad_step is None:
            return True
        if self.config.detect_nan:
            fail(state, self.dist, self.model, state.optimizer, float("nan"), bad_step)  # raises
        self.losses.warn_unsaved(bad_step)  # the next check judges only the steps after this one
        return False

    def _payload(self, state) -> dict | None:
        """The run's state, and a header: which run wrote it, with which settings, when. Rank 0
        writes it; the other ranks only take part in gathering the weights (FSDP gathers its
        shards to rank 0), building nothing they would throw away, and get None."""
        if state.rank != 0:
            if state.model is not None and state.optimizer is not None:
                self.dist.state_dicts(state.model, state.optimizer)
            return None
        return {**state.state_dict(self.dist),
                "total_steps": state.total_steps,
                "batches_per_epoch": state.batches_per_epoch,  # a resume with other data is told its epochs differ
                "config": json.dumps(state.settings(), default=repr),
                "run_id": state.checkpoint_run, "saved_at": time.time(), "world_size": state.world_size,
                "origin": (state.resumed or {}).get("origin")}  # the run directory this one was resumed from

    def _warn_failed(self, state, error: BaseException) -> None:
        if self.failed:
            return
        self.failed = True
        why = "the disk is full" if ckpt.is_disk_full(error) else f"{type(error).__name__}: {error}"
        kept = state.checkpoint_path
        warnings.warn(f"Could not write the checkpoint at step {state.step} to "
                      f"{self.checkpoint_dir} ({why}); training goes on, and later saves "
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
        directory = ckpt.run_directory(checkpointer.checkpoint_dir, state.checkpoint_run)
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


def resume(run) -> None:
    """Load the checkpoint `resume=` means into the run's state: model, optimizer, schedule, RNGs,
    counters (an unreadable newest one gives way to the newest readable, with a warning).

    Everything is checked first (resume_check): on a mismatch nothing has been loaded.
    """
    path, payload, fell_back = resume_target.open_checkpoint(run.plan.resume, run.plan.checkpoint_dir)
    if fell_back and run.state.rank == 0:
        warnings.warn(fell_back, RuntimeWarning, stacklevel=2)
    resume_check.check_fits(run, payload, path)
    resume_check.check_schedule(run, payload, path)
    if run.state.rank == 0:
        resume_target.refuse_live_pick(run.plan, Path(path))
    state = run.state
    state.load_state_dict(payload, run.dist, where=f"The checkpoint {path!s}")
    for note in (resume_check.load_schedule(run, payload, path), resume_check.data_layout_note(run, payload, path)):
        if note and state.rank == 0:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
    _adopt_run(run, payload, Path(path))


def _adopt_run(run, payload: dict, path: Path) -> None:
    """Where the resumed run writes (resume_target.py), and what it says about what it resumed."""
    state = run.state
    run_id = payload.get("run_id") or ckpt.run_id_of(path.parent)
    state.resumed = {"path": str(path), "run": run_id, "run_name": payload.get("run_name"),
                     "step": payload["step"], "epoch": payload["epoch"], "saved_at": payload.get("saved_at")}
    if state.rank != 0:
        return
    if run.checkpointer is not None:  # last: a fit that fails from here on releases the lock
        run.checkpointer.lock, target = resume_target.claim(run.plan, state, path, payload)
        state.resumed.update(target)
        if run.checkpointer.lock is not None:
            ckpt.remove_leftovers(path.parent)  # a killed save's temp files, now that the directory is ours
        elif run.best is not None:
            run.best.kept_in(path.parent, run.plan.checkpoint_dir)  # the best ones so far stay there
    # Deterministic text (tutorials show it): the time and run id are in result.resumed_from.
    print(f"Resuming run {payload.get('run_name')!r} at step {payload['step']} (epoch {payload['epoch']}) "
          f"from {path.name} (result.resumed_from says which run and when it was saved).", flush=True)
    if state.resumed.get("note"):
        print(state.resumed["note"], flush=True)
