"""Checkpointing as a callback: when to save, what goes in, and how a run resumes."""

from __future__ import annotations

from gpunb.errors import GpunbError
from gpunb.runtime import checkpoint as ckpt
from gpunb.runtime import device as devices


class Checkpointer:
    """Saves every `checkpoint_every` steps (or at each epoch end), and when a run stops early."""

    def __init__(self, run):
        self.run = run
        self.saved_step = None

    def on_train_batch_end(self, state) -> None:
        every = self.run.config.checkpoint_every
        if every and state.step % every == 0:
            self.save()

    def on_epoch_end(self, state, metrics) -> None:
        if self.run.config.checkpoint_every is None:
            self.save()

    def on_fit_end(self, state) -> None:
        if state.should_stop:  # interrupted or stopped: keep the latest weights on disk too
            self.save()
            state.result.checkpoint_path = state.extras.get("checkpoint_path")

    def save(self) -> None:
        run, state = self.run, self.run.state
        if state.step == self.saved_step:
            return
        # Every rank takes part (FSDP gathers its shards to rank 0 here); rank 0 writes.
        model_state, optimizer_state = run.dist.state_dicts(run.model, run.stepper.optimizer)
        if state.rank != 0:
            self.saved_step = state.step
            return
        batches_per_epoch = run.feed.num_batches
        epoch_complete = batches_per_epoch is not None and state.batch_in_epoch >= batches_per_epoch
        stepper = run.stepper
        payload = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": stepper.scheduler.state_dict() if stepper.scheduler else None,
            "precision": run.precision.state_dict(),
            "rng": devices.rng_state(state.device),
            # Where to continue: the next epoch, or this one after the batches already used.
            "epoch": state.epoch + 1 if epoch_complete else state.epoch,
            "batch_in_epoch": 0 if epoch_complete else state.batch_in_epoch,
            "step": state.step, "samples_seen": state.samples_seen, "splits": stepper.splits,
            "history": state.history, "epochs": state.extras.get("epochs", []),
            "config": ckpt.config_json(run.config), "run_name": state.run_name,
        }
        path = ckpt.save_checkpoint(run.config.checkpoint_dir, payload, state.step, run.config.keep_last)
        self.saved_step = state.step
        state.extras["checkpoint_path"] = str(path)
        run.callbacks.call("on_checkpoint", state, path)


def resume(run, path) -> None:
    """Load the checkpoint at `path` into the run's model, optimizer, schedule and RNGs."""
    payload = ckpt.load_checkpoint(path)
    state, stepper = run.state, run.stepper
    try:
        run.dist.load_model_state(run.model, payload["model"])
    except RuntimeError as error:
        raise GpunbError(f"The checkpoint {path!s} does not fit this model: "
                         f"{str(error).splitlines()[0]}",
                         "resume with the model definition it was trained with, or start fresh "
                         "without `resume`.") from error
    try:
        run.dist.load_optimizer_state(run.model, stepper.optimizer, payload["optimizer"])
    except (ValueError, KeyError) as error:
        raise GpunbError(f"The optimizer state in {path!s} does not fit this optimizer: {error}",
                         "resume with the same optimizer type and parameter groups.") from error
    if stepper.scheduler is not None and payload["scheduler"] is not None:
        stepper.scheduler.load_state_dict(payload["scheduler"])
    run.precision.load_state_dict(payload["precision"])
    devices.set_rng_state(payload["rng"], state.device)
    run.start_epoch, run.skip_batches = payload["epoch"], payload["batch_in_epoch"]
    state.epoch, state.step, state.samples_seen = payload["epoch"], payload["step"], payload["samples_seen"]
    stepper.splits = payload["splits"]
    state.history[:] = payload["history"]
    state.extras["epochs"] = list(payload["epochs"])
    state.extras["resumed_from"] = str(path)
