"""%%gputrain and %gpustatus: thin magics over gpunb.Trainer and gpunb.telemetry."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from gpunb.notebook.collect import collect, named_options
from gpunb.notebook.options import cluster_options, config_options, make_strict, role_options, usage_errors
from gpunb.notebook.session import continue_state as session_continue_state
from gpunb.runtime.roles import NAMES, REQUIRED, SETUP


@magics_class
class GpuMagics(Magics):
    # Every TrainConfig field is an option (config_options), then the magic's own options, the job
    # backends' settings (cluster_options), then the variable holding each of fit's objects (role_options).
    @magic_arguments()
    @config_options()
    @argument("--continue", dest="continue_fit", action="store_true",
              help="go on from the last %%%%gputrain of this model: its optimizer, schedule, step count, history")
    @argument("--out", default="gputrain_result", help="variable that receives the TrainResult")
    @argument("--quiet", action="store_true", help="no live dashboard; only the final summary")
    @argument("--find-lr", action="store_true", help="run a learning-rate range test instead of training")
    @argument("--export", metavar="PATH", help="write a standalone torchrun script instead of training")
    @argument("--eval", action="store_true", help="evaluate the model on val_data (or train_data) instead of training")
    @argument("--dry-run", action="store_true", help="show the run's summary (parameters, FLOPs, memory) without training")
    @argument("--no-wait", action="store_true", help="with a job: submit and return; gpunb.attach(name) follows it")
    @argument("--trials", type=int, help="run the cell as a sweep of N trials (gpunb.suggest gives each its values)")
    @argument("--parallel", type=int, default=1, help="a sweep's trials at once, each a job (on this machine, or on --cluster)")
    @argument("--sampler", default="tpe", help="a sweep's sampler: tpe | random | grid (seeded by --seed)")
    @argument("--prune", default="none", help="stop poor trials at a validation: asha | median | none")
    @argument("--direction", help="minimize | maximize the monitored value (default: by --monitor's name)")
    @cluster_options()
    @role_options()
    @line_cell_magic
    def gputrain(self, line, cell=None):
        """Train the model a cell defines, under gpunb's managed runtime.

        The cell is ordinary PyTorch. It runs first, in the notebook's namespace, and
        must define `model` (an nn.Module) and `train_data` (a Dataset, a Hugging Face
        `datasets.Dataset` or any object with `__len__` and `__getitem__`, a DataLoader,
        a tensor, a tuple of tensors, or NumPy/DLPack arrays). It may define `val_data`,
        `optimizer` (default AdamW), `scheduler` (a torch LR scheduler on `optimizer`, or
        `f(optimizer, total_steps) -> scheduler`), `loss_fn` (or a model that returns its
        loss, or `step(model, batch)` returning the loss, or `(loss, output)` for `metrics`),
        `metrics` and `callbacks`; `--model net`
        etc. use other names. Afterwards `model` is trained in place and the TrainResult
        is in `gputrain_result` (or `--out`). `--continue` trains the same model on from
        the last %%gputrain: `--epochs 2` then means two more epochs. As a line magic
        (`%gputrain --continue --epochs 2`) it runs no cell and trains what earlier cells
        defined.

        Example::

            %%gputrain --epochs 3 --batch-size auto
            model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
            train_data = (x, y)
            loss_fn = nn.CrossEntropyLoss()
        """
        __tracebackhide__ = True  # noqa: F841 (errors from the user's model show their own frames)
        args = parse_argstring(self.gputrain, line)
        with usage_errors(args):
            return self._gputrain(args, line, cell)

    def _gputrain(self, args, line, cell):
        __tracebackhide__ = True  # noqa: F841
        config = _config(args)
        if args.continue_fit and (args.export or args.find_lr):
            other, then = ("--export", "export the cell") if args.export else ("--find-lr", "sweep the learning rate")
            raise UsageError(f"--continue trains on from the last fit, and {other} does not train here.\n"
                             f"HINT: drop `--continue` to {then}.")
        if args.export:
            if cell is None:
                raise UsageError("--export writes the cell's code into a script, and a line magic has no cell.\n"
                                 "HINT: use the cell magic: `%%gputrain --export train.py` on top of the cell.")
            return self._export(args, line, cell, config)
        if args.trials is not None:
            return self._sweep(args, line, cell, config)
        if not args.quiet and not args.find_lr:
            _dashboard_mode(self.shell)  # a bad GPUNB_DASHBOARD is refused before the cell runs
        before = {name: id(value) for name, value in self.shell.user_ns.items()}
        if cell is not None and not self.shell.run_cell(cell, store_history=False).success:
            return None  # the user's own traceback has been shown; nothing to train
        # a line magic or --continue trains what the namespace holds, as the last fit did: every
        # role is the user's choice there, none a leftover to judge (notebook/leftovers.py)
        named = set(NAMES) if cell is None or args.continue_fit else named_options(line)
        found = collect(self.shell.user_ns, args, before, named, required=("model",) if args.eval else REQUIRED)
        if args.eval:
            return _evaluate(self.shell, found, config, args)
        if args.dry_run:
            return _dry_run(self.shell, found, config, args)
        if args.find_lr:
            return _find_lr(found, config)
        key = None if cell is None or config.cluster is None else _cell_key(cell, line)
        return self._train(config, found, args, key)

    def _train(self, config, found, args, job_key=None):
        __tracebackhide__ = True  # noqa: F841
        from IPython.display import display

        from gpunb.notebook.busy import kernel_stays_busy
        from gpunb.trainer import Trainer

        callbacks = [*found["callbacks"], *_progress_callbacks(self.shell, args.quiet)]
        if config.cluster is not None and not args.quiet:
            from gpunb.notebook.job_notice import JobNotice

            callbacks.append(JobNotice())
        previous = session_continue_state() if args.continue_fit else None
        with kernel_stays_busy(self.shell):  # the dashboard's widgets must not read "Idle"
            if args.no_wait:
                return _submit_only(self.shell, config, found, args, job_key)
            result = Trainer(config).fit(
                found["model"], found["train_data"], found["val_data"], optimizer=found["optimizer"],
                scheduler=found["scheduler"], loss_fn=found["loss_fn"], step=found["step"],
                metrics=found["metrics"], callbacks=callbacks, continue_from=previous, job_key=job_key)
        _remember(config, found, args, result)
        self.shell.user_ns[args.out] = result
        if not any(getattr(cb, "handle", None) for cb in callbacks):
            display(result)  # no dashboard showed the summary in its place
        return None

    def _sweep(self, args, line, cell, config):
        __tracebackhide__ = True  # noqa: F841
        from IPython.display import display

        from gpunb.notebook.busy import kernel_stays_busy
        from gpunb.notebook.sweep_cell import check_sweep_line, run_sweep_cell

        settings = check_sweep_line(args, cell, config)
        view = _sweep_view(self.shell, args, settings)
        with kernel_stays_busy(self.shell):
            sweep = run_sweep_cell(self.shell, args, line, cell, config, settings, view)
        self.shell.user_ns[args.out] = sweep.best_result if sweep.best_result is not None else sweep
        if view is not None:
            view.close(sweep)
        else:
            display(sweep)

    def _export(self, args, line, cell, config):
        from gpunb.notebook.export import export_script

        names = {role: getattr(args, f"{role}_name") for role in NAMES}
        path = export_script(args.export, cell, config, self.shell, names=names, options_line=line)
        print(f"Wrote {path}; run it with: torchrun --standalone --nproc-per-node <gpus> {path}")

    @magic_arguments()
    @argument("--json", action="store_true", help="print the raw snapshot as JSON")
    @line_magic
    def gpustatus(self, line):
        """The GPUs right now: name, utilisation, memory, power, temperature, processes.

        Without an NVIDIA GPU (or driver) it says so and shows the host's CPU and RAM.
        Reads NVML only: it never initialises CUDA in this kernel.
        """
        args = parse_argstring(self.gpustatus, line)
        from gpunb.notebook.status import Status

        status = Status.now()
        if args.json:
            print(status.json())
            return None
        return status


make_strict(GpuMagics.gputrain, prog="%gputrain")  # the usage line then reads %%gputrain
make_strict(GpuMagics.gpustatus)


def _config(args):
    """A TrainConfig from the options given (unset options keep TrainConfig's defaults); a cluster
    is checked against the backends' table before the cell runs."""
    from gpunb.config import TrainConfig
    from gpunb.config_flags import config_values
    from gpunb.jobs.backends.flags import cluster_values

    with usage_errors(args):  # also when called alone
        config = TrainConfig(**config_values(args), **cluster_values(args))
        if config.cluster is not None:
            from gpunb.jobs.backends import chosen

            chosen(config)
        return config


def _cell_key(cell: str, line: str) -> str:
    from gpunb.jobs.lookup import cell_key

    return cell_key(cell, line)


def _submit_only(shell, config, found, args, job_key):
    """--no-wait: submit (or find) the job and return; its JobResult says queued or running."""
    from IPython.display import display

    from gpunb.trainer import Trainer

    if config.cluster is None:
        raise UsageError("--no-wait returns while a job trains, and this run is not a job.\n"
                         "HINT: add `--detach` (a job on this machine) or `--cluster slurm`.")
    result = Trainer(config).submit(found["model"], found["train_data"], found["val_data"],
                                    optimizer=found["optimizer"], scheduler=found["scheduler"],
                                    loss_fn=found["loss_fn"], step=found["step"], metrics=found["metrics"],
                                    job_key=job_key)
    shell.user_ns[args.out] = result
    if not args.quiet:
        display(result)
    return None


def _remember(config, found, args, result) -> None:
    """Keep the variable names (not the objects) of a fit that ran, for `%gpuprofile --train`,
    and what `--continue` goes on from.

    Holding names lets the model and data be freed when the user deletes them. The continue
    state (the optimizer, the weight average) is held weakly too: it lives as long as the
    result does, so `del gputrain_result` frees its memory.
    """
    import weakref

    from gpunb.notebook import session

    names = {role: getattr(args, f"{role}_name") for role in SETUP if found[role] is not None}
    kept = weakref.ref(result.continue_state) if result.continue_state is not None else None
    session.LAST_TRAIN = session.LastTrain(config, names, kept)


def _progress_callbacks(shell, quiet: bool) -> list:
    """The live view this front end can show: widgets, HTML or a text line."""
    if quiet:
        return []
    from gpunb.notebook.frontends import live_view

    return live_view(_dashboard_mode(shell))


def _sweep_view(shell, args, settings):
    """The sweep's live view where a kernel can re-send it; None in a terminal or with --quiet."""
    if args.quiet or _dashboard_mode(shell) == "text":
        return None
    from gpunb.notebook.sweep_view import SweepView

    return SweepView(settings.trials, settings.monitor, settings.resolved_direction())


def _dashboard_mode(shell) -> str:
    from gpunb.notebook.frontends import dashboard_mode

    return dashboard_mode(shell)


def _find_lr(found, config):
    from gpunb.runtime.probes.lr_find import find_lr

    return find_lr(found["model"], found["train_data"], config=config, optimizer=found["optimizer"],
                   loss_fn=found["loss_fn"], step=found["step"])


def _evaluate(shell, found, config, args):
    from gpunb.notebook.cell_modes import evaluate_cell

    shell.user_ns[args.out] = evaluate_cell(found, config, args)


def _dry_run(shell, found, config, args):
    from gpunb.notebook.cell_modes import dry_run_cell

    shell.user_ns[args.out] = dry_run_cell(found, config)
