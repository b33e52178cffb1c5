"""The context of a one-process run: no process group, nothing to reduce.

The loop (loop.py) receives a context and calls the same methods on it whether it
trains alone or as one rank of a group; gpunb.distributed.context has the rank's
version. This one lives here so that a one-process run needs nothing from above.

    reduce_loss(mean_loss, state)  the log interval's one sync
    sync_stop(state)               a stop vote at an epoch's end (nothing to vote on here)
    reduce_sums(sums, count)       validation means
    wrap(model, device)            the model the loop calls (here: the model itself)
    adopt_shards(optimizer)        after wrap: point the optimizer at sharded parameters (nothing here)
    grad_scaler                    the fp16 loss scaler's class for Precision (None: torch's own)
    state_dicts / load_*           checkpoints
"""

from __future__ import annotations

import torch

from gpunb.runtime.trainable import load_weights


class LocalContext:
    """One process, no process group."""

    rank = 0
    local_rank = 0
    world_size = 1
    stops_by_vote = False  # a stop applies at once (RunState.request_stop)
    grad_scaler = None  # Precision's default, torch.amp.GradScaler

    def reduce_loss(self, mean_loss: torch.Tensor, state) -> float:
        return mean_loss.item()

    def sync_stop(self, state) -> None:
        pass

    def smallest(self, value: int) -> int:
        return value

    def reduce_sums(self, sums: dict, count: int) -> dict:
        """Means of device-side sums over `count` samples, as floats (one sync)."""
        if not sums:
            return {}
        values = torch.stack([v.float() for v in sums.values()]).cpu() / max(1, count)
        return dict(zip(sums, values.tolist()))

    def wrap(self, model, device):
        return model

    def adopt_shards(self, optimizer) -> None:
        pass

    def state_dicts(self, model, optimizer) -> tuple[dict, dict | None]:
        return model.state_dict(), optimizer.state_dict() if optimizer is not None else None

    def load_model_state(self, model, state: dict) -> None:
        load_weights(model, state)  # a checkpoint may hold only what trains

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        optimizer.load_state_dict(optimizer_state_by_index(state, model, optimizer))


def optimizer_state_by_index(state: dict, model, optimizer) -> dict:
    """An optimizer state dict keyed by parameter index, as `Optimizer.load_state_dict` wants.

    FSDP checkpoints key it by parameter name; a run without FSDP resuming from one
    (or the notebook receiving an FSDP run's optimizer) needs indices again.
    """
    groups = state.get("param_groups", [])
    if not groups or not groups[0].get("params") or not isinstance(groups[0]["params"][0], str):
        return state
    names = {id(p): name for name, p in model.named_parameters()}
    index = {names[id(p)]: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in groups]}
