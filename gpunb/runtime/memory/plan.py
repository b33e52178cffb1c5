"""The memory plan: the cheapest set of measures under which a run's estimate fits its budget.

Pure arithmetic: the inputs are the estimate's parts (a `Footprint`, from the summary measured
before the first step), the budget in bytes, the measures the model, optimizer and settings
allow, and those the user set by hand. Every set of allowed measures (measures.py: each says
what it saves and what it costs) is priced, the cheapest that fits wins (a model that fits gets
none), and the `MemoryPlan` says each measure with the bytes after it and the step time it is
expected to cost. A run measures what its plan costs before its first step where it can
(probes/plan_cost.py), and the plan says that beside the prior.

A plan over the budget by its activations alone cuts each batch into micro-batches
(`split_micro_batch`): activations scale with the micro-batch, and the gradients are
accumulated, so the optimizer step is the same.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from gpunb.runtime.memory.measures import CHECKPOINTING, MEASURES, Measure, Parts, measures_of

SAFETY = 0.9  # the share of the budget an estimate may use: allocator slack, kernels' workspaces


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
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.ema + self.activations


@dataclass(frozen=True)
class Taken:
    """A measure as a plan takes it."""

    measure: Measure
    text: str  # as the plan says it: "8-bit AdamW states"
    bytes_after: int  # the estimate with this measure and the ones before it
    slowdown: float  # its expected share of step time

    @property
    def name(self) -> str:
        return self.measure.name


@dataclass
class MemoryPlan:
    budget: int
    before: int  # the estimate without measures
    after: int  # with the plan's measures
    fits: bool
    measures: tuple = ()  # Taken, in the order they are listed (cheapest first)
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

    @property
    def micro_batches_allowed(self) -> bool:
        """Whether its measures allow a batch cut into micro-batches."""
        return all(m.measure.micro_batches for m in self.measures)

    def has(self, measure) -> bool:
        """Whether the plan takes `measure` (a Measure, or its name)."""
        return getattr(measure, "name", measure) in self.names

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

    `unavailable`: measure name -> why it cannot be used here (the model, optimizer or settings);
    `kept`: measures (or their names) the user set by hand, always in the plan (checkpointing then
    covers every block). When no set fits, the plan holds every available measure and `fits` is False.
    """
    unavailable = dict(unavailable or {})
    for measure in MEASURES:  # what this estimate leaves a measure nothing to save on
        idle = measure.idle(footprint)
        if idle:
            unavailable.setdefault(measure.name, idle)
    kept = tuple(m for m in MEASURES if m in measures_of(kept))
    free = [m for m in MEASURES if m.name not in unavailable and m not in kept and m is not CHECKPOINTING]
    limit = int(SAFETY * budget)
    sets = [set(kept) | set(extra) for count in range(len(free) + 1)
            for extra in itertools.combinations(free, count)]
    sets = [chosen for chosen in sets if not any(other in {m.name for m in chosen}
                                                 for measure in chosen for other in measure.excludes)]
    priced = [c for c in (_cheapest_checkpointing(footprint, chosen, limit, unavailable) for chosen in sets)
              if c is not None]
    if priced:
        best = min(priced, key=lambda c: c[0])
    else:  # nothing fits: the set that saves the most, for the message that says so
        blocks = footprint.blocks if CHECKPOINTING.name not in unavailable or CHECKPOINTING in kept else 0
        smallest = min(sets, key=lambda chosen: (estimate(footprint, chosen, blocks), len(chosen)))
        best = (None, smallest, blocks)
    _, chosen, blocks = best
    return _plan(footprint, budget, chosen, blocks, kept, unavailable)


def _cheapest_checkpointing(footprint, chosen, limit, unavailable):
    """(price, measures, blocks) with the fewest checkpointed blocks that fit, or None."""
    if CHECKPOINTING in chosen:  # the user's: every block
        counts = [footprint.blocks]
    elif CHECKPOINTING.name in unavailable:
        counts = [0]
    else:
        counts = range(footprint.blocks + 1)
    device = footprint.device
    for blocks in counts:
        if estimate(footprint, chosen, blocks) <= limit:
            measures = chosen | ({CHECKPOINTING} if blocks else set())
            price = sum(m.price(device) for m in chosen)
            price += CHECKPOINTING.price(device) * blocks / max(1, footprint.blocks)
            return (price, len(measures), sorted(MEASURES.index(m) for m in measures)), measures, blocks
    return None


def estimate(footprint: Footprint, measures, blocks: int = 0) -> int:
    """The bytes a step needs under `measures` (or their names), with `blocks` of the repeated
    blocks checkpointed."""
    f = footprint
    parts = Parts(f.weights, f.gradients, f.optimizer)
    for measure in sorted(measures_of(measures), key=lambda m: (m.stage, m.name)):
        parts = measure.shrink(parts, f)
    return sum(parts) + f.ema + activations(footprint, measures, blocks)


def activations(footprint: Footprint, measures, blocks: int = 0) -> int:
    """The activations' bytes under `measures` with `blocks` blocks checkpointed."""
    total = footprint.activations
    for measure in measures_of(measures):
        if measure is not CHECKPOINTING:
            total = measure.activations(total, footprint, blocks)
    return max(0, CHECKPOINTING.activations(total, footprint, blocks))


def _plan(footprint, budget, chosen, blocks, kept, unavailable) -> MemoryPlan:
    taken, applied, device = [], set(), footprint.device
    ordered = sorted(chosen | ({CHECKPOINTING} if blocks else set()),
                     key=lambda m: (m.price(device), MEASURES.index(m)))
    if CHECKPOINTING in ordered and not blocks:
        ordered.remove(CHECKPOINTING)
    for measure in ordered:
        applied.add(measure)
        after = estimate(footprint, applied, blocks if CHECKPOINTING in applied else 0)
        share = blocks / max(1, footprint.blocks) if measure is CHECKPOINTING else 1
        taken.append(Taken(measure, measure.text(footprint, blocks), after, measure.slowdown(device) * share))
    checkpointed = blocks if CHECKPOINTING in applied else 0
    after = estimate(footprint, applied, checkpointed)
    fixed = after - activations(footprint, applied, checkpointed)
    return MemoryPlan(budget=budget, before=footprint.total, after=after, fits=after <= int(SAFETY * budget),
                      measures=tuple(taken), checkpointed_blocks=checkpointed, kept=tuple(m.name for m in kept),
                      unavailable=unavailable, fixed_after=fixed)


def split_micro_batch(plan: MemoryPlan, batch_size: int) -> MemoryPlan:
    """`plan`, over the budget by its activations alone, with each batch of `batch_size` cut into
    the fewest micro-batches under which it fits (the activations scale with the micro-batch;
    the rest does not). When even a micro-batch of 1 is over, the plan says so and splits nothing."""
    limit, activations_after = int(SAFETY * plan.budget), plan.after - plan.fixed_after
    if plan.fits or batch_size <= 1 or plan.fixed_after > limit or not plan.micro_batches_allowed:
        return plan
    for pieces in range(2, batch_size + 1):
        micro = -(-batch_size // pieces)
        if pieces > 2 and micro == -(-batch_size // (pieces - 1)):
            continue  # the same micro-batch as one piece fewer
        after = plan.fixed_after + -(-activations_after * micro // batch_size)
        if after <= limit:
            return replace(plan, after=after, fits=True, batch_size=batch_size, micro_batches=pieces)
    return replace(plan, batch_size=batch_size)
