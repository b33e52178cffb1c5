"""The objects one fit takes, by role: named once here and iterated by name everywhere else.

The magics collect these from a cell, the export writes them into a script, the profiler
takes them as `train=dict(...)`, and the launcher ships them to spawned ranks.
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


def check_model(model) -> None:
    """The one check of the `model` role, before any work: fit, predict, evaluate and the profiler."""
    import torch  # here, not at the top: the magics read ROLES without loading torch

    if not isinstance(model, torch.nn.Module):
        raise GpunbError(f"`model` must be a torch.nn.Module, got a {type(model).__name__}.",
                         "pass the module itself, e.g. `model = nn.Sequential(...)`.")
