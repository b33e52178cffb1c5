"""run(): set up a one-process run (or one rank's), then the training loop, top to bottom.

Logging, checkpointing, telemetry and the run registry hang off events (see
events.py); the loop itself only steps, counts and emits. The loss stays on the
device and is read once per `log_every` steps: the loop has no other host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader

from gpunb.config import TrainConfig
from gpunb.runtime import device as devices
from gpunb.runtime.epoch import EpochSteps, Timer
from gpunb.runtime.eta import EtaClock
from gpunb.runtime.events import Callbacks
from gpunb.runtime.feed.feeds import build_feed, closing, with_batch_size
from gpunb.runtime.interrupt import InterruptFlag
from gpunb.runtime.memory.measures import MemoryFallback, apply_plan, plan_run
from gpunb.runtime.plan import Plan
from gpunb.runtime.plan import length as plan_length
from gpunb.runtime.probes.batch_size import BatchChoice, find_batch_size
from gpunb.runtime.probes.peak_flops import device_peak_tflops
from gpunb.runtime.probes.preflight import preflight
from gpunb.runtime.probes.summary import summarize
from gpunb.runtime.result import TrainResult, epoch_mean_loss
from gpunb.runtime.roles import check_model
from gpunb.runtime.run_state import RunState
from gpunb.runtime.setup import setup
from gpunb.runtime.state import continuing
from gpunb.runtime.state.best_k import BestCheckpoints
from gpunb.runtime.state.checkpointer import Checkpointer, resume
from gpunb.runtime.state.nan_guard import StepLosses
from gpunb.runtime.state.resume_target import find_checkpoint
from gpunb.runtime.step.compiling import Compilation
from gpunb.runtime.step.ema import WeightEma
from gpunb.runtime.step.objective import Objective
from gpunb.runtime.step.precision import Precision
from gpunb.runtime.step.schedule import build_schedule
from gpunb.runtime.step.stepper import Stepper
from gpunb.runtime.step.wrap import wrap_model
from gpunb.runtime.teardown import Teardown
from gpunb.runtime.validation import passes as validation
from gpunb.runtime.validation.monitor import monitor_of, validation_names


def run(config: TrainConfig, context, model, train_data, val_data=None, *, optimizer=None, scheduler=None,
        loss_fn=None, step=None, metrics=None, callbacks=(), continue_from=None, state_type=None) -> TrainResult:
    """Train `model` in this process; returns a TrainResult. The model is trained in place.

    `scheduler`: see runtime/step/schedule.py; `continue_from`: a TrainResult to go on from
    (runtime/state/continuing.py); `state_type`: a RunState subclass whose own fields the run
    carries too (runtime/run_state.py; None: RunState).

    `context` says where this process stands: `LocalContext()` alone, or one rank of a
    process group (gpunb.distributed.context). `callbacks` are all the callbacks the run
    hears; gpunb.Trainer adds its defaults (telemetry, the run registry) to the user's.
    """
    __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
    check_model(model)
    teardown = Teardown(model)
    prepared = None
    try:
        with InterruptFlag() as setting_up:  # a Ctrl-C in set-up: stop before the first step
            teardown.saved_globals = devices.seed_everything(config.seed, config.deterministic)
            prepared = _prepare(config, context, model, train_data, val_data, optimizer, scheduler,
                                Objective(loss_fn, step, metrics, config.batch_size_fn), callbacks, teardown,
                                continue_from, state_type or RunState)
        if setting_up.raised:
            prepared.state.request_stop("interrupted")
        result = _train(prepared)
    except BaseException:
        # trained: this fit took a step (a resumed or continued fit starts above 0)
        trained = prepared is not None and prepared.state.step > prepared.state.start_step
        teardown(failed=True, trained=trained)
        raise  # the teardown never replaces this error (or KeyboardInterrupt)
    teardown(failed=False)
    return result


@dataclass
class _Run:
    """Everything one fit needs, built by _prepare."""

    config: TrainConfig  # as the user gave it
    plan: Plan  # what set-up decided
    dist: object
    state: RunState
    callbacks: Callbacks
    model: torch.nn.Module  # the user's module
    train_model: torch.nn.Module  # what the loop trains (DDP-wrapped); compiled forms: the stepper's engine
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


def _prepare(config, dist, model, train_data, val_data, optimizer, scheduler, objective, user_callbacks, teardown,
             continue_from, state_type) -> _Run:
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
    plan = _plan(config, ready, choice, feed, carried)
    validation.warn_unused(config, plan, val is not None, dist.rank)
    # one forward + backward, undone; FSDP: the whole model's step may not fit on one device
    summary = summarize(model, optimizer, objective, precision, train, device, choice.size, config,
                        measure=not (dist.world_size > 1 and config.strategy == "fsdp"))
    # measures chosen from the summary's estimate, before the schedule binds the optimizer
    memory, optimizer = _memory_plan(summary, model, optimizer, objective, precision, config, dist, device,
                                     scheduler, teardown, continuing=carried is not None or bool(config.resume))
    schedule = _schedule(scheduler, optimizer, config, plan.total_steps, val_names, carried)
    # a continued fit goes on under the name of the fit it continues; the class: before FSDP renames it
    run_name = config.name or (carried.run_name if carried is not None else None) or type(model).__name__
    train_model, teardown.unwrap = wrap_model(model, config, dist, device)  # undone whatever happens next
    dist.adopt_shards(optimizer)  # FSDP replaced the parameters with sharded ones
    ema = _weight_ema(model, config, carried)
    state = state_type(module=model, optimizer=optimizer, schedule=schedule, ema=ema, precision=precision,
                       best=BestCheckpoints(monitor, config.save_top_k) if monitor is not None else None,
                       run_name=run_name, config=config, plan=plan, model=train_model, device=device,
                       batches_per_epoch=feed.num_batches, steps_per_epoch=plan.steps_per_epoch,
                       total_steps=plan.total_steps, summary=summary.as_plain(),  # plain: ranks send it on
                       peak_tflops=device_peak_tflops(device, precision.name),  # live MFU in the progress line
                       rank=dist.rank, world_size=dist.world_size, val_names=val_names,
                       stops_by_vote=dist.stops_by_vote)
    # the state's marks: a profiler asks for the step's phases by name
    state.stepper = Stepper(train_model, optimizer, objective, precision, schedule, config, state.marks,
                            getattr(train_model, "no_sync", None), ema=ema)
    if memory is not None and config.memory_plan:  # a real OOM the split cannot fix: the next measure
        state.stepper.memory_fallback = MemoryFallback(memory, model, objective)
        teardown.memory = _then(teardown.memory, state.stepper.memory_fallback.restore)
    run = _Run(config, plan, dist, state, Callbacks(list(user_callbacks)), model, train_model, objective,
               precision, feed, val_feed, state.stepper, best=state.best)
    _add_checkpointer_and_schedule(run, schedule)
    _choose_engine(run)  # now, or under "auto" once timing says it pays
    if carried is not None:
        run.continued = carried
        continuing.restore(run, carried)
    if config.resume:
        resume(run, find_checkpoint(config.resume, config.checkpoint_dir))
    state.start_step, state.start_samples = state.step, state.samples_seen  # a resumed or continued fit counts on
    run.samples_at_log = state.samples_seen  # the first interval's samples/s counts from here
    return run


def _memory_plan(summary, model, optimizer, objective, precision, config, dist, device, scheduler, teardown,
                 continuing: bool):
    """The memory plan (None: none made) and the optimizer to train with; its measures in place,
    undone by the teardown, and said in the summary."""
    memory = plan_run(summary, model, optimizer, objective, precision, config, dist, device, scheduler=scheduler,
                      continuing=continuing)
    if memory is not None and memory.measures:
        optimizer, teardown.memory = apply_plan(memory, model, optimizer, objective)
        summary.plan = memory.text()
    return memory, optimizer


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
    return feed, val_feed


def _plan(config, ready, choice, feed, carried) -> Plan:
    """What set-up decided: device, precision, batch size, length (a continued fit's counted on), log interval."""
    length = plan_length(config, feed.num_batches, carried)
    return Plan(device=ready.device, precision=ready.precision.name, precision_reason=ready.precision_reason,
                batch_size=feed.batch_size or choice.size,  # a user's DataLoader batches by its own size
                batch_size_reason=choice.reason, batch_probe=choice.probes,
                log_every=config.resolved_log_every(length["total_steps"], length["steps_per_epoch"]),
                compile=config.compile, **length)


def _add_checkpointer_and_schedule(run: _Run, schedule) -> None:
    """Both hear each event before the user's callbacks, the schedule first of all."""
    if run.config.checkpoint_dir:  # first: saved before others hear of the step
        run.checkpointer = Checkpointer(run.config, dist=run.dist, state=run.state, losses=run.losses,
                                        events=run.callbacks)
        run.callbacks.run_first(run.checkpointer)
    if schedule is not None:  # steps at epoch ends before the checkpoint of that epoch is written
        run.callbacks.run_first(schedule)


def _train(run: _Run) -> TrainResult:
    """The loop: epochs of optimizer steps, logging at intervals, validation per epoch or N steps."""
    __tracebackhide__ = True  # noqa: F841
    state, callbacks = run.state, run.callbacks
    timer, interrupt = Timer(), InterruptFlag()
    start = (state.epoch, state.batch_in_epoch)  # where a resumed or continued fit goes on
    try:
        with interrupt:
            callbacks.call("on_fit_start", state)
            for epoch in range(start[0], run.plan.epoch_limit):
                if state.stop_reason == "interrupted":  # during set-up
                    break
                if not _train_epoch(run, epoch, start[1] if epoch == start[0] else 0, timer, interrupt):
                    break
    except KeyboardInterrupt:
        # A second Ctrl-C (or one outside the main thread) lands here mid-step; the
        # weights the model holds are kept and the run is reported as interrupted.
        state.request_stop("interrupted")
        run.stepper.optimizer.zero_grad(set_to_none=True)
    except BaseException as error:
        callbacks.call("on_exception", state, error)
        raise
    return _finish(run, timer)


def _train_epoch(run: _Run, epoch: int, skip: int, timer, interrupt) -> bool:
    """One epoch of optimizer steps (the rest of it after `skip` batches, on resume); whether the run goes on."""
    state, callbacks, stepper = run.state, run.callbacks, run.stepper
    compilation = run.compilation  # compile=: which engine the step runs on
    val_every_steps = validation.every_steps(run)  # None: no pass within epochs (the common case)
    log_every = run.plan.log_every
    samples_in = run.objective.samples  # batch_size_fn, or the target's first dimension
    state.epoch = epoch
    state.batch_in_epoch = skip
    logged_before = len(state.history)
    while logged_before and state.history[logged_before - 1].get("epoch") == epoch:
        logged_before -= 1  # a resumed epoch: its rows from before the stop count too
    run.train_model.train()
    remaining = None if run.feed.num_batches is None else run.feed.num_batches - skip
    # Per step, only host bookkeeping beside what a plain loop does (kept to a few
    # attribute updates: on sub-millisecond steps each call shows).
    with closing(run.feed.epoch(epoch, skip)) as batches:
        steps = EpochSteps(batches, run.config.grad_accum, timer, state.marks, remaining)
        for batch, last_in_step in steps:
            state.batch_in_epoch += 1
            state.samples_seen += samples_in(batch) * state.world_size
            stepper.accumulate(batch, last_in_step)
            del batch  # let it go before the optimizer step allocates its temporaries
            if not last_in_step:
                continue
            step_loss = stepper.update()  # stays on the device: no sync here
            state.step += 1
            run.losses.add(step_loss, state.step)  # a list append: no device op
            if val_every_steps and (state.step % val_every_steps == 0 or state.step == state.total_steps):
                validation.at_step(run, timer)  # before on_step_end: its checkpoints hold the pass
            callbacks.call("on_step_end", state)
            if compilation.asking:  # compile="auto" asks for another engine, or is done (step/compiling.py)
                _answer_compilation(run)
            if state.step % log_every == 0:
                _log(run, timer)  # syncs
            if interrupt.raised:
                state.request_stop("interrupted")
            if state.should_stop or _finished(state):
                break
    if run.losses:  # the epoch's last, partial interval
        _log(run, timer)
    if state.should_stop and not steps.exhausted:
        return False  # any stop mid-epoch (Ctrl-C, the sidebar, a callback): the epoch's end comes on resume
    _end_epoch(run, state.history[logged_before:], timer)
    return not (state.should_stop or _finished(state))


def _finish(run: _Run, timer) -> TrainResult:
    """The result, heard by on_fit_end; then the EMA weights into the model where asked."""
    state, stepper = run.state, run.stepper
    try:
        state.result = _result(run, timer)
        run.callbacks.call("on_fit_end", state)
    except BaseException as error:  # the end failed (an unreadable best checkpoint): heard as any error
        run.callbacks.call("on_exception", state, error)
        raise
    if stepper.ema is not None and run.config.ema_apply and not state.result.restored_best:
        stepper.ema.copy_to_model()
    return state.result


def _choose_engine(run: _Run) -> None:
    """compile=: a forced mode's engine from the first step; under "auto", a callback that times
    the first steps and asks for an engine once timing says it pays."""
    state = run.state
    run.compilation = Compilation(run.config, run.stepper, run.dist, run.model, run.feed, run.batch_size,
                                  state.total_steps, state.device)
    _answer_compilation(run)
    if run.compilation.timing:
        run.callbacks.add(run.compilation)


def _answer_compilation(run: _Run) -> None:
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


def _finished(state: RunState) -> bool:
    return state.total_steps is not None and state.step >= state.total_steps


def _log(run: _Run, timer) -> None:
    state, steps = run.state, len(run.losses)
    loss = run.dist.reduce_loss(run.losses.mean(), state)  # the interval's one sync (ranks: + stop vote)
    run.losses.end_interval(run, loss)  # detect_nan: raises on NaN, with the last good weights back
    seconds = timer.lap()
    samples, run.samples_at_log = state.samples_seen - run.samples_at_log, state.samples_seen
    row = {"step": state.step, "epoch": state.epoch, "loss": loss, "steps": steps,
           "lr": run.stepper.optimizer.param_groups[0]["lr"],
           "samples_per_s": samples / seconds if seconds else 0.0,
           "step_time_ms": 1000 * seconds / steps, "elapsed_s": timer.elapsed()}
    if run.stepper.oom_recoveries:
        row["oom_recoveries"] = run.stepper.oom_recoveries
    if run.precision.scaler is not None:
        row["skipped_steps"] = run.precision.skipped_steps  # one more read, at the same sync point
    state.history.append(row)
    state.latest.update(row)
    state.eta = run.eta.at_log(state.step, row["elapsed_s"], state.total_steps, seconds / steps)
    run.callbacks.call("on_log", state, row)


def _end_epoch(run: _Run, logged: list, timer) -> None:
    """Validation, the epoch's row (mean train loss from this epoch's log rows), on_epoch_end."""
    state = run.state
    row = {"epoch": state.epoch, "step": state.step}
    if logged:
        row["train_loss"] = epoch_mean_loss(logged)
    metrics = validation.validate(run, timer) if validation.due_at_epoch_end(run) else None
    row.update(validation.epoch_metrics(state))  # this pass, or the epoch's last at a step
    row["elapsed_s"] = timer.elapsed()
    run.eta.at_epoch_end(row["elapsed_s"])
    state.epochs.append(row)  # before on_validation_end: a best checkpoint then holds the row
    if metrics is not None:
        run.callbacks.call("on_validation_end", state, metrics)
    run.callbacks.call("on_epoch_end", state, row)
    run.dist.sync_stop(state)  # ranks: a stop asked for at the epoch's end (early stopping) applies now


def _memory_text(run: _Run) -> str:
    """The summary's memory plan, and what an OOM added to it."""
    fallback = run.stepper.memory_fallback
    notes = fallback.notes if fallback is not None else []
    return "; ".join(text for text in ((run.state.summary or {}).get("plan", ""), *notes) if text)


def _result(run: _Run, timer) -> TrainResult:
    state, stepper = run.state, run.stepper
    device = state.device
    peak = (torch.cuda.max_memory_allocated(device) / 2**20) if device.type == "cuda" else None
    return TrainResult.from_state(
        state, micro_batch_size=stepper.micro_batch_size(run.plan.batch_size),
        wall_time_s=timer.elapsed(), data_wait_s=timer.data_wait, validation_s=timer.validation,
        compute_s=max(0.0, timer.elapsed() - timer.data_wait - timer.validation),
        peak_memory_mb=peak, oom_recoveries=stepper.oom_recoveries, skipped_steps=run.precision.skipped_steps,
        memory_plan=_memory_text(run),
        compilation=run.compilation.report(),
        ema_state_dict=stepper.ema.state_dict(to_cpu=True) if stepper.ema is not None else None,
        continue_state=continuing.capture(run, run.continued))
