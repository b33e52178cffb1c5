"""The optimizer rebuilt for a memory plan's optimizer measures, and what rules that out.

torchao's Adam(W) stands in for the user's: with 8-bit states (embeddings' kept 32-bit), with
its states and gradients on the host, or with bf16 weights whose update rounds stochastically;
the step in backward (in_backward.py) wraps whichever optimizer trains. The groups and the
hyperparameters stay the user's.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

_ADAMS = ("Adam", "AdamW")
_HYPER = ("lr", "betas", "eps", "weight_decay")


@dataclass
class Recipe:
    """How the optimizer is rebuilt for the plan (the same groups and hyperparameters)."""

    states: str = ""  # "8bit", "cpu", or "" (torchao's plain Adam(W) where `torchao` is set)
    torchao: bool = False
    rounding: bool = False  # bf16 weights: the update rounds stochastically
    in_backward: bool = False

    @property
    def changes(self) -> bool:
        return self.torchao or self.in_backward


def rebuilt_optimizer(optimizer, recipe: Recipe, full_states=()):
    """`optimizer` rebuilt as `recipe` says; `full_states`: parameters whose states stay 32-bit
    under 8-bit states."""
    if not recipe.changes:
        return optimizer
    make = functools.partial(_torchao_optimizer, type(optimizer).__name__, recipe, full_states) if recipe.torchao \
        else functools.partial(_same_kind, optimizer)
    if recipe.in_backward:
        from gpunb.runtime.memory.in_backward import OptimizerInBackward

        return OptimizerInBackward(optimizer.param_groups, make)
    return make(optimizer.param_groups)


def _same_kind(optimizer, groups):
    return type(optimizer)([{k: v for k, v in g.items() if k != "initial_lr"} for g in groups])


def _torchao_optimizer(kind: str, recipe: Recipe, full_states, groups):
    import torch

    from gpunb.quiet import import_quietly

    optim = import_quietly("torchao.optim")  # without torchao's notices about its extensions

    groups = [{key: g[key] for key in ("params", *_HYPER) if key in g} for g in groups]
    rounding = {"bf16_stochastic_round": recipe.rounding}
    if recipe.states == "cpu":
        inner = optim._AdamW if kind == "AdamW" else torch.optim.Adam
        extra = rounding if inner is optim._AdamW else {}
        return optim.CPUOffloadOptimizer(groups, inner, offload_gradients=True, **extra)
    if recipe.states == "8bit":
        eight_bit = _with_full_states(optim.AdamW8bit if kind == "AdamW" else optim.Adam8bit)
        return eight_bit(groups, full_states=full_states, **rounding)
    return optim._AdamW(groups, **rounding) if kind == "AdamW" else optim._Adam(groups, **rounding)


@functools.cache
def _with_full_states(eight_bit: type) -> type:
    """torchao's 8-bit Adam(W) keeping 32-bit states for the parameters given as `full_states`
    (torchao decides per tensor in `_new_buffer`: its own rule keeps small tensors 32-bit)."""
    import torch

    class FullStatesFor(eight_bit):
        def __init__(self, params, *, full_states=(), **options):
            super().__init__(params, **options)
            self.full_states = {id(p) for p in full_states}

        def _new_buffer(self, p, signed: bool):
            if id(p) in self.full_states:
                return torch.zeros_like(p)
            return super()._new_buffer(p, signed)

    FullStatesFor.__name__ = FullStatesFor.__qualname__ = eight_bit.__name__  # what checkpoints name
    return FullStatesFor


def why_not_replaced(optimizer, scheduler, continuing) -> str | None:
    """Why the optimizer cannot be rebuilt with other states or steps, or None."""
    import torch
    from torch.optim.lr_scheduler import LRScheduler

    held = scheduler.get("scheduler") if isinstance(scheduler, dict) else scheduler
    if isinstance(held, LRScheduler):
        return "the scheduler given is bound to the optimizer given"
    if continuing:
        return "a resumed or continued run goes on with its optimizer's saved state"
    if optimizer.state:
        return "the optimizer already holds state"
    if getattr(optimizer.zero_grad, "__func__", None) is not torch.optim.Optimizer.zero_grad:
        return f"{type(optimizer).__name__} is not a plain torch optimizer"
    return None


def why_not_torchao(optimizer) -> str | None:
    if type(optimizer).__name__ not in _ADAMS or type(optimizer).__module__.split(".")[0] != "torch":
        return f"torchao's states replace Adam or AdamW, and the optimizer is {type(optimizer).__name__}"
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        return "amsgrad is not in torchao's 8-bit AdamW"
    if importlib.util.find_spec("torchao") is None:  # not imported here: a plan that needs none stays light
        return "torchao is not installed (`pip install gpunb[llm]`)"
    return None
