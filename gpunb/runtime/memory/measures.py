"""The memory plan put to work on a run: its footprint, what it allows, the measures, the fallback.

`plan_run` reads the footprint from the summary measured before the first step, lists the
measures this model, optimizer and settings rule out (and why), and plans against the budget
(`memory_budget`, else the free device memory plus what the run already holds there). When
even every measure leaves the weights, gradients and optimizer state over the budget, it
stops the run there, with the numbers and what to do. `apply_plan` puts the measures in
place and returns what undoes them. `MemoryFallback` is the step's answer to a real OOM
that smaller micro-batches cannot fix: the next measure that can still be taken mid-run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings

import torch

from gpunb.errors import GpunbError
from gpunb.runtime.memory import chunked_loss as chunked
from gpunb.runtime.memory.blocks import checkpoint_blocks, repeated_blocks
from gpunb.runtime.memory.in_backward import OptimizerInBackward
from gpunb.runtime.memory.plan import LOSS_CHUNKS, MEASURES, SAFETY, Footprint, MemoryPlan, plan_memory, split_micro_batch

_ADAMS = ("Adam", "AdamW")
_HYPER = ("lr", "betas", "eps", "weight_decay")
_AUTO = "strategy='auto' shards only when DDP does not fit"  # FSDP left out of the DDP plan, for the second one


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
    unavailable = unavailable_measures(model, optimizer, objective, precision, config, dist.world_size, device,
                                       scheduler=scheduler, continuing=continuing)
    for name in kept:
        if name in unavailable and name not in ("checkpointing", "fsdp"):
            raise GpunbError(f"optimizer_states={config.optimizer_states!r} cannot be used here: {unavailable[name]}.",
                             "drop `optimizer_states`, or change what the reason names.")
    if not config.memory_plan:  # only what the user set
        unavailable = {m: "memory_plan=False" for m in MEASURES if m not in kept}
    plan = plan_memory(footprint, budget, unavailable, kept)
    if not plan.fits and plan.has("optimizer_in_backward"):
        # the activations are left for smaller micro-batches, which a step in backward cannot take
        unavailable = {**unavailable, "optimizer_in_backward": "smaller micro-batches are needed"}
        split = plan_memory(footprint, budget, unavailable, kept)
        if split.fits or split.fixed_after <= SAFETY * budget:
            plan = split
    over = not plan.fits and plan.fixed_after > SAFETY * budget
    if may_shard(config, dist.world_size, unavailable):
        # strategy="auto": every rank shards when any rank's DDP estimate is over (0 is the vote to shard)
        if dist.smallest(0 if over else 1) == 0:
            sharded = _sharded(footprint, budget, unavailable, kept)
            if sharded.fits or sharded.fixed_after <= SAFETY * budget:
                from gpunb.render import format_bytes  # only when it is said

                sharded.strategy_reason = (f"DDP needs {format_bytes(plan.after)} per device of "
                                           f"{format_bytes(budget)}; sharded: {format_bytes(sharded.after)}")
                return split_micro_batch(sharded, summary.batch_size)
            over = True  # sharded too, the weights, gradients and states are over: said below
    if over:
        sharded = None
        if dist.world_size > 1 and (config.strategy == "ddp" or
                                    (config.strategy == "auto" and _why_not_sharded(config) is None)):
            sharded = _sharded(footprint, budget, unavailable, kept)  # the switch is the user's: the message names it
        raise does_not_fit(plan, footprint, sharded)
    # over by the activations alone: smaller micro-batches
    return said_full_states(split_micro_batch(plan, summary.batch_size), model)


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
    if not plan.has("states_8bit") or not kept:
        return plan
    measures = tuple(dataclasses.replace(m, text=f"{m.text} except embeddings ({kept:,} params, 32-bit)")
                     if m.name == "states_8bit" else m for m in plan.measures)
    return dataclasses.replace(plan, measures=measures)


def may_shard(config, world_size: int, unavailable: dict) -> bool:
    """Whether this run decides DDP or FSDP itself (strategy="auto"), from the estimate."""
    return world_size > 1 and config.strategy == "auto" and config.memory_plan and unavailable.get("fsdp") == _AUTO


def _sharded(footprint, budget, unavailable, kept) -> MemoryPlan:
    """The plan with FSDP sharding, and what else it needs."""
    allowed = {m: why for m, why in unavailable.items() if m != "fsdp"}
    return plan_memory(footprint, budget, allowed, (*kept, "fsdp"))


def run_strategy(config, world_size: int, memory: MemoryPlan | None) -> tuple[str | None, str]:
    """The strategy the run trains under (None: one process) and why: the one asked for, or under
    "auto" DDP unless the memory plan shards (then the plan says the numbers)."""
    if world_size < 2:
        return None, ""
    if config.strategy != "auto":
        return config.strategy, "asked for"
    if memory is not None and memory.has("fsdp"):
        return "fsdp", memory.strategy_reason
    if not config.memory_plan:
        return "ddp", "auto: memory_plan=False keeps DDP"
    if memory is None:
        return "ddp", "auto: no memory budget known"
    return "ddp", "auto: the whole model fits on each device"


def kept_measures(config, world_size: int) -> tuple:
    """The measures the user set by hand."""
    kept = []
    if config.activation_checkpointing:
        kept.append("checkpointing")
    if config.optimizer_states in ("8bit", "cpu"):
        kept.append(f"states_{config.optimizer_states}")
    if world_size > 1 and config.strategy == "fsdp":
        kept.append("fsdp")
    return tuple(kept)


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


def unavailable_measures(model, optimizer, objective, precision, config, world_size, device, *,
                         scheduler=None, continuing=False) -> dict:
    """measure -> why this run cannot take it."""
    out = {}
    if objective.loss_fn is not None or objective.step_fn is not None:
        out["chunked_loss"] = "the loss is computed by loss_fn or step, not by the model"
    elif chunked.unsupported_reason(model) is not None:
        out["chunked_loss"] = chunked.unsupported_reason(model)
    elif world_size > 1:  # it calls the base model and the head apart: a DDP / FSDP wrapper's forward would be skipped
        out["chunked_loss"] = "several processes train through their wrapper's forward"
    # a resumed run takes the states it saved: optimizer_states="8bit" / "cpu" set again are kept
    replaced = _why_not_replaced(optimizer, scheduler, continuing and config.optimizer_states in ("auto", "full"))
    in_backward = replaced or _why_not_in_backward(precision, config, world_size)
    if in_backward:
        out["optimizer_in_backward"] = in_backward
    lean = replaced or _why_not_torchao(optimizer)
    if world_size > 1:  # torchao's states under DDP / FSDP2 shards: not tried yet
        lean = lean or "torchao's optimizers are used on one device only for now"
    if config.optimizer_states == "full":
        out["states_8bit"] = out["states_cpu"] = "optimizer_states='full'"
    for name in ("states_8bit", "states_cpu", "bf16_weights"):
        if lean:
            out.setdefault(name, lean)
    if "states_cpu" not in out and device.type != "cuda":
        out["states_cpu"] = "the states are in host memory already"
    if "bf16_weights" not in out and precision.name != "bf16-mixed":
        out["bf16_weights"] = "bf16 weights need bf16 autocast (`precision='bf16-mixed'`)"
    # FSDP is never one measure among others: "ddp" is the user's (the message names the switch);
    # "auto" shards only when DDP does not fit (plan_run)
    if world_size < 2:
        out["fsdp"] = "one device"
    elif config.strategy == "ddp":
        out["fsdp"] = "pass `strategy='fsdp'` to shard"
    elif config.strategy == "auto":
        out["fsdp"] = _why_not_sharded(config) or _AUTO
    return out


def _why_not_sharded(config) -> str | None:
    """What rules FSDP out under strategy="auto" (distributed/context.py refuses it when asked for)."""
    if config.batch_size == "auto":
        return "batch_size='auto' probes the whole model on one device"
    if config.ema is not None:
        return "ema keeps whole parameters beside the shards"
    return None


def _why_not_replaced(optimizer, scheduler, continuing) -> str | None:
    """Why the optimizer cannot be rebuilt with other states or steps, or None."""
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


def _why_not_in_backward(precision, config, world_size) -> str | None:
    if config.clip_grad_norm:
        return "clip_grad_norm needs every gradient before any step"
    if config.grad_accum > 1:
        return "grad_accum adds micro-batches' gradients before the step"
    if precision.scaler is not None:
        return "fp16's loss scaler checks every gradient before the step"
    if world_size > 1:
        return "several processes reduce the gradients after backward"
    if config.compile == "step-graph":
        return "the step graph captures the optimizer step"
    return None


def _why_not_torchao(optimizer) -> str | None:
    if type(optimizer).__name__ not in _ADAMS or type(optimizer).__module__.split(".")[0] != "torch":
        return f"torchao's states replace Adam or AdamW, and the optimizer is {type(optimizer).__name__}"
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        return "amsgrad is not in torchao's 8-bit AdamW"
    if importlib.util.find_spec("torchao") is None:  # not imported here: a plan that needs none stays light
        return "torchao is not installed (`pip install gpunb[llm]`)"
    return None


def does_not_fit(plan: MemoryPlan, footprint: Footprint, sharded: MemoryPlan | None = None) -> GpunbError:
    from gpunb.render import format_bytes  # only when it is said: render is not on a run's path otherwise

    used = " + ".join(m.text for m in plan.measures) or "no measure available"
    if sharded is not None and sharded.fits:
        return GpunbError(
            f"This run does not fit in memory under DDP, which keeps the whole model on each of the "
            f"{footprint.world_size} devices: the weights, gradients and optimizer state alone need "
            f"{format_bytes(plan.fixed_after)} ({used}), over {format_bytes(int(SAFETY * plan.budget))} usable "
            f"of a {format_bytes(plan.budget)} budget. Sharded with FSDP the estimate is "
            f"{format_bytes(sharded.after)} ({sharded.text()}).",
            "pass `strategy='fsdp'` (`--strategy fsdp`): each device then holds its share of the weights, "
            "gradients and optimizer state.")
    return GpunbError(
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
    """Puts the plan's measures in place; returns (the optimizer to train with, undo). bf16 weights
    stay bf16: they are the trained weights (a copy back to fp32 would need the memory they saved)."""
    undo = []
    names = set(plan.names)
    if "bf16_weights" in names:
        model.to(torch.bfloat16)  # the same Parameter objects, now bf16: the optimizer still holds them
    if "checkpointing" in names and "checkpointing" not in plan.kept:
        _, blocks = repeated_blocks(model)
        undo.append(checkpoint_blocks(model, blocks, plan.checkpointed_blocks))
    if "chunked_loss" in names:
        undo.append(use_chunked_loss(objective))
    optimizer = planned_optimizer(optimizer, names, full_state_params(model))
    if isinstance(optimizer, OptimizerInBackward):
        undo.append(optimizer.close)

    def restore():
        for step in reversed(undo):
            step()

    return optimizer, restore


def use_chunked_loss(objective):
    objective.model_loss = functools.partial(chunked.chunked_loss, chunks=LOSS_CHUNKS)

    def restore():
        objective.model_loss = None

    return restore


def planned_optimizer(optimizer, names, full_states=()):
    """`optimizer` rebuilt for the plan's optimizer measures (the same groups and hyperparameters);
    `full_states`: parameters whose states stay 32-bit under 8-bit states."""
    lean = {"states_8bit", "states_cpu", "bf16_weights"} & set(names)
    if not lean and "optimizer_in_backward" not in names:
        return optimizer
    make = functools.partial(_torchao_optimizer, type(optimizer).__name__, lean, full_states) if lean else \
        functools.partial(_same_kind, optimizer)
    if "optimizer_in_backward" in names:
        return OptimizerInBackward(optimizer.param_groups, make)
    return make(optimizer.param_groups)


def _same_kind(optimizer, groups):
    return type(optimizer)([{k: v for k, v in g.items() if k != "initial_lr"} for g in groups])


def _torchao_optimizer(kind: str, lean: set, full_states, groups):
    from gpunb.quiet import import_quietly

    optim = import_quietly("torchao.optim")  # without torchao's notices about its extensions

    groups = [{key: g[key] for key in ("params", *_HYPER) if key in g} for g in groups]
    rounding = {"bf16_stochastic_round": "bf16_weights" in lean}
    if "states_cpu" in lean:
        inner = optim._AdamW if kind == "AdamW" else torch.optim.Adam
        extra = rounding if inner is optim._AdamW else {}
        return optim.CPUOffloadOptimizer(groups, inner, offload_gradients=True, **extra)
    if "states_8bit" in lean:
        eight_bit = _with_full_states(optim.AdamW8bit if kind == "AdamW" else optim.Adam8bit)
        return eight_bit(groups, full_states=full_states, **rounding)
    return optim._AdamW(groups, **rounding) if kind == "AdamW" else optim._Adam(groups, **rounding)


@functools.cache
def _with_full_states(eight_bit: type) -> type:
    """torchao's 8-bit Adam(W) keeping 32-bit states for the parameters given as `full_states`
    (torchao decides per tensor in `_new_buffer`: its own rule keeps small tensors 32-bit)."""

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


class MemoryFallback:
    """After a real OOM that smaller micro-batches cannot fix: the next measure the run can still
    take (the chunked loss, then checkpointing of every block), said in a warning and the plan."""

    def __init__(self, plan: MemoryPlan, model, objective):
        self.plan, self.model, self.objective = plan, model, objective
        self.chunked_available = "chunked_loss" not in plan.unavailable and not plan.has("chunked_loss")
        _, blocks = repeated_blocks(model)
        # the user's activation_checkpointing covers every block already (wrap.py)
        self.checkpointed = len(blocks) if "checkpointing" in plan.kept else plan.checkpointed_blocks
        self.undo = []
        self.notes = []
        # with the optimizer in backward a smaller micro-batch would step once per piece
        self.splittable = not plan.has("optimizer_in_backward")

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
