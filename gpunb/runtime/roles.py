"""The objects one fit takes, by role: named once here and iterated by name everywhere else.

The magics collect these from a cell, the export writes them into a script, the profiler
takes them as `train=dict(...)`, and the launcher ships them to spawned ranks. The checks of
each object's kind live here too, once: every way into a fit calls them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpunb.errors import GpunbError


@dataclass(frozen=True)
class Role:
    name: str  # fit()'s parameter, and the variable a %%gputrain cell binds by default
    what: str  # what the value is, for help text and errors
    required: bool = False
    setup: bool = True  # part of the training set-up (callbacks only watch a run: not shipped, not profiled)


ROLES = (
    Role("model", "an nn.Module", required=True),
    Role("train_data", "the training data", required=True),
    Role("val_data", "the validation data"),
    Role("optimizer", "a torch.optim.Optimizer"),
    Role("scheduler", "a torch LR scheduler, or a factory f(optimizer, total_steps) -> scheduler"),
    Role("loss_fn", "a loss function"),
    Role("step", "a step(model, batch) -> loss function"),
    Role("metrics", "metric functions"),
    Role("callbacks", "callback objects", setup=False),
)
NAMES = tuple(role.name for role in ROLES)
REQUIRED = tuple(role.name for role in ROLES if role.required)
SETUP = tuple(role.name for role in ROLES if role.setup)  # what a run is trained with
OPTIONAL_SETUP = tuple(name for name in SETUP if name not in REQUIRED)  # fit()'s keyword set-up


def by_name(name: str) -> Role:
    return next(role for role in ROLES if role.name == name)


class RoleError(GpunbError):
    """An object of the wrong kind for its role; `role` says which (a notebook names its variable)."""

    def __init__(self, role: str, what: str, hint: str):
        super().__init__(what, hint)
        self.role = role


def check_model(model) -> None:
    """The one check of the `model` role, before any work: fit, predict, evaluate and the profiler."""
    import torch  # here, not at the top: the magics read ROLES without loading torch

    if not isinstance(model, torch.nn.Module):
        raise RoleError("model", f"`model` must be a torch.nn.Module, got a {type(model).__name__}.",
                        "pass the module itself (an instance, not a torch.nn.Module class or a function), "
                        "e.g. `model = nn.Sequential(...)`.")


def check_kinds(objects: dict) -> None:
    """Each of fit's objects given (not None) is of its role's kind: the checks every way into a
    fit makes first (Trainer.fit, the magics), before any work. Data are checked where they
    are adapted (feed/inputs), the optimizer's parameters by the optimizer's own check."""
    for role, value in objects.items():
        if value is not None and role in _KIND_CHECKS:
            _KIND_CHECKS[role](value)


def check_optimizer_kind(optimizer) -> None:
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise RoleError("optimizer", f"`optimizer` must be a torch.optim.Optimizer, got a "
                        f"{type(optimizer).__name__}.",
                        "pass e.g. `torch.optim.AdamW(model.parameters(), lr=1e-3)` (an instance, not a "
                        "torch.optim.Optimizer class), or leave it out for the default AdamW.")


def check_is_schedule(value) -> None:
    """Refuse early what is neither a scheduler, a factory nor a scheduler dict."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    inner = value.get("scheduler") if isinstance(value, dict) else value
    if not (isinstance(inner, (LRScheduler, ReduceLROnPlateau)) or callable(inner)):
        raise RoleError("scheduler", f"`scheduler` must be a torch LR scheduler, a factory "
                        f"`f(optimizer, total_steps)` or a dict with a 'scheduler' key; got a "
                        f"{type(value).__name__}.",
                        "e.g. `scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)`.")


def check_callable(role: str, value) -> None:
    if not callable(value):
        kind = type(value).__name__
        raise RoleError(role, f"`{role}` must be callable, got a {kind}.",
                        f"pass a function or a module, e.g. `loss_fn=torch.nn.CrossEntropyLoss()` "
                        f"(a {kind} is not callable).")


_KIND_CHECKS = {
    "model": check_model,
    "optimizer": check_optimizer_kind,
    "scheduler": check_is_schedule,
    "loss_fn": lambda value: check_callable("loss_fn", value),
    "step": lambda value: check_callable("step", value),
}
