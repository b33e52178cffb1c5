"""Where this process stands in a (possibly) distributed run."""

from __future__ import annotations

import torch


class SingleProcess:
    """The one-process case: no process group, nothing to reduce."""

    rank = 0
    local_rank = 0
    world_size = 1

    def reduce_sums(self, sums: dict, count: int) -> dict:
        """Means of device-side sums over `count` samples, as floats (one sync)."""
        if not sums:
            return {}
        values = torch.stack([v.float() for v in sums.values()]).cpu() / max(1, count)
        return dict(zip(sums, values.tolist()))

    def wrap(self, model, device):
        return model


def current_context(config):
    """The distributed context of this process (single process unless a group is running)."""
    return SingleProcess()
