"""RunState: what a run carries from one step to the next, listed once.

A checkpoint is `state.state_dict()`, a resume `load_state_dict(payload)`; a continued fit
loads `state_dict(live=True)` of the fit it goes on from (its objects taken over, not
copied); the probes save and put back the weights, optimizer and RNGs through it
(state/rewind.py); rank 0 sends `relayed()` to the kernel, whose mirror takes it with
`load_relayed`; TrainResult.from_state reads it. Callbacks receive it at every event.

A field added here travels all those ways with no other edit: a plain value (numbers,
strings, lists and dicts of them) as it is, an object through its own `state_dict()` /
`load_state_dict()`. `moment()` marks a field that belongs to this fit only (not saved;
`relayed=True`: the kernel's mirror gets it too). The few parts saved in a way of their
own (the model and optimizer, gathered across ranks; the schedule; the weight average;
the RNGs; the position in the data) are marked `own()` and handled below, by name.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gpunb.errors import GpunbError
from gpunb.runtime import device as devices
from gpunb.runtime import trainable
from gpunb.runtime.context import LocalContext

_LOCAL = LocalContext()
_CPU = torch.device("cpu")


def moment(default=None, *, relayed: bool = False, factory=None, merged: bool = False):
    """A field of this fit only: never saved or continued; `relayed`: rank 0 sends it to the kernel
    (`merged`: a dict whose plain entries update the kernel's, beside the kernel's own entries)."""
    meta = {"carried": False, "relayed": relayed, "merged": merged}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def own(default=None, *, relayed: bool = False, factory=None):
    """A carried field that state_dict / load_state_dict handle by name (not by the generic rule)."""
    meta = {"carried": True, "own": True, "relayed": relayed}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


class PhaseMarks:
    """Whether a profiler watches the run (the loop then names the step's phases). The stepper
    holds this, not the RunState: a state that holds its stepper, which held the state back,
    was a cycle that kept the model and optimizer until the garbage collector ran."""

    __slots__ = ("profile",)

    def __init__(self) -> None:
        self.profile = False


_OBJECT = {"relayed": False}  # a carried object: saved by its state_dict, never sent to the kernel


@dataclass(eq=False)
class RunState:
    """What a run carries (saved, continued, relayed) and what a callback may read during `fit`."""

    # --- what trains: saved in their own ways (see state_dict); a continued fit takes them over
    model: Any = own()  # the user's module (its weights are what a checkpoint holds)
    optimizer: Any = own()
    schedule: Any = own()  # step/schedule.py Schedule, or None
    ema: Any = own()  # step/ema.py WeightEma, or None
    precision: Any = field(default=None, metadata=_OBJECT)  # step/precision.py Precision: the loss scaler
    # state/best_k.py BestCheckpoints (save_top_k), or None; not continued (see CONTINUE_SKIPS)
    best: Any = field(default=None, metadata=_OBJECT)
    # feed/epoch_start.py EpochStart: the RNG states a user's own DataLoader began its epoch from (None: data
    # gpunb batches itself, whose order depends on the seed and epoch alone)
    data_start: Any = field(default=None, metadata=_OBJECT)
    # --- where the run is
    epoch: int = own(0, relayed=True)  # 0-based epoch in progress
    batch_in_epoch: int = own(0, relayed=True)  # micro-batches consumed in the current epoch
    step: int = 0  # optimizer steps completed
    samples_seen: int = 0
    history: list = field(default_factory=list, metadata={"relayed": False})  # rows appended at each log (rank 0 relays them as they come)
    epochs: list = own(factory=list, relayed=True)  # one row per finished epoch (train_loss, val_*)
    validations: list = field(default_factory=list)  # one row per validation: step, epoch, val_*
    run_name: str = own("run", relayed=True)
    # --- this fit: what it was asked and decided, and what callbacks may read
    config: Any = moment()  # the TrainConfig as the user gave it (the decisions are in `plan`)
    plan: Any = moment(relayed=True)  # plan.py RunPlan: device, precision, batch size, length, and why
    train_model: Any = moment()  # what the loop calls: `model`, or its DDP wrapper (compiled: the stepper's engine)
    device: Any = moment(relayed=True)  # torch.device
    stepper: Any = moment()  # step/stepper.py Stepper (its OOM splits are saved)
    batches_per_epoch: int | None = moment()  # loaded batches an epoch (None: unknown)
    steps_per_epoch: int | None = moment(relayed=True)
    total_steps: int | None = moment(relayed=True)  # optimizer steps the run will take, when known
    start_step: int = moment(0, relayed=True)  # the step this fit began at (> 0: resumed or continued)
    start_samples: int = moment(0, relayed=True)
    summary: dict | None = moment(relayed=True)  # RunSummary.as_plain(), measured before the first step
    peak_tflops: float | None = moment(relayed=True)  # the device's dense peak (live MFU); None: unknown
    rank: int = moment(0)
    world_size: int = moment(1)
    started_at: float = moment(factory=time.time)
    latest: dict = moment(factory=dict, relayed=True, merged=True)  # newest host-side metrics of any kind
    eta: tuple | None = moment(relayed=True)  # (seconds left, time.time() of the estimate): eta.py
    stop_reason: str | None = moment()
    result: Any = moment()  # the TrainResult, set before on_fit_end
    val_names: tuple | None = moment(relayed=True)  # the metrics validation produces (None: no validation data)
    checkpoint_path: str | None = moment(relayed=True)  # the newest checkpoint this run wrote
    checkpoint_run: str | None = moment()  # the id of the run directory checkpoints go to
    # the frozen weights' fingerprint (trainable.py), computed once a fit: they never change in one
    frozen_fingerprint: dict | None = moment()
    registry_run: str | None = moment()  # this fit's id in the run registry (set by its recorder, runs/)
    continues_run: str | None = moment()  # a continued fit: the run registry's id of the run it goes on with
    resumed: dict | None = moment(relayed=True)  # what the run resumed from: path, run, run_name, step, ...
    marks: PhaseMarks = moment(factory=PhaseMarks)  # `profile`, below: what the stepper reads
    # ranks: a stop asked for on one rank waits for a vote (see request_stop), so all stop together
    stops_by_vote: bool = moment(False)
    pending_stop: str | None = moment()  # asked for on this rank, not yet voted on
    # callbacks' own notes (a GPU sample, energy_j, log_dir, ...); the runtime neither reads nor writes them
    extras: dict = moment(factory=dict, relayed=True, merged=True)

    @property
    def profile(self) -> bool:
        """Set by a profiler: the loop marks its phases with named ranges."""
        return self.marks.profile

    @profile.setter
    def profile(self, on: bool) -> None:
        self.marks.profile = on

    @property
    def should_stop(self) -> bool:
        return self.stop_reason is not None

    def request_stop(self, reason: str = "stopped") -> None:
        """Ask the loop to stop at the next step boundary. Ranks must stop after the same step (or
        one would wait forever in a collective the others never join): in a process group the
        request is noted here, and the next log interval or epoch end votes on it."""
        if self.stops_by_vote:
            if self.pending_stop is None:
                self.pending_stop = reason
        elif self.stop_reason is None:
            self.stop_reason = reason

    def apply_vote(self, stops: float, interrupts: float) -> None:
        if self.stop_reason is not None or not stops:
            return
        # The same decision on every rank ("interrupted" changes control flow; the
        # wording of other reasons does not, so each rank keeps its own).
        self.stop_reason = "interrupted" if interrupts else (self.pending_stop or "stopped on another rank")

    def settings(self) -> dict:
        """The config as this run uses it: the user's, with the plan's decisions filled in."""
        return self.plan.settings(self.config) if self.plan is not None else self.config.to_dict()

    @property
    def progress(self) -> float | None:
        """Fraction of the run done, in [0, 1], when the length is known."""
        if not self.total_steps:
            return None
        return min(1.0, self.step / self.total_steps)

    # --- saving and loading
    def state_dict(self, dist=_LOCAL, *, live: bool = False, epoch_done: bool | None = None) -> dict:
        """Everything carried, as a checkpoint holds it. `dist` gathers the weights and optimizer
        state (FSDP: on rank 0). `live`: for a continued fit in this process, the model, optimizer,
        schedule and weight average as the objects themselves. `epoch_done`: whether the epoch in
        progress is over (None: when all its batches were used); the saved position is then the next."""
        saved = {f.name: _saved(getattr(self, f.name)) for f in _generic(type(self))}
        if live:
            saved.update(model=Live(self.model), optimizer=Live(self.optimizer), scheduler=Live(self.schedule),
                         ema=Live(self.ema))
        else:
            saved.update(self._objects(dist))
        if epoch_done is None:
            epoch_done = self.batches_per_epoch is not None and self.batch_in_epoch >= self.batches_per_epoch
        # Where to continue: the next epoch, or this one after the batches already used.
        saved.update(epoch=self.epoch + 1 if epoch_done else self.epoch,
                     batch_in_epoch=0 if epoch_done else self.batch_in_epoch,
                     epochs=copy.deepcopy(self.epochs), run_name=self.run_name,
                     splits=self.stepper.splits if self.stepper is not None else 1,
                     rng=devices.rng_state(self.device or _CPU))
        return saved

    def _objects(self, dist) -> dict:
        """The parts saved in their own ways: weights and optimizer state through `dist` (every rank
        takes part: FSDP gathers its shards; a model with frozen parameters keeps what trains,
        trainable.py), the schedule, the weight average (what trains) with its count."""
        model = optimizer = frozen = None
        if self.model is not None and self.optimizer is not None:
            model, optimizer = dist.state_dicts(self.model, self.optimizer)
        elif self.model is not None:
            model = self.model.state_dict()
        if model is not None and getattr(dist, "strategy", None) != "fsdp":  # FSDP's sharded state stays whole
            # frozen weights: their fingerprint only
            model, frozen = trainable.split_state(self.model, model, self.frozen_fingerprint)
            self.frozen_fingerprint = frozen
        schedule, ema = self.schedule, self.ema
        return {"model": model, "optimizer": optimizer,
                "frozen": frozen,  # None: `model` is the whole state; else the fingerprint of what it leaves out
                # the optimizer in backward saves the state of the optimizer it stands for (memory/in_backward.py)
                "optimizer_type": optimizer_type(self.optimizer) if self.optimizer is not None else None,
                "scheduler": schedule.state_dict() if schedule is not None else None,
                "scheduler_type": type(schedule.scheduler).__name__ if schedule is not None else None,
                "ema": {"weights": ema.state_dict(), "updates": ema.updates} if ema is not None else None}

    def load_state_dict(self, saved: dict, dist=_LOCAL, *, where: str = "the checkpoint") -> None:
        """Put what `saved` holds back in place. The schedule is left to the caller (a resume may
        stretch or fast-forward it: state/resume_check.py load_schedule); a continued fit's objects (Live)
        were taken over at set-up. Checked before (state/resume_check.py): a mismatch here is not expected."""
        for f in _generic(type(self)):
            if f.name in saved and not (f.name in CONTINUE_SKIPS and _is_live(saved)):
                setattr(self, f.name, _loaded(getattr(self, f.name), saved[f.name]))
        self._load_objects(saved, dist, where)
        self.epoch, self.batch_in_epoch = saved["epoch"], saved["batch_in_epoch"]
        # A stop mid-epoch wrote that epoch's partial row; the resumed epoch writes the whole one. A
        # run resumed at its last step keeps the row of an epoch that max_steps ended there: that
        # epoch's end was done (the loop does it only when the checkpoint came before it).
        over = self.total_steps is not None and saved["step"] >= self.total_steps
        self.epochs[:] = [row for row in saved["epochs"] if row["epoch"] < saved["epoch"] or over]
        if self.stepper is not None:
            self.stepper.splits = saved["splits"]
        devices.set_rng_state(saved["rng"], self.device or _CPU)

    def _load_objects(self, saved: dict, dist, where: str) -> None:
        if self.model is not None and not isinstance(saved["model"], Live):
            try:
                dist.load_model_state(self.model, saved["model"])
            except RuntimeError as error:  # FSDP: its own check; keep torch's whole message
                raise GpunbError(f"{where} does not fit this model: {error}",
                                 "resume with the model definition it was trained with, or start fresh "
                                 "without `resume`.") from error
        if self.optimizer is not None and not isinstance(saved["optimizer"], Live):
            self.optimizer.zero_grad(set_to_none=True)
            try:
                dist.load_optimizer_state(self.model, self.optimizer, saved["optimizer"])
            except (ValueError, KeyError) as error:
                raise GpunbError(f"The optimizer state in {where} does not fit this optimizer: {error}",
                                 "resume with the same optimizer type and parameter groups.") from error
        if self.ema is not None and not isinstance(saved.get("ema"), Live):
            _load_ema(self.ema, saved.get("ema"))

    # --- the rank relay
    def relayed(self) -> dict:
        """What rank 0 sends the kernel at each event: the fields marked relayed, and every other
        carried field that holds plain data (history goes as rows, by the relay)."""
        sent = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("merged"):
                sent[f.name] = {k: v for k, v in value.items() if _plain(v)}
            elif f.metadata.get("relayed") or ("relayed" not in f.metadata and _plain(value)):
                sent[f.name] = value
        return sent

    def load_relayed(self, values: dict) -> None:
        merged = {f.name for f in dataclasses.fields(self) if f.metadata.get("merged")}
        for name, value in values.items():
            if name in merged:
                getattr(self, name).update(value)
            else:
                setattr(self, name, value)


# Carried fields that a continued fit does not take from the one it continues: its best-k list
# ranks its own checkpoints.
CONTINUE_SKIPS = ("best",)


class Live:
    """An object a continued fit takes over as it is (state_dict(live=True)); never saved to disk."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _is_live(saved: dict) -> bool:
    return isinstance(saved.get("model"), Live)


def _generic(cls) -> list:
    """The carried fields saved by the generic rule (plain values as they are, objects by state_dict)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("carried", True) and not f.metadata.get("own")]


def _saved(value):
    if hasattr(value, "state_dict"):
        return value.state_dict()
    return copy.deepcopy(value)


def _loaded(current, saved):
    """The value a field takes: an object loads the saved state into itself; a plain value is replaced."""
    if hasattr(current, "load_state_dict"):
        current.load_state_dict(saved)
        return current
    return copy.deepcopy(saved)


def _load_ema(ema, saved: dict | None) -> None:
    """The saved average goes on; without one (saved by a run without `ema`) it starts from the
    loaded weights."""
    if saved is None:
        ema.reset()
        return
    ema.load_state_dict(saved["weights"])
    ema.updates = saved["updates"]


def _plain(value, depth: int = 0) -> bool:
    """Plain data, safe to send to another process and to copy."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth > 4:
        return False
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def optimizer_type(optimizer) -> str:
    """The optimizer's name as a checkpoint records it; the optimizer in backward gives the one it
    stands for, whose state it saves (memory/in_backward.py)."""
    return getattr(optimizer, "checkpoint_type", type(optimizer).__name__)
