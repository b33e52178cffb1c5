"""The memory measures, one class each: what it saves, what it costs, when it is allowed, how it is applied.

The planner (plan.py) prices the measures in MEASURES against a run's estimate; planning.py
asks each whether this run allows it and puts the chosen ones in place. A new measure is one
class here and one line in MEASURES (whose order is the order a plan lists measures of one price).

What each measure saves:

    chunked_loss           the loss's fp32 logits and their gradient, computed a chunk of the
                           sequence at a time (a 128k vocabulary's logits are the largest
                           activation of a small batch)
    checkpointing (k of n) per block: its saved activations less its input, which is kept;
                           plus one block's activations while it is recomputed
    optimizer_in_backward  the gradients, but for the one being applied (each parameter steps
                           as soon as its gradient is complete, and the gradient is freed)
    states_8bit            3/4 of fp32 optimizer states (torchao AdamW8bit, blocks of 256)
    states_cpu             the optimizer states and gradients leave the device (torchao
                           CPUOffloadOptimizer; the update runs on the host)
    bf16_weights           half of the fp32 weights, gradients and states; the update rounds
                           stochastically so that small steps are not lost
    fsdp                   weights, gradients and states split across the devices

What each costs is a prior share of a step's time, by the type of device (`slowdowns`: CPU
figures measured, CUDA ones priors until measured on a GPU; other accelerators are priced as
CUDA): recomputing a block's forward costs about a third of its share
of the step on either; torchao's 8-bit states and a step per parameter cost far more on a CPU,
whose update is already most of a small model's step (benchmarks/RESULTS.md, "the measures'
step-time cost"). bf16 weights are priced above their speed cost (`precision_price`): they
change the numbers the model holds, so they come last.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

from gpunb.runtime.memory.optimizers import Recipe, why_not_replaced, why_not_torchao

LOSS_CHUNKS = 8  # chunks of the sequence the chunked loss computes one at a time
AUTO_SHARDS = "strategy='auto' shards only when DDP does not fit"  # FSDP out of the DDP plan (strategy.py)


class Parts(NamedTuple):
    """The bytes the measures of the estimate's fixed part shrink, one after another."""

    weights: int
    gradients: int
    optimizer: int


class Measure:
    """One way to need less memory. Subclasses say what it saves (`shrink`, `activations`), what it
    costs (`slowdowns`, `precision_price`), when it is allowed (`idle`, `why_not`, `excludes`),
    whether the user set it (`kept`), and how it is applied (`apply`)."""

    name = ""  # how plans, the settings and the reasons name it
    slowdowns = {"cuda": 0.0, "cpu": 0.0}  # expected share of a step's time, by device type
    precision_price = 0.0  # what taking it costs beyond speed
    excludes: tuple = ()  # the names of measures it cannot be taken with
    # When the estimate applies it: 0 the weights' dtype, 1 where gradients live, 2 the optimizer
    # states, 3 sharding (each shrinks what the earlier ones left)
    stage = 0
    option = ""  # the setting that asks for it by hand, where it is refused with a message of its own
    micro_batches = True  # whether it allows a batch cut into micro-batches (split_micro_batch)

    def slowdown(self, device: str) -> float:
        return self.slowdowns.get(device, self.slowdowns["cuda"])

    def price(self, device: str) -> float:
        """What the planner minimises: the expected slowdown and the precision's price."""
        return self.slowdown(device) + self.precision_price

    def text(self, footprint, blocks: int) -> str:
        raise NotImplementedError

    def idle(self, footprint) -> str | None:
        """Why this estimate leaves it nothing to save, or None."""
        return None

    def shrink(self, parts: Parts, footprint) -> Parts:
        return parts

    def activations(self, total: int, footprint, blocks: int) -> int:
        return total

    def why_not(self, run: "RunFacts") -> str | None:
        """Why this run's model, optimizer or settings rule it out, or None."""
        return None

    def kept(self, config, world_size: int) -> bool:
        """Whether the user set it by hand (then it is in every plan)."""
        return False

    def apply(self, target: "Target") -> None:
        """Puts it in place on `target`: undo steps to `target.undo`, the optimizer's recipe changed."""

    def __repr__(self) -> str:
        return f"<measure {self.name}>"


@dataclass
class RunFacts:
    """What the measures ask of a run to say whether it allows them."""

    model: object
    optimizer: object
    objective: object
    precision: object
    config: object
    world_size: int
    device: object
    scheduler: object = None
    continuing: bool = False  # a resumed or continued fit

    @functools.cached_property
    def replaced(self) -> str | None:
        """Why the optimizer cannot be rebuilt with other states or steps, or None. A resumed run
        takes the states it saved: optimizer_states="8bit" / "cpu" set again are kept."""
        return why_not_replaced(self.optimizer, self.scheduler,
                                 self.continuing and self.config.optimizer_states in ("auto", "full"))

    @functools.cached_property
    def lean(self) -> str | None:
        """Why torchao's optimizer cannot stand in for this one, or None."""
        why = self.replaced or why_not_torchao(self.optimizer)
        if self.world_size > 1:  # torchao's states under DDP / FSDP2 shards: not tried yet
            why = why or "torchao's optimizers are used on one device only for now"
        return why


@dataclass
class Target:
    """What the measures are put in place on; `undo`: steps that take them away again."""

    model: object
    objective: object
    plan: object  # the MemoryPlan: the blocks to checkpoint, the measures the user kept
    recipe: Recipe = field(default_factory=Recipe)
    undo: list = field(default_factory=list)


class ChunkedLoss(Measure):
    name = "chunked_loss"
    slowdowns = {"cuda": 0.02, "cpu": 0.20}

    def text(self, footprint, blocks):
        return "chunked cross-entropy"

    def idle(self, footprint):
        return None if footprint.logits else "not a causal language model computing its own loss"

    def activations(self, total, footprint, blocks):
        return total - (footprint.logits - footprint.logits // LOSS_CHUNKS)

    def why_not(self, run):
        from gpunb.runtime.memory import chunked_loss as chunked

        if run.objective.loss_fn is not None or run.objective.step_fn is not None:
            return "the loss is computed by loss_fn or step, not by the model"
        if chunked.unsupported_reason(run.model) is not None:
            return chunked.unsupported_reason(run.model)
        if run.world_size > 1:  # it calls the base model and the head apart: a wrapper's forward would be skipped
            return "several processes train through their wrapper's forward"
        return None

    def apply(self, target):
        target.undo.append(use_chunked_loss(target.objective))


class Checkpointing(Measure):
    """Activation checkpointing of the first k of the model's n repeated blocks (k chosen by the planner)."""

    name = "checkpointing"
    slowdowns = {"cuda": 0.33, "cpu": 0.33}  # of all blocks; k of n cost k/n of it

    def text(self, footprint, blocks):
        which = f"{blocks} of {footprint.blocks}" if blocks < footprint.blocks else f"{blocks}"
        return f"activation checkpointing on {which} {footprint.block_class or 'model'} blocks"

    def idle(self, footprint):
        return None if footprint.blocks else "no repeated blocks found in the model"

    def activations(self, total, footprint, blocks):
        if not blocks or not footprint.blocks:
            return total
        per_block_saved = footprint.block_saved // footprint.blocks
        per_block_input = footprint.block_inputs // footprint.blocks
        # each keeps its input only; one block's activations are back while it is recomputed
        return total - blocks * (per_block_saved - per_block_input) + per_block_saved

    def kept(self, config, world_size):
        return bool(config.activation_checkpointing)

    def apply(self, target):
        if self.name in target.plan.kept:  # the user's: the model's wrapper checkpoints every block (wrap.py)
            return
        from gpunb.runtime.memory.blocks import checkpoint_blocks, repeated_blocks

        _, blocks = repeated_blocks(target.model)
        target.undo.append(checkpoint_blocks(target.model, blocks, target.plan.checkpointed_blocks))


class StepInBackward(Measure):
    name = "optimizer_in_backward"
    slowdowns = {"cuda": 0.02, "cpu": 0.25}
    stage = 1
    micro_batches = False  # a step in backward would step once per piece

    def text(self, footprint, blocks):
        return "optimizer step fused into backward"

    def shrink(self, parts, footprint):
        return parts._replace(gradients=min(parts.gradients, footprint.largest_gradient))

    def why_not(self, run):
        config = run.config
        if run.replaced:
            return run.replaced
        if config.clip_grad_norm:
            return "clip_grad_norm needs every gradient before any step"
        if config.grad_accum > 1:
            return "grad_accum adds micro-batches' gradients before the step"
        if run.precision.scaler is not None:
            return "fp16's loss scaler checks every gradient before the step"
        if run.world_size > 1:
            return "several processes reduce the gradients after backward"
        if config.compile == "step-graph":
            return "the step graph captures the optimizer step"
        return None

    def apply(self, target):
        target.recipe.in_backward = True


class _TorchaoStates(Measure):
    """Optimizer states kept another way by torchao's Adam(W): `optimizer_states=<states>` by hand."""

    states = ""  # the value of `optimizer_states` that asks for it
    stage = 2
    option = "optimizer_states"

    def why_not(self, run):
        return "optimizer_states='full'" if run.config.optimizer_states == "full" else run.lean

    def kept(self, config, world_size):
        return config.optimizer_states == self.states

    def apply(self, target):
        target.recipe.states, target.recipe.torchao = self.states, True


class EightBitStates(_TorchaoStates):
    name, states = "states_8bit", "8bit"
    slowdowns = {"cuda": 0.05, "cpu": 1.0}

    def text(self, footprint, blocks):
        return f"8-bit {footprint.optimizer_name} states"

    def shrink(self, parts, footprint):
        # 1 byte a value + a scale per block of 256; the embeddings' states as they were (full_states)
        lean = footprint.optimizer - footprint.full_states
        kept = footprint.full_states * parts.optimizer // max(1, footprint.optimizer)
        return parts._replace(optimizer=lean // 4 + lean // 256 + kept)


class HostStates(_TorchaoStates):
    name, states = "states_cpu", "cpu"
    slowdowns = {"cuda": 0.5, "cpu": 0.5}
    # one place for the states at a time; the host's update takes the gradients after backward
    excludes = ("states_8bit", "optimizer_in_backward")

    def text(self, footprint, blocks):
        return f"{footprint.optimizer_name} states on the host"

    def shrink(self, parts, footprint):
        return Parts(parts.weights, min(parts.gradients, footprint.largest_gradient), 0)

    def why_not(self, run):
        why = super().why_not(run)
        if why:
            return why
        return None if run.device.type == "cuda" else "the states are in host memory already"


class Bf16Weights(Measure):
    name = "bf16_weights"
    slowdowns = {"cuda": 0.0, "cpu": 0.0}
    precision_price = 1.0  # bf16 weights hold fewer digits
    stage = 0

    def text(self, footprint, blocks):
        return "bf16 weights (stochastic rounding)"

    def shrink(self, parts, footprint):
        return Parts(parts.weights - footprint.float_weights // 2, parts.gradients - footprint.float_gradients // 2,
                     parts.optimizer // 2)  # the states follow the weights' dtype

    def why_not(self, run):
        if run.lean:
            return run.lean
        return None if run.precision.name == "bf16-mixed" else \
            "bf16 weights need bf16 autocast (`precision='bf16-mixed'`)"

    def apply(self, target):
        import torch

        # the same Parameter objects, now bf16: the optimizer still holds them. They stay bf16: they
        # are the trained weights (a copy back to fp32 would need the memory they saved)
        target.model.to(torch.bfloat16)
        target.recipe.rounding, target.recipe.torchao = True, True


class Sharding(Measure):
    """Sharding is never one measure among others: "ddp" is the user's (the message names the
    switch); "auto" shards only when DDP does not fit (strategy.py). The strategy applies it."""

    name = "fsdp"
    slowdowns = {"cuda": 0.10, "cpu": 0.10}
    stage = 3

    def text(self, footprint, blocks):
        return f"FSDP sharding over {footprint.world_size} devices"

    def idle(self, footprint):
        return None if footprint.world_size > 1 else "one device"

    def shrink(self, parts, footprint):
        n = footprint.world_size
        return Parts(parts.weights // n, parts.gradients // n, parts.optimizer // n)

    def why_not(self, run):
        config = run.config
        if run.world_size < 2:
            return "one device"
        if config.strategy == "ddp":
            return "pass `strategy='fsdp'` to shard"
        if config.strategy == "auto":
            return why_not_sharded(config) or AUTO_SHARDS
        return None

    def kept(self, config, world_size):
        return world_size > 1 and config.strategy == "fsdp"


def why_not_sharded(config) -> str | None:
    """What rules FSDP out under strategy="auto" (distributed/context.py refuses it when asked for)."""
    if config.batch_size == "auto":
        return "batch_size='auto' probes the whole model on one device"
    if config.ema is not None:
        return "ema keeps whole parameters beside the shards"
    return None


CHUNKED_LOSS, CHECKPOINTING, STEP_IN_BACKWARD = ChunkedLoss(), Checkpointing(), StepInBackward()
EIGHT_BIT_STATES, BF16_WEIGHTS, FSDP = EightBitStates(), Bf16Weights(), Sharding()
# The one table: the planner's order for measures of one price
MEASURES = (CHUNKED_LOSS, CHECKPOINTING, STEP_IN_BACKWARD, EIGHT_BIT_STATES, HostStates(), BF16_WEIGHTS, FSDP)
_BY_NAME = {m.name: m for m in MEASURES}


def measures_of(items) -> list:
    """Measures, from measures or their names."""
    return [_BY_NAME[m] if isinstance(m, str) else m for m in items]


def use_chunked_loss(objective):
    """The objective computes the model's own loss a chunk at a time; returns the undo."""
    from gpunb.runtime.memory import chunked_loss as chunked

    objective.model_loss = functools.partial(chunked.chunked_loss, chunks=LOSS_CHUNKS)

    def restore():
        objective.model_loss = None

    return restore
