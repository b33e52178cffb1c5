"""The memory plan: the cheapest set of measures under which a run's estimate fits its budget.

Pure arithmetic, no torch: the inputs are the estimate's parts (a `Footprint`, from the
summary measured before the first step), the budget in bytes, the measures the model,
optimizer and settings allow, and those the user set by hand. Every set of allowed
measures is priced, the cheapest that fits wins (a model that fits gets none), and the
`MemoryPlan` says each measure with the bytes after it and the step time it is expected to cost.

What each measure saves (P: trainable parameters' bytes as they are now):

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

The slowdowns are priors (fractions of a step's time), by the type of device: recomputing a
block's forward costs about a third of its share of the step on either; torchao's 8-bit
states and a step per parameter cost far more on a CPU, whose update is already most of a
small model's step (benchmarks/RESULTS.md, "the measures' step-time cost"). bf16 weights are
priced above their speed cost: they change the numbers the model holds, so they come last.
A run measures what its plan costs before its first step where it can (probes/plan_cost.py),
and the plan says that beside the prior.

A plan over the budget by its activations alone cuts each batch into micro-batches
(`split_micro_batch`): activations scale with the micro-batch, and the gradients are
accumulated, so the optimizer step is the same.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

MEASURES = ("chunked_loss", "checkpointing", "optimizer_in_backward", "states_8bit", "states_cpu",
            "bf16_weights", "fsdp")
# Expected step-time cost of each measure, as a fraction of a step (checkpointing: of all blocks),
# by device type. CPU: measured (benchmarks/RESULTS.md); CUDA: priors until measured on a GPU.
SLOWDOWNS = {
    "cuda": {"chunked_loss": 0.02, "checkpointing": 0.33, "optimizer_in_backward": 0.02,
             "states_8bit": 0.05, "states_cpu": 0.5, "bf16_weights": 0.0, "fsdp": 0.10},
    "cpu": {"chunked_loss": 0.20, "checkpointing": 0.33, "optimizer_in_backward": 0.25,
            "states_8bit": 1.0, "states_cpu": 0.5, "bf16_weights": 0.0, "fsdp": 0.10},
}
SLOWDOWN = SLOWDOWNS["cuda"]  # other accelerators are priced as CUDA
# What choosing a measure costs beyond its speed: bf16 weights hold fewer digits.
PRECISION_PRICE = {"bf16_weights": 1.0}
SAFETY = 0.9  # the share of the budget an estimate may use: allocator slack, kernels' workspaces
LOSS_CHUNKS = 8  # chunks of the sequence the chunked loss computes one at a time
_EXCLUSIVE = ({"states_8bit", "states_cpu"}, {"states_cpu", "optimizer_in_backward"})


@dataclass(frozen=True)
class Footprint:
    """The estimate's parts, in bytes, at the micro-batch training will use."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    full_states: int = 0  # the optimizer states that stay 32-bit under 8-bit states (embeddings')
    ema: int = 0
    blocks: int = 0  # the repeated blocks checkpointing can recompute
    block_class: str = ""  # their class name, for the plan's text
    block_saved: int = 0  # activations saved inside all blocks together
    block_inputs: int = 0  # the blocks' inputs together (what a checkpointed block keeps)
    logits: int = 0  # what the chunked loss avoids (0: not a causal LM's own loss)
    largest_gradient: int = 0  # the one gradient alive at a time with the optimizer in backward
    float_weights: int = 0  # fp32 weights' bytes that bf16 would halve
    float_gradients: int = 0  # the same of the gradients
    world_size: int = 1
    optimizer_name: str = "AdamW"
    device: str = "cuda"  # the device type whose step-time priors price the measures

    @property
    def slowdowns(self) -> dict:
        return SLOWDOWNS.get(self.device, SLOWDOWN)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.ema + self.activations


@dataclass(frozen=True)
class Measure:
    name: str
    text: str  # as the plan says it: "8-bit AdamW states"
    bytes_after: int  # the estimate with this measure and the ones before it
    slowdown: float  # its expected share of step time


@dataclass
class MemoryPlan:
    budget: int
    before: int  # the estimate without measures
    after: int  # with the plan's measures
    fits: bool
    measures: tuple = ()  # Measure, in the order they are listed (cheapest first)
    checkpointed_blocks: int = 0
    kept: tuple = ()  # measures the user set by hand
    unavailable: dict = field(default_factory=dict)  # measure -> why it could not be used
    fixed_after: int = 0  # the part of `after` no smaller micro-batch can shrink
    strategy_reason: str = ""  # strategy="auto" that shards: DDP's estimate per device against the sharded one
    batch_size: int = 0  # the batch each step loads (0: the plan was not asked to split it)
    micro_batches: int = 1  # pieces each batch is cut into, its gradients accumulated (split_micro_batch)
    measured: float | None = None  # the step-time cost measured before the first step (probes/plan_cost.py)
    measured_note: str = ""  # how it was measured, or why it was not

    @property
    def names(self) -> tuple:
        return tuple(m.name for m in self.measures)

    @property
    def slowdown(self) -> float:
        return sum(m.slowdown for m in self.measures)

    def has(self, name: str) -> bool:
        return name in self.names

    @property
    def micro_batch(self) -> int:
        return -(-self.batch_size // self.micro_batches) if self.batch_size else 0

    @property
    def changes(self) -> bool:
        """Whether the plan changes the run: measures, or micro-batches."""
        return bool(self.measures) or self.micro_batches > 1

    @property
    def acts(self) -> bool:
        """Whether the plan has something to do or to say: changes, or a budget it cannot meet."""
        return self.changes or not self.fits

    def text(self) -> str:
        """`plan: chunked loss + activation checkpointing on 32 LlamaDecoderLayer blocks: 61 GiB
        of 79 GiB; expected step time +35%, measured +31% (...)`, or why none was needed."""
        from gpunb.render import format_bytes

        amount = f"{format_bytes(self.after)} of {format_bytes(self.budget)}"
        if self.fits and not self.changes:
            return f"plan: no measure needed ({amount})"
        listed = [m.text for m in self.measures]
        if self.micro_batches > 1:
            listed.append(f"micro-batches of {self.micro_batch} ({self.micro_batches} a step of {self.batch_size}, "
                          "the gradients accumulated)")
        verdict = "" if self.fits else (
            f" (over the budget by the activations even at a micro-batch of 1 sample: it trains at micro-batch "
            f"{self.batch_size} as asked, and may run out of memory)" if self.batch_size else
            " (over the budget by the activations)")
        if not listed:
            return f"plan: no measure available: {amount}{verdict}"
        cost = f"expected step time +{100 * self.slowdown:.0f}%"
        if self.measured is not None:
            cost += f", measured {100 * self.measured:+.0f}% ({self.measured_note})"
        elif self.measured_note:
            cost += f" ({self.measured_note})"
        return f"plan: {' + '.join(listed)}: {amount}{verdict}; {cost}"


def plan_memory(footprint: Footprint, budget: int, unavailable: dict | None = None,
                kept: tuple = ()) -> MemoryPlan:
    """The cheapest set of measures under which `footprint` fits in SAFETY x `budget`.

    `unavailable`: measure -> why it cannot be used here (the model, optimizer or settings);
    `kept`: measures the user set by hand, always in the plan (checkpointing then covers every
    block). When no set fits, the plan holds every available measure and `fits` is False.
    """
    unavailable = dict(unavailable or {})
    if not footprint.blocks:
        unavailable.setdefault("checkpointing", "no repeated blocks found in the model")
    if not footprint.logits:
        unavailable.setdefault("chunked_loss", "not a causal language model computing its own loss")
    if footprint.world_size < 2:
        unavailable.setdefault("fsdp", "one device")
    kept = tuple(m for m in MEASURES if m in kept)
    free = [m for m in MEASURES if m not in unavailable and m not in kept and m != "checkpointing"]
    limit = int(SAFETY * budget)
    sets = [set(kept) | set(extra) for count in range(len(free) + 1)
            for extra in itertools.combinations(free, count)]
    sets = [chosen for chosen in sets if not any(pair <= chosen for pair in _EXCLUSIVE)]
    priced = [c for c in (_cheapest_checkpointing(footprint, chosen, limit, unavailable) for chosen in sets)
              if c is not None]
    if priced:
        best = min(priced, key=lambda c: c[0])
    else:  # nothing fits: the set that saves the most, for the message that says so
        blocks = footprint.blocks if "checkpointing" not in unavailable or "checkpointing" in kept else 0
        smallest = min(sets, key=lambda chosen: (estimate(footprint, chosen, blocks), len(chosen)))
        best = (None, smallest, blocks)
    _, chosen, blocks = best
    return _plan(footprint, budget, chosen, blocks, kept, unavailable)


def _cheapest_checkpointing(footprint, chosen, limit, unavailable):
    """(price, measures, blocks) with the fewest checkpointed blocks that fit, or None."""
    if "checkpointing" in chosen:  # the user's: every block
        counts = [footprint.blocks]
    elif "checkpointing" in unavailable:
        counts = [0]
    else:
        counts = range(footprint.blocks + 1)
    for blocks in counts:
        if estimate(footprint, chosen, blocks) <= limit:
            measures = chosen | ({"checkpointing"} if blocks else set())
            cost = footprint.slowdowns
            price = sum(cost[m] + PRECISION_PRICE.get(m, 0.0) for m in chosen)
            price += cost["checkpointing"] * blocks / max(1, footprint.blocks)
            return (price, len(measures), sorted(MEASURES.index(m) for m in measures)), measures, blocks
    return None


def estimate(footprint: Footprint, measures, blocks: int = 0) -> int:
    """The bytes a step needs under `measures`, with `blocks` of the repeated blocks checkpointed."""
    f = footprint
    weights, gradients, optimizer = f.weights, f.gradients, f.optimizer
    if "bf16_weights" in measures:
        weights -= f.float_weights // 2
        gradients -= f.float_gradients // 2
        optimizer //= 2  # the states follow the weights' dtype
    if "optimizer_in_backward" in measures or "states_cpu" in measures:
        gradients = min(gradients, f.largest_gradient)
    if "states_8bit" in measures:
        # 1 byte a value + a scale per block of 256; the embeddings' states as they were
        lean = f.optimizer - f.full_states
        optimizer = lean // 4 + lean // 256 + f.full_states * optimizer // max(1, f.optimizer)
    elif "states_cpu" in measures:
        optimizer = 0
    if "fsdp" in measures:
        weights, gradients, optimizer = (weights // f.world_size, gradients // f.world_size,
                                         optimizer // f.world_size)
    return weights + gradients + optimizer + f.ema + activations(footprint, measures, blocks)


def activations(footprint: Footprint, measures, blocks: int = 0) -> int:
    """The activations' bytes under `measures` with `blocks` blocks checkpointed."""
    f = footprint
    total = f.activations
    if "chunked_loss" in measures:
        total -= f.logits - f.logits // LOSS_CHUNKS
    if blocks and f.blocks:
        per_block_saved, per_block_input = f.block_saved // f.blocks, f.block_inputs // f.blocks
        total -= blocks * (per_block_saved - per_block_input)
        total += per_block_saved  # one block's activations while it is recomputed
    return max(0, total)


def _plan(footprint, budget, chosen, blocks, kept, unavailable) -> MemoryPlan:
    measures, applied, cost = [], set(), footprint.slowdowns
    ordered = sorted(chosen | ({"checkpointing"} if blocks else set()),
                     key=lambda m: (cost[m] + PRECISION_PRICE.get(m, 0.0), MEASURES.index(m)))
    if "checkpointing" in ordered and not blocks:
        ordered.remove("checkpointing")
    for name in ordered:
        applied.add(name)
        after = estimate(footprint, applied, blocks if "checkpointing" in applied else 0)
        slowdown = cost[name] * (blocks / max(1, footprint.blocks) if name == "checkpointing" else 1)
        measures.append(Measure(name, describe(name, footprint, blocks), after, slowdown))
    after = estimate(footprint, applied, blocks if "checkpointing" in applied else 0)
    fixed = after - activations(footprint, applied, blocks if "checkpointing" in applied else 0)
    return MemoryPlan(budget=budget, before=footprint.total, after=after, fits=after <= int(SAFETY * budget),
                measures=tuple(measures), checkpointed_blocks=blocks if "checkpointing" in applied else 0,
                kept=kept, unavailable=unavailable, fixed_after=fixed)


def split_micro_batch(plan: MemoryPlan, batch_size: int) -> MemoryPlan:
    """`plan`, over the budget by its activations alone, with each batch of `batch_size` cut into
    the fewest micro-batches under which it fits (the activations scale with the micro-batch;
    the rest does not). When even a micro-batch of 1 is over, the plan says so and splits nothing."""
    limit, activations_after = int(SAFETY * plan.budget), plan.after - plan.fixed_after
    if plan.fits or batch_size <= 1 or plan.fixed_after > limit or plan.has("optimizer_in_backward"):
        return plan  # a step in backward steps once per piece: it cannot take micro-batches
    for pieces in range(2, batch_size + 1):
        micro = -(-batch_size // pieces)
        if pieces > 2 and micro == -(-batch_size // (pieces - 1)):
            continue  # the same micro-batch as one piece fewer
        after = plan.fixed_after + -(-activations_after * micro // batch_size)
        if after <= limit:
            return replace(plan, after=after, fits=True, batch_size=batch_size, micro_batches=pieces)
    return replace(plan, batch_size=batch_size)


def describe(name: str, footprint: Footprint, blocks: int = 0) -> str:
    f = footprint
    if name == "checkpointing":
        which = f"{blocks} of {f.blocks}" if blocks < f.blocks else f"{blocks}"
        return f"activation checkpointing on {which} {f.block_class or 'model'} blocks"
    return {"chunked_loss": "chunked cross-entropy",
            "optimizer_in_backward": "optimizer step fused into backward",
            "states_8bit": f"8-bit {f.optimizer_name} states",
            "states_cpu": f"{f.optimizer_name} states on the host",
            "bf16_weights": "bf16 weights (stochastic rounding)",
            "fsdp": f"FSDP sharding over {f.world_size} devices"}[name]
