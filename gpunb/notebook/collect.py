"""Which of the namespace's objects a %%gputrain cell trains: one per role (model,
train_data, optimizer, ...), type-checked, with a UsageError that names the fix, and
refused when the cell bound a new model or data under another name than the one trained.
The other roles an earlier cell left behind are used only when they match (leftovers.py)."""

from __future__ import annotations

from IPython.core.error import UsageError

from gpunb.notebook.leftovers import drop_mismatched
from gpunb.runtime.roles import NAMES, REQUIRED, by_name, check_kinds


def collect(namespace, args, before, named=frozenset(), required=REQUIRED) -> dict:
    """The objects the cell defined for each role, type-checked; UsageError names the fix.

    `named`: the roles whose variable the magic line names explicitly (`--model net`).
    """
    found = {}
    for role in NAMES:
        name = getattr(args, f"{role}_name")
        found[role] = namespace.get(name)
    if found["loss_fn"] is not None and found["step"] is not None:
        # One of them is often left over from an earlier cell: keep the one this cell bound.
        fresh = {role for role in ("loss_fn", "step")
                 if before.get(getattr(args, f"{role}_name")) != id(found[role])}
        if len(fresh) == 1:
            found[({"loss_fn", "step"} - fresh).pop()] = None
    for role in required:
        if found[role] is None:
            name = getattr(args, f"{role}_name")
            raise UsageError(f"%%gputrain needs a variable `{name}` ({by_name(role).what}), "
                             f"and the namespace has none.\n{_defined_by_cell(namespace, before)}\n"
                             f"HINT: name it `{name}` in the cell, or pass "
                             f"`--{role.replace('_', '-')} <variable>`.")
    _refuse_stale(namespace, args, before, found, named)
    check_kinds({role: found[role] for role in NAMES})  # RoleError: usage_errors names the variable
    # an earlier cell's val_data, loss_fn, ...: used only when they match (leftovers.py)
    drop_mismatched(args, before, found, named, evaluating="train_data" not in required)
    callbacks = found["callbacks"]
    if callbacks is None:
        callbacks = []
    elif not isinstance(callbacks, (list, tuple)):
        callbacks = [callbacks]
    found["callbacks"] = list(callbacks)
    return found


def named_options(line: str) -> frozenset:
    """Roles whose variable the line names (`--model net`): the user chose it, stale or not."""
    tokens = {token.split("=")[0] for token in line.split()}
    return frozenset(role for role in NAMES if f"--{role.replace('_', '-')}" in tokens)


def _refuse_stale(namespace, args, before, found, named) -> None:
    """A cell that left `model` (or `train_data`) alone but bound a new one under another name.

    Training would silently use the object from an earlier cell; the new one is almost always
    what the user meant. Naming the variable on the line (`--model model`) keeps the old one.
    """
    roles = {id(found[role]) for role in NAMES if found[role] is not None}
    parts = _parts_of(found)
    for role, looks_like in (("model", _is_module), ("train_data", _is_data)):
        name = getattr(args, f"{role}_name")
        if role in named or found[role] is None or before.get(name) != id(found[role]):
            continue  # the cell bound it, or the line chose it
        fresh = [other for other, value in namespace.items()
                 if not other.startswith("_") and before.get(other) != id(value) and looks_like(value)
                 and id(value) not in roles and id(value) not in parts]
        if fresh:
            other = fresh[0]
            option = f"--{role.replace('_', '-')}"
            raise UsageError(
                f"The cell defined {other} ({type(namespace[other]).__name__}) but {name} is from an "
                f"earlier cell: %%gputrain would train that older {name}.\n"
                f"HINT: name it {name} (`{name} = {other}`) or pass `{option} {other}` "
                f"(`{option} {name}` keeps the earlier one).")


def _parts_of(found) -> set:
    """Ids of the objects inside the collected ones (the model's submodules, the data's tensors)."""
    import torch

    parts = set()
    model = found["model"]
    if isinstance(model, torch.nn.Module):
        parts.update(id(m) for m in model.modules())
    for role in ("train_data", "val_data"):
        if isinstance(found[role], (list, tuple)):
            parts.update(id(item) for item in found[role])
    return parts


def _is_module(value) -> bool:
    import torch

    # A loss module bound beside the model (`criterion = nn.CrossEntropyLoss()`) is not a model.
    return isinstance(value, torch.nn.Module) and not isinstance(value, torch.nn.modules.loss._Loss)


def _is_data(value) -> bool:
    import torch
    from torch.utils.data import DataLoader, Dataset

    if isinstance(value, (Dataset, DataLoader)):
        return True
    if isinstance(value, torch.Tensor):
        return value.ndim > 0
    return isinstance(value, tuple) and len(value) > 1 and all(_array_like(v) for v in value)


def _array_like(value) -> bool:
    """A tensor, NumPy array or table with a sample dimension (what `(x, y)` data holds)."""
    shape = getattr(value, "shape", None)  # torch.Size is a tuple too
    return isinstance(shape, tuple) and len(shape) > 0 and hasattr(value, "__array__")


def _defined_by_cell(namespace, before) -> str:
    """Names the cell bound (new or rebound), so the error shows what it did define."""
    import types

    new = [name for name, value in namespace.items()
           if not name.startswith("_") and before.get(name) != id(value)
           and not isinstance(value, types.ModuleType)]
    if not new:
        return "The cell defined no new variables."
    listed = ", ".join(f"{name} ({type(namespace[name]).__name__})" for name in new[:12])
    return f"The cell defined: {listed}."
