"""strategy="fsdp": torch's FSDP2 (`fully_shard`) for models that do not fit on one device.

Each block (the blocks activation checkpointing picks: the items of the model's
ModuleList/Sequential children, else its children with parameters) is sharded on
its own, then the root: a block's full weights exist only while it computes.

Checkpoints and the weights sent back to the notebook are full state dicts gathered
to rank 0 (on the CPU); loading scatters them back from rank 0. Optimizer state in a
full state dict is keyed by parameter name, so it fits any strategy.
"""

from __future__ import annotations

import torch

from gpunb.runtime.step.wrap import model_blocks


def shard(model: torch.nn.Module, device: torch.device, world_size: int):
    """Shard `model` in place; returns it and the (old, new) parameter pairs for the optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    before = list(model.named_parameters())
    mesh = init_device_mesh(device.type, (world_size,))
    for block in model_blocks(model):
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    after = dict(model.named_parameters())
    return model, [(old, after[name]) for name, old in before]


def rebind_optimizer(optimizer, model, replaced) -> None:
    """Point the optimizer's groups at the sharded parameters, keeping any state it had."""
    new_for = {id(old): new for old, new in replaced}
    old_state = optimizer.state_dict() if optimizer.state else None  # by index: survives the swap
    for group in optimizer.param_groups:
        group["params"] = [new_for.get(id(p), p) for p in group["params"]]
    if old_state is not None:  # e.g. the optimizer of an earlier fit in the notebook
        optimizer.state.clear()
        _load_full_optimizer_state(model, optimizer, _by_name(old_state, _names_in_order(model, optimizer)))


def full_state_dicts(model, optimizer, rank: int):
    """(model, optimizer) full state dicts on rank 0, on the CPU; (None, None) elsewhere."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)  # collective: every rank calls it
    optimizer_state = (get_optimizer_state_dict(model, optimizer, options=options)
                       if optimizer is not None else None)
    if rank != 0:
        return None, None
    return model_state, optimizer_state


def load_model_state(model, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)


def load_optimizer_state(model, optimizer, state: dict) -> None:
    _load_full_optimizer_state(model, optimizer, _by_name(state, _names_in_order(model, optimizer)))


def _names_in_order(model, optimizer) -> list:
    """The names of the optimizer's parameters, in the order its state dict numbers them."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _by_name(state: dict, order: list) -> dict:
    """`state` keyed by parameter name (`order` names the optimizer's parameters in order)."""
    groups = state.get("param_groups", [])
    if groups and groups[0].get("params") and isinstance(groups[0]["params"][0], str):
        return state
    return {"state": {order[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in groups]}


def _load_full_optimizer_state(model, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optimizer, state, options=options)
