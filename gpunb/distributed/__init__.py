"""Process launch and torch.distributed set-up for multi-device runs.

    context.py   where this process stands (one process, or a rank of a group) and what differs
    launch.py    a devices=N fit from a notebook: start the ranks, drive them, collect
    worker.py    the body of each started rank
    relay.py     rank 0's events to the kernel and the kernel's mirror of its run, weights and
                 reports back: one relay for launched ranks (a queue) and a job's tasks (a file)
    shipping.py  fit's arguments to spawned ranks (cloudpickle), with errors that name the culprit
    fsdp.py      strategy="fsdp": FSDP2 sharding and full state dicts

Importing this package touches neither CUDA nor torch.distributed.
"""

from __future__ import annotations


def save_weights(model, path) -> None:
    """Save `model`'s full weights (a plain state dict) to `path` from rank 0.

    In a process group every rank must call it: with FSDP the shards are gathered to
    rank 0 first. Outside one it is `torch.save(model.state_dict(), path)`.
    """
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            from gpunb.distributed.fsdp import full_state_dicts

            state, _ = full_state_dicts(model, None, dist.get_rank())
        else:
            state = model.state_dict() if dist.get_rank() == 0 else None
        if dist.get_rank() != 0:
            return
    else:
        state = model.state_dict()
    torch.save(state, path)
