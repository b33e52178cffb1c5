"""The memory plan put to work on a run: its footprint, what it allows, the measures, the fallback.

`plan_run` reads the footprint from the summary measured before the first step, asks each
measure (measures.py) whether this model, optimizer and settings allow it (and why not), and
plans against the budget (`memory_budget`, else the free device memory plus what the run
already holds there); under strategy="auto" with several processes, strategy.py decides
whether to shard. When even every measure leaves the weights, gradients and optimizer state
over the budget, it stops the run there, with the numbers and what to do. `apply_plan` puts
the measures in place and returns what undoes them. `MemoryFallback` is the step's answer to
a real OOM that smaller micro-batches cannot fix: the next measure that can still be taken mid-run.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from gpunb.errors import GpunbError
from gpunb.runtime.memory import chunked_loss as chunked
from gpunb.runtime.memory import strategy
from gpunb.runtime.memory.blocks import checkpoint_blocks, repeated_blocks
from gpunb.runtime.memory.measures import (CHECKPOINTING, CHUNKED_LOSS, EIGHT_BIT_STATES, MEASURES, STEP_IN_BACKWARD,
                                           RunFacts, Target, use_chunked_loss)
from gpunb.runtime.memory.optimizers import rebuilt_optimizer
from gpunb.runtime.memory.plan import SAFETY, Footprint, MemoryPlan, plan_memory, split_micro_batch


def plan_run(summary, model, optimizer, objective, precision, config, dist, device, *,
             scheduler=None, continuing=False) -> MemoryPlan | None:
    """The run's plan, or None when there is nothing to plan (no budget known, plan off and
    nothing set by hand). Raises GpunbError before the first step when nothing can fit."""
    kept = kept_measures(config, dist.world_size)
    budget = budget_of(config, summary, device)
    if budget is None or (not config.memory_plan and not kept):
        return None
    budget = dist.smallest(budget)  # ranks plan alike: the tightest one decides
    footprint = footprint_of(summary, model, objective, dist.world_size, optimizer)
    unavailable = unavailable_measures(RunFacts(model, optimizer, objective, precision, config, dist.world_size,
                                                device, scheduler, continuing))
    _refuse_kept(kept, unavailable, config)
    if not config.memory_plan:  # only what the user set
        unavailable = {m.name: "memory_plan=False" for m in MEASURES if m not in kept}
    plan = plan_memory(footprint, budget, unavailable, kept)
    if not plan.fits and not plan.micro_batches_allowed:
        # the activations are left for smaller micro-batches, which a step in backward cannot take
        unavailable = {**unavailable, STEP_IN_BACKWARD.name: "smaller micro-batches are needed"}
        split = plan_memory(footprint, budget, unavailable, kept)
        if split.fits or split.fixed_after <= SAFETY * budget:
            plan = split
    sharded, over = strategy.auto_sharded(plan, footprint, budget, unavailable, kept, config, dist)
    if sharded is not None:
        return split_micro_batch(sharded, summary.batch_size)
    if over:
        # the switch is the user's: the message names it
        offered = strategy.sharded_plan(footprint, budget, unavailable, kept) \
            if strategy.offers_sharding(config, dist.world_size) else None
        raise does_not_fit(plan, footprint, offered)
    # over by the activations alone: smaller micro-batches
    return said_full_states(split_micro_batch(plan, summary.batch_size), model)


def _refuse_kept(kept: tuple, unavailable: dict, config) -> None:
    """A measure set by hand that this run rules out: one message, before any work."""
    for measure in kept:
        why = unavailable.get(measure.name)
        if why and measure.option:
            raise GpunbError(f"{measure.option}={getattr(config, measure.option)!r} cannot be used here: {why}.",
                             f"drop `{measure.option}`, or change what the reason names.")


def full_state_params(model) -> list:
    """The trainable parameters whose states stay 32-bit under 8-bit states: embeddings (a tied LM
    head is the same tensor), whose rare rows' 8-bit states blur the few updates they get, as
    bitsandbytes and torchao advise. Tensors too small for torchao's blocks stay 32-bit by its own rule."""
    kept = {}
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.weight.requires_grad:
            kept.setdefault(id(module.weight), module.weight)
    return list(kept.values())


def said_full_states(plan: MemoryPlan, model) -> MemoryPlan:
    """The plan's 8-bit states say which parameters keep 32-bit ones."""
    kept = sum(p.numel() for p in full_state_params(model))
    if not plan.has(EIGHT_BIT_STATES) or not kept:
        return plan
    measures = tuple(dataclasses.replace(m, text=f"{m.text} except embeddings ({kept:,} params, 32-bit)")
                     if m.measure is EIGHT_BIT_STATES else m for m in plan.measures)
    return dataclasses.replace(plan, measures=measures)


def kept_measures(config, world_size: int) -> tuple:
    """The measures the user set by hand."""
    return tuple(m for m in MEASURES if m.kept(config, world_size))


def budget_of(config, summary, device) -> int | None:
    """`memory_budget`, else the room on the device (`device_room`)."""
    if config.memory_budget is not None:
        return config.memory_budget
    return device_room(summary, device)


def device_room(summary, device) -> int | None:
    """The device's free memory plus what this process holds there now (the weights it already
    moved count against the estimate, not twice); None when unknown."""
    if summary.free_bytes is None:
        return None
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else summary.weights_bytes
    return summary.free_bytes + held


def footprint_of(summary, model, objective, world_size: int, optimizer) -> Footprint:
    trainable = [p for p in model.parameters() if p.requires_grad]
    floats = [t for t in (*model.parameters(), *model.buffers()) if t.dtype == torch.float32]
    logits = 0
    if (objective.loss_fn is None and objective.step_fn is None and summary.tokens_per_sample
            and chunked.unsupported_reason(model) is None):
        # the fp32 log-probabilities the loss keeps for backward: 4 bytes a token and class
        logits = 4 * summary.batch_size * summary.tokens_per_sample * chunked.vocabulary(model)
        logits = min(logits, max(0, (summary.activations_bytes or 0) - summary.block_saved_bytes))
    name = getattr(optimizer, "inner_type", type(optimizer).__name__)
    states = summary.optimizer_bytes or 0
    # the embeddings' share of the states stays 32-bit under 8-bit states (full_state_params)
    kept = sum(p.numel() for p in full_state_params(model))
    full_states = states * kept // max(1, sum(p.numel() for p in trainable))
    return Footprint(
        weights=summary.weights_bytes, gradients=summary.gradients_bytes, optimizer=states, full_states=full_states,
        activations=summary.activations_bytes or 0, ema=summary.ema_bytes, blocks=summary.blocks,
        block_class=summary.block_class, block_saved=summary.block_saved_bytes,
        block_inputs=summary.block_input_bytes, logits=logits,
        largest_gradient=max((_nbytes(p) for p in trainable), default=0),
        float_weights=sum(_nbytes(t) for t in floats),
        float_gradients=sum(_nbytes(p) for p in trainable if p.dtype == torch.float32),
        world_size=world_size, optimizer_name=name, device=summary.device)


def unavailable_measures(run: RunFacts) -> dict:
    """measure name -> why this run cannot take it."""
    return {m.name: why for m in MEASURES if (why := m.why_not(run))}


class DoesNotFit(GpunbError):
    """Even every measure leaves the run over its budget (a sweep says which trial, and where)."""


def does_not_fit(plan: MemoryPlan, footprint: Footprint, sharded: MemoryPlan | None = None) -> GpunbError:
    from gpunb.render import format_bytes  # only when it is said: render is not on a run's path otherwise

    used = " + ".join(m.text for m in plan.measures) or "no measure available"
    if sharded is not None and sharded.fits:
        return DoesNotFit(
            f"This run does not fit in memory under DDP, which keeps the whole model on each of the "
            f"{footprint.world_size} devices: the weights, gradients and optimizer state alone need "
            f"{format_bytes(plan.fixed_after)} ({used}), over {format_bytes(int(SAFETY * plan.budget))} usable "
            f"of a {format_bytes(plan.budget)} budget. Sharded with FSDP the estimate is "
            f"{format_bytes(sharded.after)} ({sharded.text()}).",
            "pass `strategy='fsdp'` (`--strategy fsdp`): each device then holds its share of the weights, "
            "gradients and optimizer state.")
    return DoesNotFit(
        f"This run does not fit in memory, even with every measure gpunb can take: the weights, "
        f"gradients and optimizer state alone need {format_bytes(plan.fixed_after)} "
        f"({used}), over {format_bytes(int(SAFETY * plan.budget))} usable of a {format_bytes(plan.budget)} "
        f"budget. Without measures the estimate is {format_bytes(plan.before)} "
        f"(weights {format_bytes(footprint.weights)}, gradients {format_bytes(footprint.gradients)}, "
        f"optimizer {format_bytes(footprint.optimizer)}, activations {format_bytes(footprint.activations)}).",
        "train fewer parameters: LoRA adapters (`peft.get_peft_model(model, LoraConfig(...))`) need "
        "gradients and optimizer state for the adapters only; or shard over more GPUs "
        "(`devices=N, strategy='fsdp'`); or a larger `memory_budget` if it was set too low.")


def apply_plan(plan: MemoryPlan, model, optimizer, objective):
    """Puts the plan's measures in place; returns (the optimizer to train with, undo)."""
    target = Target(model, objective, plan)
    for taken in plan.measures:
        taken.measure.apply(target)
    optimizer = rebuilt_optimizer(optimizer, target.recipe, full_state_params(model))
    undo = target.undo
    if target.recipe.in_backward:
        undo.append(optimizer.close)

    def restore():
        for step in reversed(undo):
            step()

    return optimizer, restore


class MemoryFallback:
    """After a real OOM that smaller micro-batches cannot fix: the next measure the run can still
    take (the chunked loss, then checkpointing of every block), said in a warning and the plan."""

    def __init__(self, plan: MemoryPlan, model, objective):
        self.plan, self.model, self.objective = plan, model, objective
        self.chunked_available = CHUNKED_LOSS.name not in plan.unavailable and not plan.has(CHUNKED_LOSS)
        _, blocks = repeated_blocks(model)
        # the user's activation_checkpointing covers every block already (wrap.py)
        self.checkpointed = len(blocks) if CHECKPOINTING.name in plan.kept else plan.checkpointed_blocks
        self.undo = []
        self.notes = []
        # with the optimizer in backward a smaller micro-batch would step once per piece
        self.splittable = plan.micro_batches_allowed

    def next_measure(self, step: int) -> bool:
        """Takes the next measure; False when none is left."""
        if self.chunked_available:
            self.chunked_available = False
            self.undo.append(use_chunked_loss(self.objective))
            return self._said("chunked cross-entropy", step)
        _, blocks = repeated_blocks(self.model)
        if blocks and self.checkpointed < len(blocks):
            self.undo.append(checkpoint_blocks(self.model, blocks[self.checkpointed:], len(blocks) - self.checkpointed))
            self.checkpointed = len(blocks)
            return self._said(f"activation checkpointing on all {len(blocks)} {type(blocks[0]).__name__} blocks",
                              step)
        return False

    def _said(self, measure: str, step: int) -> bool:
        note = f"out of memory at step {step} though the estimate fit: added {measure}"
        self.notes.append(note)
        warnings.warn(f"{note[0].upper()}{note[1:]} (the memory plan's next measure); the step is replayed.",
                      UserWarning, stacklevel=4)
        return True

    def restore(self) -> None:
        for step in reversed(self.undo):
            step()


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()
