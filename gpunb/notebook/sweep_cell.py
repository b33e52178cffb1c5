"""`%%gputrain --trials N`: the cell runs as a sweep, one trial after another in this kernel, or
each trial a job (`--parallel K`, `--detach`: on this machine; `--cluster slurm`: on Slurm).

Each trial re-runs the cell with that trial's values (its `gpunb.suggest` calls answer from
the trial), so every trial's model, optimizer and data are built afresh as the cell builds
them. At the end the cell's `model` variable holds the best trial's trained model, and the
result variable holds that trial's TrainResult with the sweep on it (`gputrain_result.sweep`).
"""

from __future__ import annotations

from IPython.core.error import UsageError

from gpunb.errors import GpunbError
from gpunb.notebook.collect import collect, named_options
from gpunb.runtime.roles import REQUIRED

_NOT_WITH = {"continue_fit": "--continue", "export": "--export", "find_lr": "--find-lr", "eval": "--eval",
             "dry_run": "--dry-run"}


def check_sweep_line(args, cell, config):
    """The sweep's settings; what a sweep cannot be combined with is refused before the cell runs."""
    from gpunb.sweeps.study import SweepSettings

    if cell is None:
        raise UsageError("--trials runs the cell once per trial, and a line magic has no cell.\n"
                         "HINT: put `%%gputrain --trials N` on top of the cell that builds the model.")
    for dest, flag in _NOT_WITH.items():
        if getattr(args, dest, None):
            raise UsageError(f"--trials runs a sweep of fresh fits, and {flag} does not.\n"
                             f"HINT: drop `{flag}` (or `--trials`).")
    if args.no_wait:  # the kernel holds the study: it asks, prunes and tells every trial
        raise UsageError("--trials is followed from this kernel, which holds the sweep's study and prunes its "
                         "trials, and --no-wait returns at once.\nHINT: drop `--no-wait`; a named sweep "
                         "(`--name`) whose kernel restarted follows its running trials when the cell runs again.")
    if config.resubmit:  # a re-run follows the jobs of the trials the study holds as running
        raise UsageError("--trials run again follows the jobs of the trials its sweep left running, and "
                         "--resubmit would submit those trials again beside their running jobs.\nHINT: drop "
                         "`--resubmit`; for a sweep afresh give it another `--name`.")
    return SweepSettings(args.trials, sampler=args.sampler, prune=args.prune, direction=args.direction,
                         seed=config.seed, monitor=config.monitor or "val_loss").check()


def run_sweep_cell(shell, args, line, cell, config, settings, view=None):
    """Run the sweep; `view`: a SweepView (None: the trials' lines only). Returns the SweepResult."""
    from gpunb.trainer import Trainer

    named = named_options(line)

    def ended(row):
        print(trial_line(row, config))
        if view is not None:
            view.ended(row)

    def build(trial):
        before = {name: id(value) for name, value in shell.user_ns.items()}
        ran = shell.run_cell(cell, store_history=False)
        if not ran.success:
            error = ran.error_in_exec or ran.error_before_exec
            raise CellFailed(f"the cell raised while building trial {getattr(trial, 'number', '')} "
                             f"({type(error).__name__}: {error}; its traceback is above).", "fix the cell: it "
                             "runs once per trial, with that trial's values for each gpunb.suggest.")
        found = collect(shell.user_ns, args, before, named, required=REQUIRED)
        return {role: found[role] for role in ("model", "train_data", "val_data", "optimizer", "scheduler",
                                               "loss_fn", "step", "metrics")} | {"callbacks": found["callbacks"]}

    sweep = Trainer(config).sweep(build, settings.trials, monitor=settings.monitor, direction=settings.direction,
                                  sampler=settings.sampler, prune=settings.prune, seed=settings.seed,
                                  on_trial=ended, callbacks=[view] if view is not None else [],
                                  parallel=args.parallel, key=f"{line}\n{cell}")
    if sweep.best_model is not None:
        shell.user_ns[args.model_name] = sweep.best_model
        sweep.best_result.sweep = sweep
    return sweep


def trial_line(row, config) -> str:
    """One line per trial as it ends: its number, state, value and parameters (4 digits)."""
    from gpunb.render import fmt

    monitor = config.monitor or "val_loss"
    value = f", {monitor}={fmt(row.value)}" if row.value is not None else ""
    pruned = f" at step {row.pruned_at}" if row.pruned_at is not None else ""
    params = ", ".join(f"{k}={fmt(v)}" for k, v in row.params.items())
    return f"trial {row.number}: {row.state}{pruned}{value} ({params})" + (f": {row.error}" if row.error and
                                                                          row.state == "failed" else "")


class CellFailed(GpunbError):
    """The cell itself raised while a trial was built (shown above by IPython)."""
