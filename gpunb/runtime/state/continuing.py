"""Continue training: a fit that goes on where the last one (of the same model) stopped.

`Trainer.fit(model, data, continue_from=previous_result)` keeps the previous fit's
optimizer (the default AdamW too, with its moments), its schedule, its weight average,
the loss scaler, the random number generators, the step count and the history: steps
and epochs are numbered on, and `epochs` / `max_steps` count what this fit adds (after a
stop mid-epoch, the rest of that epoch comes first, with its validation and epoch-end
schedule step). It needs no checkpoint: the objects stay in memory, in
`result.continue_state` (set it to None to free the optimizer state).
One process only; across processes, resume from a checkpoint instead.

A result is continued once: the continuation moves its objects on, so the result it went
on from is refused after that, pointing to the newer one. A continuation that fails puts
the objects back as they were when it started (host copies taken first), so the same
result can be continued again.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from dataclasses import dataclass, field

from gpunb.errors import GpunbError
from gpunb.runtime.state import rewind
from gpunb.runtime.run_state import Live


@dataclass(eq=False)
class ContinueState:
    """What a one-process fit leaves for the next one to go on from: its RunState's
    `state_dict(live=True)` (the optimizer, schedule and weight average as the objects
    themselves; counters, history, the scaler, the RNGs and any other carried field as values)."""

    model: weakref.ref  # the module trained (weak: the state does not keep it alive)
    saved: dict  # RunState.state_dict(live=True), its "model" left out
    continued_by: str | None = None  # the fit that went on from this state (its objects have moved on)
    run_id: str | None = None  # the fit's row in the run registry (tracked fits): a continuation goes on in it
    # name -> (weak reference, shape) of each parameter of the model when the fit ended: a layer
    # replaced since then is not the one the optimizer holds (changed_parameters)
    parameters: dict = field(default_factory=dict)

    @property
    def optimizer(self):
        return self.saved["optimizer"].value

    @property
    def schedule(self):
        return self.saved["scheduler"].value

    @property
    def ema(self):
        return self.saved["ema"].value

    @property
    def step(self) -> int:
        return self.saved["step"]

    @property
    def run_name(self) -> str:
        return self.saved["run_name"]

    @property
    def next_epoch(self) -> int:
        """The epoch after the last one trained (a partly trained one counts)."""
        return self.saved["epoch"] + 1 if self.saved["batch_in_epoch"] else self.saved["epoch"]

    def __repr__(self) -> str:
        return f"ContinueState(step={self.step}, next_epoch={self.next_epoch})"


def continue_state_of(previous, model, config, world_size: int) -> ContinueState:
    """The previous fit's ContinueState, checked against this fit; a GpunbError says why not."""
    state = getattr(previous, "continue_state", previous)
    if not isinstance(state, ContinueState):
        why = ("that fit ran in several processes or was not kept" if hasattr(previous, "continue_state")
               else f"got a {type(previous).__name__}")
        raise GpunbError(f"continue_from needs the TrainResult of an earlier one-process fit ({why}).",
                         "pass the result of the fit to continue, `continue_from=result`, or start a fresh fit.")
    if state.continued_by is not None:
        raise GpunbError(f"This result was already continued by {state.continued_by}: the model, optimizer, "
                         "schedule and weight average have moved on from it, so continuing it again would "
                         "number the steps from its end while training from the later state.",
                         "continue from the newer fit's result (`continue_from=<its result>`; after "
                         "`%%gputrain --continue` it is `gputrain_result`), or start a fresh fit.")
    if state.model() is not model:
        raise GpunbError("continue_from is the result of a fit of another model: its optimizer state and "
                         "step count belong to that model's parameters.",
                         "continue with the same model object that fit trained, or start a fresh fit "
                         "without `continue_from`.")
    changed = changed_parameters(state, model)
    if changed:
        raise GpunbError(f"The model's parameters changed since the fit to continue: {_listed(changed)}. The "
                         "continued optimizer holds the parameters it was built on and their state, so a new or "
                         "reshaped parameter would never train (or its state would not fit).",
                         "drop `continue_from` (`%%gputrain` without `--continue`): a fresh fit builds its "
                         "optimizer over the parameters as they are now (pass `optimizer=` built on "
                         "`model.parameters()` to keep your own settings).")
    if world_size > 1 or config.devices != 1:
        raise GpunbError("Continuing a fit keeps its optimizer in this process, so it works in one process only.",
                         "train with `devices=1`, or use `checkpoint_dir` and `resume='last'` across processes.")
    if config.resume:
        raise GpunbError("continue_from and resume were both given: a fit goes on from one of them.",
                         "drop `resume` to continue the fit in memory, or drop `continue_from` to load the checkpoint.")
    return state


def changed_parameters(state: ContinueState, model) -> list[tuple[str, str]]:
    """(name, how) of each parameter that is not what the continued optimizer was left with: new,
    replaced, removed or reshaped since the previous fit ended. Only those that matter: what
    trains now, or what the optimizer holds (a frozen layer swapped for another is no change)."""
    held = {id(p) for group in state.optimizer.param_groups for p in group["params"]}
    now = dict(model.named_parameters())
    changed = []
    for name in dict.fromkeys([*state.parameters, *now]):
        ref, shape = state.parameters.get(name, (None, None))
        before, param = ref() if ref is not None else None, now.get(name)
        if not ((param is not None and param.requires_grad) or (before is not None and id(before) in held)):
            continue
        if param is None:
            changed.append((name, "removed"))
        elif ref is None:
            changed.append((name, "new"))
        elif param is not before:
            changed.append((name, "replaced"))
        elif tuple(param.shape) != shape:
            changed.append((name, f"reshaped {shape} -> {tuple(param.shape)}"))
    return changed


def _listed(changed: list[tuple[str, str]], shown: int = 8) -> str:
    text = ", ".join(f"{name} ({how})" for name, how in changed[:shown])
    return text + (f" and {len(changed) - shown} more" if len(changed) > shown else "")


def same_optimizer(state: ContinueState, optimizer):
    """The optimizer goes on: the previous fit's, which the caller may pass again, but not another."""
    if optimizer is not None and optimizer is not state.optimizer:
        raise GpunbError("A continued fit goes on with the optimizer of the fit it continues, and "
                         "another optimizer was given.",
                         "leave `optimizer` out (or pass the same one) to continue, or start a fresh fit "
                         "without `continue_from` to train with the new optimizer.")
    return state.optimizer


def kept_schedule(state: ContinueState, total_steps: int | None):
    """The previous schedule, going on; a built-in one is fitted to the longer run."""
    schedule = state.schedule
    if schedule is None or schedule.builtin is None:
        _check_room(schedule, total_steps)
        return schedule
    planned = planned_steps(schedule)
    if total_steps is None or planned == total_steps:
        return schedule
    if schedule.builtin == "one-cycle":
        raise GpunbError(f"The fit to continue followed a one-cycle schedule planned for {planned} steps; "
                         f"going on to step {total_steps} would step it past its end.",
                         "give this fit a schedule of its own: `lr_schedule='cosine'` or "
                         "`scheduler=lambda opt, steps: ...` (built on the continued optimizer).")
    before, after = stretch_cosine(schedule.scheduler, total_steps)
    warnings.warn(f"The cosine schedule was planned for {planned} steps and the continued run has "
                  f"{total_steps}: it now decays to zero at step {total_steps} (learning rate "
                  f"{before:.3g} -> {after:.3g} at step {state.step}).", RuntimeWarning, stacklevel=2)
    return schedule


def _check_room(schedule, total_steps: int | None) -> None:
    """A user's OneCycleLR (its `total_steps` fixed when built) must not be stepped past its end."""
    length = getattr(getattr(schedule, "scheduler", None), "total_steps", None)
    if length is None or schedule.interval != "step" or total_steps is None or total_steps <= length:
        return
    raise GpunbError(f"The fit to continue follows a {type(schedule.scheduler).__name__} built for {length} steps "
                     f"(its `total_steps`, fixed when it is built); going on to step {total_steps} would step "
                     "it past its end, and torch would raise there.",
                     "give this fit a schedule of its own (`scheduler=lambda opt, steps: ...`, built on the "
                     "continued optimizer, or `lr_schedule='cosine'`), or continue for at most "
                     f"{length} steps in all.")


def planned_steps(schedule) -> int | None:
    scheduler = schedule.scheduler
    if hasattr(scheduler, "total_steps"):  # OneCycleLR
        return scheduler.total_steps
    lambdas = getattr(scheduler, "lr_lambdas", [None])
    return getattr(lambdas[0], "total_steps", None)


def stretch_cosine(scheduler, total_steps: int) -> tuple[float, float]:
    """Make a warmup-cosine LambdaLR decay to zero at `total_steps`; (lr before, lr after)."""
    optimizer = scheduler.optimizer
    before = optimizer.param_groups[0]["lr"]
    for schedule in scheduler.lr_lambdas:
        schedule.total_steps = total_steps
    lrs = [base * schedule(scheduler.last_epoch) for base, schedule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
    return before, lrs[0]


def restore(run, carried: ContinueState) -> None:
    """Put the run's state where the previous fit left it (the objects it took over at set-up)."""
    run.state.load_state_dict(carried.saved)
    run.state.continues_run = carried.run_id


def capture(run, carried: ContinueState | None = None) -> ContinueState | None:
    """The ContinueState of a finished fit (None in multi-process runs); `carried`, the state
    this fit went on from, is marked as continued."""
    fit = run.state
    if fit.world_size > 1:
        return None
    if carried is not None:
        carried.continued_by = (f"the fit of {fit.run_name!r} that went on from step {carried.step} "
                                f"to step {fit.step}")
    # A stop mid-epoch goes on in that epoch, after its batches already used (its end comes then).
    ended = (bool(fit.epochs) and fit.epochs[-1]["epoch"] == fit.epoch) or not fit.batch_in_epoch
    saved = fit.state_dict(live=True, epoch_done=fit.step > 0 and ended)
    if fit.step == 0:  # nothing trained: the same epoch, from its start
        saved["batch_in_epoch"] = 0
    saved["model"] = Live(None)  # held weakly, below
    parameters = {name: (weakref.ref(p), tuple(p.shape)) for name, p in run.model.named_parameters()}
    return ContinueState(weakref.ref(run.model), saved, run_id=fit.registry_run, parameters=parameters)


class Rollback:
    """Host copies of what a continued fit moves; called when that fit fails, puts them back.

    The model, the optimizer (state and learning rates), the schedule (also a stretched
    cosine's length) and the weight average return to the step the continuation started
    from, so continuing the same result again is exact. The counters and the history live
    in the ContinueState, which the fit only reads.
    """

    def __init__(self, state: ContinueState, model):
        self.state, self.model = state, model
        self.saved = rewind.capture(model, state.optimizer)
        self.schedule = copy.deepcopy(state.schedule.state_dict()) if state.schedule is not None else None
        ema = state.ema
        self.ema = None if ema is None else (ema.state_dict(to_cpu=True), ema.updates, ema.decay, ema.warmup)

    def __call__(self, announce: bool = True) -> None:
        """Put everything back; `announce`: say so (not when set-up refused the fit before it trained)."""
        state = self.state
        state.continued_by = None  # also when the failure came after the fit's result was made
        rewind.restore(self.saved, self.model, state.optimizer)
        if self.schedule is not None:
            state.schedule.load_state_dict(self.schedule)
        if self.ema is not None:
            weights, state.ema.updates, state.ema.decay, state.ema.warmup = self.ema
            state.ema.load_state_dict(weights)
        if announce:
            warnings.warn(f"The continued fit failed. So that the result it went on from can be continued "
                          f"again, the model's weights, its optimizer, schedule and weight average are back as "
                          f"they were at step {state.step}, where this fit started (its own checkpoints keep "
                          "what it trained after that).", RuntimeWarning, stacklevel=2)
