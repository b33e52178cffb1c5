"""DDP or FSDP: the strategy a run of several processes trains under, chosen once, and said once.

`strategy="auto"` (the default) plans DDP first; when its weights, gradients and states are over
the budget on any rank (the ranks vote through the context's `smallest`, so all decide alike),
the plan is made again with FSDP sharding, and taken when that one fits. An explicit "ddp"
keeps DDP and the message that names `strategy='fsdp'`; `memory_plan=False` keeps DDP.
prepare.py tells the context the answer before anything wraps the model.
"""

from __future__ import annotations

from typing import NamedTuple

from gpunb.runtime.memory.measures import AUTO_SHARDS, FSDP, why_not_sharded
from gpunb.runtime.memory.plan import SAFETY, MemoryPlan, plan_memory


class Strategy(NamedTuple):
    """The strategy a run trains under (None: one process) and why."""

    name: str | None
    reason: str = ""

    def line(self) -> str:
        """`strategy: fsdp — DDP needs ...` where "auto" chose to shard; "" otherwise."""
        from gpunb.render import strategy_line

        return strategy_line(self.name, self.reason)


def run_strategy(config, world_size: int, memory: MemoryPlan | None) -> Strategy:
    """The one asked for, or under "auto" DDP unless the memory plan shards (then the plan says
    the numbers)."""
    if world_size < 2:
        return Strategy(None)
    from gpunb.render import ASKED_FOR  # not on a one-process run's path

    if config.strategy != "auto":
        return Strategy(config.strategy, ASKED_FOR)
    if memory is not None and memory.has(FSDP):
        return Strategy("fsdp", memory.strategy_reason)
    if not config.memory_plan:
        return Strategy("ddp", "auto: memory_plan=False keeps DDP")
    if memory is None:
        return Strategy("ddp", "auto: no memory budget known")
    return Strategy("ddp", "auto: the whole model fits on each device")


def auto_sharded(plan: MemoryPlan, footprint, budget: int, unavailable: dict, kept: tuple, config,
                 dist) -> tuple[MemoryPlan | None, bool]:
    """Under strategy="auto", when any rank's DDP plan is over: (the FSDP plan, False) where it fits
    or is over by its activations alone, else (None, True). Otherwise (None, whether `plan` is over)."""
    over = not plan.fits and plan.fixed_after > SAFETY * budget
    # every rank shards when any rank's DDP estimate is over (0 is the vote to shard)
    if not may_shard(config, dist.world_size, unavailable) or dist.smallest(0 if over else 1) != 0:
        return None, over
    sharded = sharded_plan(footprint, budget, unavailable, kept)
    if not sharded.fits and sharded.fixed_after > SAFETY * budget:
        return None, True  # sharded too, the weights, gradients and states are over
    from gpunb.render import format_bytes  # only when it is said

    sharded.strategy_reason = (f"DDP needs {format_bytes(plan.after)} per device of "
                               f"{format_bytes(budget)}; sharded: {format_bytes(sharded.after)}")
    return sharded, False


def may_shard(config, world_size: int, unavailable: dict) -> bool:
    """Whether this run decides DDP or FSDP itself (strategy="auto"), from the estimate."""
    return world_size > 1 and config.strategy == "auto" and config.memory_plan and \
        unavailable.get(FSDP.name) == AUTO_SHARDS


def sharded_plan(footprint, budget: int, unavailable: dict, kept: tuple) -> MemoryPlan:
    """The plan with FSDP sharding, and what else it needs."""
    allowed = {name: why for name, why in unavailable.items() if name != FSDP.name}
    return plan_memory(footprint, budget, allowed, (*kept, FSDP))


def offers_sharding(config, world_size: int) -> bool:
    """Whether the does-not-fit message may offer FSDP: the user's switch ("ddp"), or "auto" where
    nothing rules FSDP out."""
    return world_size > 1 and (config.strategy == "ddp" or
                               (config.strategy == "auto" and why_not_sharded(config) is None))
