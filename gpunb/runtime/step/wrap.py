"""What the loop calls instead of the user's module: checkpointed, distributed (compiled: engines.py).

Every change is undone by the returned `unwrap()`, so the notebook's model object is
left as it was given (same class, same state_dict keys), only trained.
"""

from __future__ import annotations

import functools

import torch


def wrap_model(model: torch.nn.Module, config, dist, device, checkpointing=None):
    """`checkpointing(model)`: activation checkpointing put in place, returning its undo (memory/blocks.py)."""
    undo = []
    if checkpointing is not None:
        undo.append(checkpointing(model))
    train_model = model
    if dist.world_size > 1:
        train_model = dist.wrap(train_model, device)
        if train_model is not model and config.compile is not False and _forward_is_torchs(model):
            undo.append(trace_from_here(model))

    def unwrap():
        for restore in reversed(undo):
            restore()

    return train_model, unwrap


def trace_from_here(model: torch.nn.Module):
    """Under DDP, torch.compile of the wrapper traces from the wrapped model's forward, and
    Dynamo starts no trace in torch's own files: a model of torch's classes (nn.Sequential)
    would run eager, compiled or not. A forward of gpunb's in front of the model's is a frame
    Dynamo traces, and it inlines torch's from there. Returns a function that takes it away."""
    own = model.__dict__.get("forward")  # a forward set on the instance, to put back
    forward = model.forward

    def forward_traced_from_here(*args, **kwargs):
        return forward(*args, **kwargs)

    model.forward = forward_traced_from_here

    def restore():
        if own is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = own

    return restore


def _forward_is_torchs(model: torch.nn.Module) -> bool:
    forward = model.forward
    while isinstance(forward, functools.partial):
        forward = forward.func
    module = getattr(getattr(forward, "__func__", forward), "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


def model_blocks(model: torch.nn.Module) -> list:
    """The model's blocks: the items of every ModuleList / Sequential among its direct
    children (a transformer's layers), or else each direct child that has parameters.
    FSDP shards them one by one; activation checkpointing takes them where the model has no
    repeated blocks (memory/blocks.py)."""
    blocks = [block for child in model.children()
              if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) for block in child]
    if not blocks:
        blocks = [child for child in model.children() if any(True for _ in child.parameters())]
    return blocks

