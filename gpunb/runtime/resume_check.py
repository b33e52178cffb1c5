"""Whether a checkpoint fits the run that wants to resume from it, checked before anything loads.

Loading is all or nothing: the model, the optimizer and the run's settings are
compared with the checkpoint first, and every mismatch is named (keys, shapes,
optimizer type and groups, batch settings), so a failed resume leaves the user's
objects exactly as they were.
"""

from __future__ import annotations

import torch

from gpunb.errors import GpunbError

_LISTED = 12  # names shown per kind of mismatch; the count says how many more there are

# Settings that define what a step and an epoch are: changing them makes the saved
# position (epoch, batches consumed) point at other data.
_POSITION_SETTINGS = ("batch_size", "grad_accum", "drop_last", "shuffle", "seed")


def check_fits(run, payload: dict, path) -> None:
    """Raise a GpunbError naming every mismatch; return only when everything fits."""
    if getattr(run.dist, "strategy", None) != "fsdp":  # sharded parameters are checked on load
        problems = model_problems(run.model, payload["model"])
        if problems:
            raise GpunbError(f"The checkpoint {path!s} does not fit this model:\n" + _bullets(problems),
                             "resume with the model definition it was trained with, or start fresh "
                             "without `resume`.")
    problems = optimizer_problems(run.stepper.optimizer, payload)
    if problems:
        raise GpunbError(f"The optimizer state in {path!s} does not fit this optimizer:\n" + _bullets(problems),
                         "resume with the same optimizer type and parameter groups it was saved "
                         "with, or start fresh without `resume`.")
    problems = config_problems(run.config, payload.get("config", {}), payload, run.state.world_size)
    if problems:
        raise GpunbError(f"The checkpoint {path!s} was written by a run with other batch settings, so "
                         "its position in the data would point at other samples:\n" + _bullets(problems),
                         "resume with the settings above (e.g. `batch_size=` as saved), or start a "
                         "fresh run without `resume`.")


def model_problems(model: torch.nn.Module, saved: dict) -> list[str]:
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
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
    saved_type, current_type = payload.get("optimizer_type"), type(optimizer).__name__
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


def config_problems(config, saved: dict, payload: dict, world_size: int) -> list[str]:
    problems = [f"{name}={saved[name]!r} in the checkpoint, {getattr(config, name)!r} now"
                for name in _POSITION_SETTINGS if name in saved and saved[name] != getattr(config, name)]
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
    """A one-cycle schedule cannot be stretched to a new run length: refuse, saying how."""
    old, new = saved_total_steps(payload), run.state.total_steps
    if run.stepper.schedule is None or payload.get("scheduler") is None or old in (None, new):
        return
    if run.config.lr_schedule == "one-cycle":
        raise GpunbError(f"The checkpoint {path!s} is {old} steps into a one-cycle schedule planned for "
                         f"{old} steps in all; this run is {new} steps long, and a one-cycle schedule "
                         "cannot be stretched part-way.",
                         "resume with the `epochs`/`max_steps` it was saved with, or train the extra "
                         "epochs with `lr_schedule='cosine'` or `'none'` in a fresh run "
                         "(`model` keeps the trained weights).")


def stretch_schedule(run, payload: dict) -> str | None:
    """After loading: a cosine schedule restored for another run length decays over the new one."""
    from gpunb.runtime.continuing import stretch_cosine

    schedule, old, new = run.stepper.schedule, saved_total_steps(payload), run.state.total_steps
    if schedule is None or schedule.builtin != "cosine" or payload.get("scheduler") is None or old in (None, new):
        return None
    before, after = stretch_cosine(schedule.scheduler, new)
    return (f"The checkpoint's cosine schedule was planned for {old} steps and this run has {new}: "
            f"it now decays to zero at step {new} (learning rate {before:.3g} -> {after:.3g} "
            f"at step {payload['step']}).")
