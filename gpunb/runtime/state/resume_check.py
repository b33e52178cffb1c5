"""Whether a checkpoint fits the run that wants to resume from it, checked before anything loads.

Loading is all or nothing: the model, the optimizer, the scheduler, the weight average,
the random number generators and the run's settings are compared with the checkpoint
first, and every mismatch is named (keys, shapes, optimizer and scheduler types, groups,
batch settings, RNG states), so a failed resume leaves the user's objects exactly as they were.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import torch

from gpunb.errors import GpunbError
from gpunb.runtime import device as devices
from gpunb.runtime import trainable
from gpunb.runtime.run_state import optimizer_type

_LISTED = 12  # names shown per kind of mismatch; the count says how many more there are

# Settings that define what a step and an epoch are: changing them makes the saved
# position (epoch, batches consumed) point at other data.
_POSITION_SETTINGS = ("batch_size", "grad_accum", "drop_last", "shuffle", "seed")


def check_fits(run, payload: dict, path) -> None:
    """Raise a GpunbError naming every mismatch; return only when everything fits."""
    if getattr(run.dist, "strategy", None) != "fsdp":  # sharded parameters are checked on load
        frozen = payload.get("frozen")  # a checkpoint of what trains: the fingerprint of the frozen rest
        problems = model_problems(run.model, payload["model"], frozen)
        if problems:
            raise GpunbError(f"The checkpoint {path!s} does not fit this model:\n" + _bullets(problems),
                             "resume with the model definition it was trained with, or start fresh "
                             "without `resume`.")
        if frozen:  # computed once a fit: the run's own checkpoints reuse it
            run.state.frozen_fingerprint = trainable.frozen_fingerprint(run.model)
        problems = trainable.base_problems(run.model, frozen, run.state.frozen_fingerprint) if frozen else []
        if problems:
            raise GpunbError(f"The checkpoint {path!s} holds only what trains (adapters, unfrozen layers), and "
                             "this model's frozen weights are not the ones it was trained on:\n" + _bullets(problems),
                             "resume onto the same base model it was trained with (the same pretrained weights, "
                             "dtype and quantization, frozen the same way), or start fresh without `resume`.")
    problems = optimizer_problems(run.stepper.optimizer, payload)
    if problems:
        raise GpunbError(f"The optimizer state in {path!s} does not fit this optimizer:\n" + _bullets(problems),
                         "resume with the same optimizer type and parameter groups it was saved "
                         "with, or start fresh without `resume`.")
    problems = state_problems(run, payload)
    if problems:
        raise GpunbError(f"The checkpoint {path!s} is damaged: the run's state beside the weights cannot be "
                         "restored:\n" + _bullets(problems),
                         "resume from an earlier checkpoint of the run (`resume=<path to a step-*.pt>`), or "
                         "start a fresh run without `resume` (load the weights alone with "
                         "`model.load_state_dict(torch.load(path)['model'])`).")
    problems = config_problems(run.state.settings(), payload.get("config", {}), payload,
                               run.state.world_size)
    if problems:
        raise GpunbError(f"The checkpoint {path!s} was written by a run with other batch settings, so "
                         "its position in the data would point at other samples:\n" + _bullets(problems),
                         "resume with the settings above (e.g. `batch_size=` as saved), or start a "
                         "fresh run without `resume`.")


def model_problems(model: torch.nn.Module, saved: dict, frozen: dict | None = None) -> list[str]:
    """How the weights `saved` differ from `model`'s; `frozen`: the fingerprint of the frozen tensors
    `saved` leaves out (a checkpoint of what trains), which trainable.base_problems compares."""
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items() if name not in (frozen or ())}
    missing = [name for name in expected if name not in saved]
    unexpected = [name for name in saved if name not in expected]
    shapes = [f"{name}: checkpoint {tuple(saved[name].shape)}, model {expected[name]}"
              for name in expected if name in saved and hasattr(saved[name], "shape")
              and tuple(saved[name].shape) != expected[name]]
    problems = []
    if missing:
        problems.append("missing from the checkpoint: " + _names(missing))
    if unexpected:
        problems.append("in the checkpoint but not in the model: " + _names(unexpected))
    problems += [f"shape mismatch {line}" for line in shapes[:_LISTED]]
    if len(shapes) > _LISTED:
        problems.append(f"... and {len(shapes) - _LISTED} more shape mismatches")
    return problems


def optimizer_problems(optimizer: torch.optim.Optimizer, payload: dict) -> list[str]:
    saved = payload["optimizer"]
    saved_type, current_type = payload.get("optimizer_type"), optimizer_type(optimizer)
    if saved_type is not None and saved_type != current_type:
        return [f"the checkpoint holds the state of {saved_type}, this run uses {current_type}"]
    groups = saved.get("param_groups", []) if isinstance(saved, dict) else []
    if len(groups) != len(optimizer.param_groups):
        return [f"the checkpoint has {len(groups)} parameter groups, the optimizer has "
                f"{len(optimizer.param_groups)}"]
    problems = []
    for i, (old, new) in enumerate(zip(groups, optimizer.param_groups)):
        if len(old["params"]) != len(new["params"]):
            problems.append(f"parameter group {i}: {len(old['params'])} parameters in the checkpoint, "
                            f"{len(new['params'])} in the optimizer")
        lacking = sorted(set(optimizer.defaults) - set(old))
        if lacking:
            problems.append(f"parameter group {i} lacks the settings {lacking} of {current_type} "
                            "(it was saved by another optimizer type)")
    if problems:
        return problems
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, state in saved.get("state", {}).items():
        if not isinstance(index, int) or index >= len(params):
            continue  # keyed by name (FSDP): checked when it loads
        for field, value in state.items():
            if torch.is_tensor(value) and value.dim() and value.shape != params[index].shape:
                problems.append(f"state {field!r} of parameter {index}: checkpoint {tuple(value.shape)}, "
                                f"parameter {tuple(params[index].shape)}")
    return problems[:_LISTED]


def state_problems(run, payload: dict) -> list[str]:
    """What would fail to load after the weights: the RNG states, the weight average (the entries
    themselves are there: checkpoint_files.load_checkpoint checks)."""
    problems = rng_problems(payload["rng"], run.state.device)
    ema = payload.get("ema")
    if run.stepper.ema is not None and ema is not None and getattr(run.dist, "strategy", None) != "fsdp":
        weights = ema.get("weights") if isinstance(ema, dict) else None
        if not isinstance(weights, dict) or not isinstance(ema.get("updates"), int):
            problems.append("the weight average ('ema') lacks its weights or update count")
        else:
            lines = model_problems(run.model, weights, payload.get("frozen"))
            problems += [f"weight average: {line}" for line in lines]
    return problems


def rng_problems(saved, device: torch.device) -> list[str]:
    """Each saved RNG state is set into a scratch generator of its kind: the libraries' own checks."""
    if not isinstance(saved, dict):
        return [f"the RNG state is a {type(saved).__name__}, not a dict of states"]
    checks = {"torch": lambda: torch.Generator().set_state(saved["torch"]),
              "python": lambda: random.Random().setstate(devices.python_rng_state(saved)),
              "numpy": lambda: np.random.RandomState().set_state(devices.numpy_rng_state(saved))}
    if device.type == "cuda" and "cuda" in saved:
        checks["cuda"] = lambda: torch.Generator(device=device).set_state(saved["cuda"])
    problems = []
    for name, check in checks.items():
        try:
            check()
        except Exception as error:  # noqa: BLE001 - any failure means the state cannot be set
            problems.append(f"the {name} RNG state cannot be set ({type(error).__name__}: {error})")
    return problems


def data_layout_note(run, payload: dict, path) -> str | None:
    """A warning when the data now gives another number of batches an epoch than when saved."""
    saved, now = payload.get("batches_per_epoch"), run.feed.num_batches
    if saved is None or now is None or saved == now:
        return None
    position = payload["batch_in_epoch"]
    where = (f"epoch {payload['epoch']} goes on after batch {position} of {now}" if position < now else
             f"the saved position (batch {position}) is past the end of the new epoch {payload['epoch']}, "
             "which therefore ends at once")
    total = run.state.total_steps
    end = f" and this run ends at step {total}" if total is not None else ""
    return (f"The checkpoint {Path(path).name} was saved with {saved} batches an epoch and the data now gives "
            f"{now}: {where}, so epochs no longer line up with the saved run's (the step count goes on from "
            f"{payload['step']}{end}). Resume with the data it was saved with for an exact continuation, or "
            "start a fresh run without `resume`.")


def config_problems(settings: dict, saved: dict, payload: dict, world_size: int) -> list[str]:
    """`settings`: the resuming run's, as RunPlan.settings gives them (the batch size chosen)."""
    problems = [f"{name}={saved[name]!r} in the checkpoint, {settings[name]!r} now"
                for name in _POSITION_SETTINGS if name in saved and saved[name] != settings[name]]
    saved_world = payload.get("world_size")
    if saved_world is not None and saved_world != world_size:
        problems.append(f"{saved_world} processes in the checkpoint, {world_size} now")
    return problems


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown if len(names) <= _LISTED else f"{shown} ... and {len(names) - _LISTED} more"


def _bullets(lines: list[str]) -> str:
    return "\n".join(f"  - {line}" for line in lines)


def saved_total_steps(payload: dict) -> int | None:
    """The length the saved schedule was built for (older files: read from the cosine lambda)."""
    if payload.get("total_steps") is not None:
        return payload["total_steps"]
    lambdas = (payload.get("scheduler") or {}).get("lr_lambdas") or [None]
    return lambdas[0].get("total_steps") if isinstance(lambdas[0], dict) else None


def check_schedule(run, payload: dict, path) -> None:
    """Refuse, before anything loads, a scheduler state that cannot drive this run's scheduler."""
    schedule, saved = run.stepper.schedule, payload.get("scheduler")
    if schedule is None or saved is None:
        return
    current = type(schedule.scheduler).__name__
    saved_type = payload.get("scheduler_type")
    if saved_type is not None:
        other_class = saved_type != current
    else:  # a checkpoint from before the class was saved: its settings' names tell
        other_class = _public(saved) != _public(schedule.state_dict())
    if other_class:
        raise GpunbError(f"The checkpoint {path!s} holds the state of {saved_type or 'another scheduler class'}, "
                         f"and this run's scheduler is {current}: its settings would drive the other "
                         "class's formula.",
                         "resume with the scheduler the run was saved with (the same `scheduler=` or "
                         "`lr_schedule=`), or start a fresh run without `resume` (`model` can load the "
                         "checkpoint's weights).")
    old, new = saved_total_steps(payload), run.state.total_steps
    if run.config.lr_schedule == "one-cycle" and old not in (None, new):
        raise GpunbError(f"The checkpoint {path!s} is {old} steps into a one-cycle schedule planned for "
                         f"{old} steps in all; this run is {new} steps long, and a one-cycle schedule "
                         "cannot be stretched part-way.",
                         "resume with the `epochs`/`max_steps` it was saved with, or train the extra "
                         "epochs with `lr_schedule='cosine'` or `'none'` in a fresh run "
                         "(`model` keeps the trained weights).")
    _check_fixed_length(run, saved, path)


def _public(state: dict) -> set:
    """A scheduler state's setting names (older files name no class: these tell it)."""
    return {key for key in state if not key.startswith("_") and key != "verbose"}


def _check_fixed_length(run, saved: dict, path) -> None:
    """A OneCycleLR's `total_steps` is fixed when it is built: past it, torch raises mid-run."""
    length, schedule = saved.get("total_steps"), run.stepper.schedule
    if not isinstance(length, int) or schedule.plateau:
        return
    needed = run.state.total_steps if schedule.interval == "step" else run.plan.epoch_limit
    unit = "steps" if schedule.interval == "step" else "epochs"
    if needed is not None and needed > length:
        raise GpunbError(f"The checkpoint {path!s} holds a {type(schedule.scheduler).__name__} built for "
                         f"{length} {unit} (its `total_steps`, fixed when it is built), and this run has "
                         f"{needed}: torch would raise once the schedule passes its end.",
                         "resume with the `epochs`/`max_steps` it was saved with; to train longer, start "
                         "a fresh run from the trained weights (`model` keeps them) with a new schedule.")


def stretch_schedule(run, payload: dict) -> str | None:
    """After loading: a cosine schedule restored for another run length decays over the new one."""
    from gpunb.runtime.state.continuing import stretch_cosine

    schedule, old, new = run.stepper.schedule, saved_total_steps(payload), run.state.total_steps
    if schedule is None or schedule.builtin != "cosine" or payload.get("scheduler") is None or old in (None, new):
        return None
    before, after = stretch_cosine(schedule.scheduler, new)
    return (f"The checkpoint's cosine schedule was planned for {old} steps and this run has {new}: "
            f"it now decays to zero at step {new} (learning rate {before:.3g} -> {after:.3g} "
            f"at step {payload['step']}).")


_PLAIN = (int, float, str, bool, list, tuple, type(None))  # settings compared; tensors and objects are not
_PROGRESS = {"last_epoch", "base_lrs", "lr_lambdas", "best", "num_bad_epochs", "cooldown_counter", "verbose"}


def load_schedule(run, payload: dict, path) -> str | None:
    """Load the saved schedule into the run's; returns a warning to show (rank 0), or None.

    A built-in cosine planned for another length decays over the new one; a schedule the
    checkpoint lacks is moved on to the saved step (it ends where it was planned); a saved
    one this run lacks is named, since the learning rate then stays where it was.
    """
    schedule, saved = run.stepper.schedule, payload.get("scheduler")
    if schedule is None:
        if saved is None:
            return None
        lr = run.stepper.optimizer.param_groups[0]["lr"]
        return (f"The checkpoint {Path(path).name} holds a learning-rate schedule "
                f"({payload.get('scheduler_type') or 'a scheduler'}) and this run has none: the learning rate "
                f"stays at {lr:.3g}, the one saved at step {payload['step']}. Pass the same `scheduler=` or "
                "`lr_schedule=` to follow the schedule on.")
    if saved is None:
        return fast_forward(schedule, payload, path)
    built = schedule.state_dict()
    schedule.load_state_dict(saved)
    if schedule.builtin is not None:
        return stretch_schedule(run, payload)
    changed = [f"{key}={saved[key]!r} (this run built {built[key]!r})" for key in sorted(saved)
               if key in built and key not in _PROGRESS and not key.startswith("_")
               and isinstance(saved[key], _PLAIN) and saved[key] != built[key]]
    if not changed:
        return None
    return (f"The checkpoint's {type(schedule.scheduler).__name__} was saved with " + ", ".join(changed) +
            ": a resumed scheduler goes on with its saved settings. Start a fresh run from the trained "
            "weights to follow the new ones.")


def fast_forward(schedule, payload: dict, path) -> str | None:
    """Step a schedule the checkpoint lacks on to the saved position, as if it had run from the start."""
    if schedule.plateau:
        return None  # it steps with the validation metric: it starts watching from here
    scheduler = schedule.scheduler
    count = payload["step"] if schedule.interval == "step" else payload["epoch"]
    groups = scheduler.optimizer.param_groups
    for group, lr in zip(groups, scheduler.get_last_lr()):  # loading the optimizer set the saved, constant rate
        group["lr"] = lr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": on purpose here
        for _ in range(count):
            scheduler.step()
    unit = "step" if schedule.interval == "step" else "epoch"
    return (f"The checkpoint {Path(path).name} was saved without a learning-rate schedule, and this run has "
            f"one ({type(scheduler).__name__}): it was moved on to {unit} {count}, as if it had run from the "
            f"start (learning rate now {groups[0]['lr']:.3g}), so it ends where it was planned; the "
            f"{payload['step']} steps before trained at a constant rate.")
