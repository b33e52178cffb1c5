"""prepare(): everything one fit needs before its first batch, built in the order it is decided.

First what it decides (`decide`, where a dry run stops): the continuation it goes on from, the
device and precision (setup.py), one batch checked (preflight), the batch size, the feeds, the
RunPlan, the summary's forward + backward, the memory plan and the strategy. Then what it puts
in place: the memory plan's measures, the schedule, the wrapped model, the RunState and its
stepper, the checkpointer, the step's engine, and what a continued or resumed fit loads.
loop.py then trains the Run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch.utils.data import DataLoader

from gpunb.config import TrainConfig
from gpunb.runtime.eta import EtaClock
from gpunb.runtime.events import Callbacks
from gpunb.runtime.feed.epoch_start import warn_unresumable
from gpunb.runtime.feed.feeds import build_feed, with_batch_size
from gpunb.runtime.memory.blocks import checkpoint_every_block
from gpunb.runtime.memory.plan import MemoryPlan
from gpunb.runtime.memory.planning import MemoryFallback, apply_plan, plan_run
from gpunb.runtime.memory.strategy import run_strategy
from gpunb.runtime.placement import ALONE
from gpunb.runtime.plan import RunPlan
from gpunb.runtime.plan import length as plan_length
from gpunb.runtime.probes.batch_size import BatchChoice, find_batch_size
from gpunb.runtime.probes.peak_flops import device_peak_tflops
from gpunb.runtime.probes.plan_cost import measure_plan_cost
from gpunb.runtime.probes.preflight import preflight
from gpunb.runtime.probes.summary import RunSummary, summarize
from gpunb.runtime.run_state import RunState
from gpunb.runtime.setup import setup
from gpunb.runtime.state import continuing
from gpunb.runtime.state.best_k import BestCheckpoints
from gpunb.runtime.state.checkpointer import Checkpointer, resume
from gpunb.runtime.state.nan_guard import StepLosses
from gpunb.runtime.step.compiling import Compilation
from gpunb.runtime.step.ema import WeightEma
from gpunb.runtime.step.objective import Objective
from gpunb.runtime.step.precision import Precision
from gpunb.runtime.step.schedule import build_schedule
from gpunb.runtime.step.stepper import Stepper
from gpunb.runtime.step.wrap import wrap_model
from gpunb.runtime.validation import passes as validation
from gpunb.runtime.validation.monitor import monitor_of, validation_names


@dataclass
class Run:
    """Everything one fit needs, built by prepare."""

    config: TrainConfig  # as the user gave it
    plan: RunPlan  # what set-up decided
    dist: object  # the context: alone (runtime/context.py) or one rank of a group (distributed/context.py)
    state: RunState
    callbacks: Callbacks
    model: torch.nn.Module  # the user's module, as everywhere in the runtime
    train_model: torch.nn.Module  # what the loop calls (DDP-wrapped); compiled forms: the stepper's engine
    objective: Objective
    precision: Precision
    feed: object
    val_feed: object
    stepper: Stepper
    best: BestCheckpoints | None = None  # save_top_k: the best checkpoints kept so far
    checkpointer: Checkpointer | None = None  # with checkpoint_dir: saves, and holds the run directory
    compilation: Compilation | None = None  # which engine the step runs on: eager, compiled, one CUDA graph
    continued: object = None  # the ContinueState this fit goes on from (continue_from)
    losses: StepLosses = field(default_factory=StepLosses)  # step losses since the last log
    eta: EtaClock = field(default_factory=EtaClock)
    samples_at_log: int = 0  # state.samples_seen at the last log: the interval's samples/s counts from it

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size


@dataclass
class Decisions:
    """What fit decides before it puts anything in place (`decide`): what a dry run shows."""

    carried: object  # the ContinueState a continued fit goes on from, or None
    device: torch.device
    precision: Precision  # FSDP's fp16: rebuilt with its sharded loss scaler
    optimizer: torch.optim.Optimizer  # the user's, or the default (a continued fit: the previous one's)
    train: object  # the training data as the feed takes it (preflight checked one batch of it)
    val_names: tuple | None
    monitor: object  # save_top_k's monitor, or None
    feed: object
    val_feed: object
    plan: RunPlan  # with the strategy
    summary: RunSummary  # with the memory plan and the strategy, as decided
    memory: MemoryPlan | None


def prepare(config, dist, model, train_data, val_data, optimizer, scheduler, objective, user_callbacks, teardown,
             continue_from, state_type, placement=ALONE) -> Run:
    __tracebackhide__ = True  # noqa: F841
    decided = decide(config, dist, model, train_data, val_data, optimizer, scheduler, objective, teardown,
                     continue_from, placement)
    plan, carried, summary, device = decided.plan, decided.carried, decided.summary, decided.device
    precision, feed, monitor, val_names = decided.precision, decided.feed, decided.monitor, decided.val_names
    # the measures in place before the schedule binds the optimizer
    optimizer = _memory_in_place(decided, model, objective, config, dist, teardown)
    schedule = _schedule(scheduler, optimizer, config, plan.total_steps, val_names, carried)
    # a continued fit goes on under the name of the fit it continues; the class: before FSDP renames it
    run_name = config.name or (carried.run_name if carried is not None else None) or type(model).__name__
    summary.run = run_name  # the summary and the result name the run alike
    checkpointing = checkpoint_every_block if config.activation_checkpointing else None
    train_model, teardown.unwrap = wrap_model(model, config, dist, device, checkpointing)  # undone whatever happens
    dist.adopt_shards(optimizer)  # FSDP replaced the parameters with sharded ones
    ema = _weight_ema(model, config, carried)
    state = state_type(model=model, optimizer=optimizer, schedule=schedule, ema=ema, precision=precision,
                       best=BestCheckpoints(monitor, config.save_top_k) if monitor is not None else None,
                       data_start=getattr(feed, "start", None),
                       run_name=run_name, config=config, plan=plan, train_model=train_model, device=device,
                       batches_per_epoch=feed.num_batches, steps_per_epoch=plan.steps_per_epoch,
                       total_steps=plan.total_steps, summary=summary.as_plain(),  # plain: ranks send it on
                       peak_tflops=device_peak_tflops(device, precision.name),  # live MFU in the progress line
                       rank=dist.rank, world_size=dist.world_size, val_names=val_names,
                       stops_by_vote=dist.stops_by_vote)
    # the state's marks: a profiler asks for the step's phases by name
    state.stepper = Stepper(train_model, optimizer, objective, precision, schedule, config, state.marks,
                            getattr(train_model, "no_sync", None), ema=ema)
    if decided.memory is not None:
        _memory_on_stepper(state.stepper, decided.memory, model, objective, config, teardown)
    run = Run(config, plan, dist, state, Callbacks(list(user_callbacks)), model, train_model, objective,
              precision, feed, decided.val_feed, state.stepper, best=state.best)
    _add_checkpointer_and_schedule(run, schedule)
    _choose_engine(run)  # now, or under "auto" once timing says it pays
    if carried is not None:
        run.continued = carried
        continuing.restore(run, carried)
    if plan.resume:
        resume(run)
    state.start_step, state.start_samples = state.step, state.samples_seen  # a resumed or continued fit counts on
    run.samples_at_log = state.samples_seen  # the first interval's samples/s counts from here
    return run


def decide(config, dist, model, train_data, val_data, optimizer, scheduler, objective, teardown,
           continue_from=None, placement=ALONE) -> Decisions:
    """Everything fit decides before it puts anything in place, in the order it is decided: the
    continuation, device and precision (setup.py), one batch checked (preflight), the batch size,
    the feeds, the RunPlan, the summary's forward + backward, the memory plan and the strategy
    (the context told, before anything wraps the model). A dry run stops here."""
    __tracebackhide__ = True  # noqa: F841
    optimizer, carried = _continuation(config, dist, model, optimizer, teardown, continue_from)
    ready = setup(config, dist, model, train_data, val_data, optimizer)
    device, precision, optimizer = ready.device, ready.precision, ready.optimizer
    _ready_device(device, objective)
    # one batch, before any work
    train, val = preflight(model, ready.train, ready.val, objective, precision, device, config)
    val_names = validation_names(objective, val is not None)
    monitor = monitor_of(config)
    if monitor is not None:
        monitor.check_produced(val_names, f"save_top_k={config.save_top_k}")
    choice, train = _batch_size(config, dist, model, optimizer, objective, precision, train, device)
    feed, val_feed = _feeds(train, val, choice.size, device, config, dist)
    plan = _plan(config, ready, choice, feed, carried, placement)
    validation.warn_unused(config, plan, val is not None, dist.rank)
    # one forward + backward, undone; FSDP: the whole model's step may not fit on one device
    summary = summarize(model, optimizer, objective, precision, train, device, plan.batch_size, config,
                        measure=not (dist.world_size > 1 and config.strategy == "fsdp"))
    # measures chosen from the summary's estimate
    memory = plan_run(summary, model, optimizer, objective, precision, config, dist, device, scheduler=scheduler,
                      continuing=carried is not None or bool(plan.resume))
    if memory is not None and memory.acts:
        summary.plan = memory.text()  # said again once what it costs is measured
    plan, precision = _strategy(plan, config, dist, memory, summary, precision)  # before anything wraps the model
    return Decisions(carried, device, precision, optimizer, train, val_names, monitor, feed, val_feed, plan,
                     summary, memory)


def _memory_in_place(decided: Decisions, model, objective, config, dist, teardown):
    """The optimizer to train with: the memory plan's cost measured on the first batch (before
    anything is in place, which the measuring would disturb), its measures in place, undone by the
    teardown, and said in the summary."""
    memory, summary, optimizer = decided.memory, decided.summary, decided.optimizer
    if memory is None or not memory.acts:
        return optimizer
    measure_plan_cost(memory, summary, model, optimizer, objective, decided.precision, decided.train,
                      decided.device, config, dist.world_size)
    optimizer, teardown.memory = apply_plan(memory, model, optimizer, objective)
    summary.plan = memory.text()
    return optimizer


def _strategy(plan, config, dist, memory, summary, precision):
    """The plan with the strategy the run trains under (strategy="auto": FSDP when the memory plan
    shards), the context told, the summary said, and the precision rebuilt where FSDP's fp16 needs
    its own scaler."""
    strategy = run_strategy(config, dist.world_size, memory)
    if strategy.name is None:  # one process: nothing to say (and render stays unimported)
        return plan, precision
    summary.strategy = strategy.line()
    dist.use_strategy(strategy.name)
    if strategy.name == "fsdp" and precision.scaler is not None and config.strategy == "auto":
        # built for DDP: FSDP skips a step on every rank together
        precision = Precision(precision.name, precision.device, scaler_type=dist.grad_scaler)
    return replace(plan, strategy=strategy.name, strategy_reason=strategy.reason), precision


def _memory_on_stepper(stepper, memory, model, objective, config, teardown) -> None:
    """The plan's micro-batches, and the next measure for a real OOM the split cannot fix."""
    stepper.splits = memory.micro_batches  # over the budget by the activations alone: smaller pieces
    if config.memory_plan:
        stepper.memory_fallback = MemoryFallback(memory, model, objective)
        teardown.memory = _then(teardown.memory, stepper.memory_fallback.restore)


def _then(first, second):
    """Undo `second`, then `first` (either may be None)."""
    def both():
        second()
        if first is not None:
            first()
    return both


def _continuation(config, dist, model, optimizer, teardown, continue_from):
    """A continued fit (`continue_from`): its optimizer the previous one's, and what it goes on from."""
    if continue_from is None:
        return optimizer, None
    carried = continuing.continue_state_of(continue_from, model, config, dist.world_size)
    optimizer = continuing.same_optimizer(carried, optimizer)
    teardown.rollback = continuing.Rollback(carried, model)  # before anything moves
    return optimizer, carried


def _ready_device(device, objective) -> None:
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and newer
        torch.cuda.reset_peak_memory_stats(device)
    if objective.stateful is not None:
        objective.stateful.to(device)  # torchmetrics' states live where the outputs are
        objective.stateful.reset()  # nothing left from an earlier use of the same objects


def _batch_size(config, dist, model, optimizer, objective, precision, train, device):
    """The batch size (given, or probed under "auto": the ranks take the smallest), and the data at it."""
    if config.batch_size != "auto":
        return BatchChoice(config.batch_size, "", ()), train
    choice = find_batch_size(model, optimizer, objective, precision, train, device, config)
    choice = choice._replace(size=dist.smallest(choice.size))  # ranks must agree: the smallest fits on all
    if isinstance(train, DataLoader):
        train = with_batch_size(train, choice.size)
    return choice, train


def _feeds(train, val, batch_size, device, config, dist):
    feed = build_feed(train, batch_size=batch_size, device=device, config=config,
                      rank=dist.rank, world_size=dist.world_size)
    val_feed = (build_feed(val, batch_size=batch_size, device=device, config=config,
                           rank=dist.rank, world_size=dist.world_size, train=False)
                if val is not None else None)
    if getattr(feed, "start", None) is not None and (config.checkpoint_dir or config.resume) and dist.rank == 0:
        warn_unresumable(feed.loader)  # before training: a stop mid-epoch would not resume exactly
    return feed, val_feed


def _plan(config, ready, choice, feed, carried, placement) -> RunPlan:
    """What set-up decided: device, precision, batch size, length (a continued fit's counted on), log
    interval, and where checkpoints go (the config's, else the placement's: a job's folder)."""
    length = plan_length(config, feed.num_batches, carried)
    return RunPlan(device=ready.device, precision=ready.precision.name, precision_reason=ready.precision_reason,
                batch_size=feed.batch_size or choice.size,  # a user's DataLoader batches by its own size
                batch_size_reason=choice.reason, batch_probe=choice.probes,
                log_every=config.resolved_log_every(length["total_steps"], length["steps_per_epoch"]),
                compile=config.compile, checkpoint_dir=placement.checkpoints(config),
                resume=placement.resumes(config), **length)


def _add_checkpointer_and_schedule(run: Run, schedule) -> None:
    """Both hear each event before the user's callbacks, the schedule first of all."""
    if run.plan.checkpoint_dir:  # first: saved before others hear of the step
        run.checkpointer = Checkpointer(run.config, dist=run.dist, state=run.state, losses=run.losses,
                                        events=run.callbacks)
        run.callbacks.run_first(run.checkpointer)
    if schedule is not None:  # steps at epoch ends before the checkpoint of that epoch is written
        run.callbacks.run_first(schedule)


def _choose_engine(run: Run) -> None:
    """compile=: a forced mode's engine from the first step; under "auto", a callback that times
    the first steps and asks for an engine once timing says it pays."""
    state = run.state
    run.compilation = Compilation(run.config, run.stepper, run.dist, run.model, run.feed, run.batch_size,
                                  state.total_steps, state.device)
    answer_compilation(run)
    if run.compilation.timing:
        run.callbacks.add(run.compilation)


def answer_compilation(run: Run) -> None:
    """At a step boundary: the engine step/compiling.py asks for, and its leave once it is done."""
    engine, done = run.compilation.take_request()
    if engine is not None:
        run.stepper.switch(engine)
    if done:
        run.callbacks.remove(run.compilation)


def _schedule(spec, optimizer, config, total_steps, val_names, carried):
    """This fit's schedule; a continued fit keeps the previous one unless it is given another."""
    if carried is not None and spec is None and config.lr_schedule == "none":
        return continuing.kept_schedule(carried, total_steps)
    own_steps = total_steps - carried.step if carried is not None and total_steps else total_steps
    return build_schedule(spec, optimizer, config, own_steps, val_names)


def _weight_ema(model, config, carried):
    if config.ema is None:
        return None
    if carried is not None and carried.ema is not None:
        ema = carried.ema  # the average goes on, with this fit's decay
        ema.decay, ema.warmup = config.ema, config.ema_warmup
        return ema
    return WeightEma(model, config.ema, config.ema_warmup)
