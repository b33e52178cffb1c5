"""run(): a one-process run (or one rank's): prepared (prepare.py), then trained, top to bottom.

dry_run(): the same run stopped before it puts anything in place: the summary fit would show.

Logging, checkpointing, telemetry and the run registry hang off events (see
events.py); the loop itself only steps, counts and emits. The loss stays on the
device and is read once per `log_every` steps: the loop has no other host syncs.
"""

from __future__ import annotations

import warnings

import torch

from gpunb.config import TrainConfig
from gpunb.runtime import device as devices
from gpunb.runtime.epoch import EpochSteps, Timer
from gpunb.runtime.feed.feeds import closing
from gpunb.runtime.interrupt import InterruptFlag
from gpunb.runtime.placement import ALONE
from gpunb.runtime.prepare import Run, answer_compilation, decide, prepare
from gpunb.runtime.probes.summary import RunSummary
from gpunb.runtime.result import TrainResult, epoch_mean_loss
from gpunb.runtime.roles import check_model
from gpunb.runtime.run_state import RunState
from gpunb.runtime.state import continuing
from gpunb.runtime.step.objective import Objective
from gpunb.runtime.teardown import Teardown
from gpunb.runtime.validation import passes as validation


def run(config: TrainConfig, dist, model, train_data, val_data=None, *, optimizer=None, scheduler=None,
        loss_fn=None, step=None, metrics=None, callbacks=(), continue_from=None, state_type=None,
        placement=ALONE) -> TrainResult:
    """Train `model` in this process; returns a TrainResult. The model is trained in place.

    `scheduler`: see runtime/step/schedule.py; `continue_from`: a TrainResult to go on from
    (runtime/state/continuing.py); `state_type`: a RunState subclass whose own fields the run
    carries too (runtime/run_state.py; None: RunState).

    `dist`, the context, says where this process stands: `LocalContext()` alone, or one rank of
    a process group (gpunb.distributed.context). `callbacks` are all the callbacks the run
    hears; gpunb.Trainer adds its defaults (telemetry, the run registry) to the user's.
    `placement` says how whoever started this process placed it (runtime/placement.py: a job's
    checkpoints folder, a requeue's resume); `config` stays as the user gave it.
    """
    __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
    check_model(model)
    teardown = Teardown(model)
    prepared = None
    try:
        with InterruptFlag() as setting_up:  # a Ctrl-C in set-up: stop before the first step
            teardown.saved_globals = devices.seed_everything(config.seed, config.deterministic)
            prepared = prepare(config, dist, model, train_data, val_data, optimizer, scheduler,
                                Objective(loss_fn, step, metrics, config.batch_size_fn), callbacks, teardown,
                                continue_from, state_type or RunState, placement)
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


def dry_run(config: TrainConfig, dist, model, train_data, val_data=None, *, optimizer=None, loss_fn=None,
            step=None, metrics=None) -> RunSummary:
    """The summary fit would show, without training: `run` stopped where prepare has decided and
    has put nothing in place yet (prepare.decide): fit's set-up and checks, the batch size (an
    "auto" probe restores everything it touches), one forward + backward, undone, and the memory
    plan and strategy fit would take (raising, as fit does, when nothing can fit). No optimizer
    step, no checkpoint, no run in the registry; the model is moved to the device."""
    __tracebackhide__ = True  # noqa: F841
    check_model(model)
    teardown = Teardown(model)
    try:
        decided = decide(config, dist, model, train_data, val_data, optimizer, None,
                         Objective(loss_fn, step, metrics, config.batch_size_fn), teardown)
    except BaseException:
        teardown(failed=True, trained=False)
        raise
    teardown(failed=False)
    return decided.summary


def _train(run: Run) -> TrainResult:
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


def _train_epoch(run: Run, epoch: int, skip: int, timer, interrupt) -> bool:
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
    if _finished(state):  # resumed at the run's last step: no step is left, at most that epoch's end
        if skip and not (state.epochs and state.epochs[-1]["epoch"] == epoch):  # saved before its end
            with warnings.catch_warnings():  # the optimizer stepped in the run that saved the checkpoint
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler", UserWarning)
                _end_epoch(run, state.history[logged_before:], timer)
        return False
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
                answer_compilation(run)
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


def _finish(run: Run, timer) -> TrainResult:
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


def _finished(state: RunState) -> bool:
    return state.total_steps is not None and state.step >= state.total_steps


def _log(run: Run, timer) -> None:
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


def _end_epoch(run: Run, logged: list, timer) -> None:
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


def _memory_text(run: Run) -> str:
    """The summary's memory plan, and what an OOM added to it."""
    fallback = run.stepper.memory_fallback
    notes = fallback.notes if fallback is not None else []
    return "; ".join(text for text in ((run.state.summary or {}).get("plan", ""), *notes) if text)


def _result(run: Run, timer) -> TrainResult:
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
