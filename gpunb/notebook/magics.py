"""%%gputrain and %gpustatus: thin magics over gpunb.Trainer and gpunb.telemetry."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from gpunb.errors import GpunbError
from gpunb.notebook.collect import collect, named_options
from gpunb.notebook.options import make_strict
from gpunb.notebook.session import continue_state as session_continue_state
from gpunb.runtime.roles import NAMES, REQUIRED, SETUP


@magics_class
class GpuMagics(Magics):
    @magic_arguments()
    @argument("--epochs", type=int, help="passes over train_data (default 1)")
    @argument("--max-steps", type=int, help="stop after this many optimizer steps")
    @argument("--batch-size", help="samples per device per step: an integer or 'auto'")
    @argument("--precision", help="auto (default), bf16-mixed, 16-mixed or 32")
    @argument("--devices", help="devices/processes to train on: an integer or 'all'")
    @argument("--accelerator", help="auto (default), cuda, mps or cpu")
    @argument("--strategy", help="with several devices: ddp (default) or fsdp")
    @argument("--backend", help="with several devices: auto (default: nccl between GPUs), nccl or gloo "
                                "(gloo may put several processes on one GPU)")
    @argument("--grad-accum", type=int, help="micro-batches accumulated per optimizer step")
    @argument("--clip", type=float, help="clip the gradient norm to this value")
    @argument("--lr", type=float, help="learning rate of the default AdamW (or of your optimizer)")
    @argument("--lr-schedule", help="none (default), one-cycle or cosine")
    @argument("--warmup-steps", type=int, help="linear warmup steps for the cosine schedule")
    @argument("--min-lr-ratio", type=float, help="the cosine schedule ends at lr times this (e.g. 0.1; default 0)")
    @argument("--ema", type=float, help="average the weights with this decay (e.g. 0.999); validation uses the average")
    @argument("--ema-apply", action="store_true", help="load the averaged weights into the model at the end")
    @argument("--merge-adapters", action="store_true",
              help="a peft (LoRA) model: merge the adapters into the base at the end (result.model)")
    @argument("--continue", dest="continue_fit", action="store_true",
              help="go on from the last %%%%gputrain of this model: its optimizer, schedule, step count, history")
    @argument("--compile", nargs="?", const="on",
              help="torch.compile: auto (default: on one GPU, once timing shows it pays), on, off, "
                   "reduce-overhead (CUDA graphs), max-autotune or step-graph (the whole step as one CUDA graph)")
    @argument("--checkpointing", action="store_true", help="activation checkpointing (saves memory)")
    @argument("--memory-budget", help="memory the run may use, e.g. 24GiB (default: the device's free memory)")
    @argument("--no-memory-plan", action="store_true",
              help="take no memory-saving measure on gpunb's own (checkpointing, 8-bit states, ...)")
    @argument("--optimizer-states", help="auto (default), full, 8bit (torchao) or cpu (on the host)")
    @argument("--checkpoint-dir", help="write checkpoints here")
    @argument("--checkpoint-every", type=int, help="optimizer steps between checkpoints (default: each epoch)")
    @argument("--resume", nargs="?", const="last", help="resume from a checkpoint path, 'best', or the last one")
    @argument("--save-top-k", type=int, help="also keep the k best checkpoints by --monitor")
    @argument("--monitor", help="validation metric ranking the best checkpoints (default val_loss)")
    @argument("--mode", help="min or max (default: max for acc/f1/auroc/precision/recall..., else min)")
    @argument("--restore-best", action="store_true", help="load the best checkpoint's weights at the end")
    @argument("--val-every-steps", type=int, help="validate every N optimizer steps instead of each epoch")
    @argument("--seed", type=int, help="seed for python, numpy and torch (default 0)")
    @argument("--log-every", help="steps between metric reads, or 'auto' (default: ~100 a run, >= 1 an epoch)")
    @argument("--num-workers", help="DataLoader workers: an integer or 'auto'")
    @argument("--name", help="run name for the dashboard and the run registry")
    @argument("--log", help="loggers, comma-separated: csv, tensorboard, mlflow, wandb")
    @argument("--log-dir", help="where loggers write (default: <checkpoint-dir>/logs, else ./gpunb_logs)")
    @argument("--out", default="gputrain_result", help="variable that receives the TrainResult")
    @argument("--quiet", action="store_true", help="no live dashboard; only the final summary")
    @argument("--no-track", action="store_true", help="do not record the run in the run registry")
    @argument("--find-lr", action="store_true", help="run a learning-rate range test instead of training")
    @argument("--export", metavar="PATH", help="write a standalone torchrun script instead of training")
    @argument("--eval", action="store_true", help="evaluate the model on val_data (or train_data) instead of training")
    @argument("--dry-run", action="store_true", help="show the run's summary (parameters, FLOPs, memory) without training")
    @argument("--model", dest="model_name", default="model", help="variable holding the model")
    @argument("--train-data", dest="train_data_name", default="train_data", help="variable holding the data")
    @argument("--val-data", dest="val_data_name", default="val_data")
    @argument("--optimizer", dest="optimizer_name", default="optimizer")
    @argument("--scheduler", dest="scheduler_name", default="scheduler")
    @argument("--loss-fn", dest="loss_fn_name", default="loss_fn")
    @argument("--step", dest="step_name", default="step")
    @argument("--metrics", dest="metrics_name", default="metrics")
    @argument("--callbacks", dest="callbacks_name", default="callbacks")
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
        return self._train(config, found, args)

    def _train(self, config, found, args):
        __tracebackhide__ = True  # noqa: F841
        from IPython.display import display

        from gpunb.notebook.busy import kernel_stays_busy
        from gpunb.trainer import Trainer

        callbacks = [*found["callbacks"], *_progress_callbacks(self.shell, args.quiet)]
        previous = session_continue_state() if args.continue_fit else None
        try:
            with kernel_stays_busy(self.shell):  # the dashboard's widgets must not read "Idle"
                result = Trainer(config).fit(
                    found["model"], found["train_data"], found["val_data"], optimizer=found["optimizer"],
                    scheduler=found["scheduler"], loss_fn=found["loss_fn"], step=found["step"],
                    metrics=found["metrics"], callbacks=callbacks, continue_from=previous)
        except GpunbError as error:
            raise UsageError(str(error)) from None
        _remember(config, found, args, result)
        self.shell.user_ns[args.out] = result
        if not any(getattr(cb, "handle", None) for cb in callbacks):
            display(result)  # no dashboard showed the summary in its place
        return None

    def _export(self, args, line, cell, config):
        from gpunb.notebook.export import export_script

        names = {role: getattr(args, f"{role}_name") for role in NAMES}
        try:
            path = export_script(args.export, cell, config, self.shell, names=names, options_line=line)
        except GpunbError as error:
            raise UsageError(str(error)) from None
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
    """A TrainConfig from the options given (unset options keep TrainConfig's defaults)."""
    from gpunb.config import TrainConfig

    fields = {
        "epochs": args.epochs, "max_steps": args.max_steps, "batch_size": args.batch_size,
        "precision": args.precision, "devices": _int_or(args.devices, "devices"),
        "accelerator": args.accelerator, "strategy": args.strategy, "backend": args.backend,
        "grad_accum": args.grad_accum, "clip_grad_norm": args.clip, "lr": args.lr, "lr_schedule": args.lr_schedule,
        "warmup_steps": args.warmup_steps, "ema": args.ema, "checkpoint_dir": args.checkpoint_dir,
        "min_lr_ratio": args.min_lr_ratio,
        "checkpoint_every": args.checkpoint_every, "resume": args.resume, "seed": args.seed,
        "log_every": _int_or(args.log_every, "log_every"), "num_workers": _int_or(args.num_workers, "num_workers"),
        "name": args.name, "save_top_k": args.save_top_k, "monitor": args.monitor, "mode": args.mode,
        "val_every_steps": args.val_every_steps, "compile": args.compile,
        "loggers": args.log, "log_dir": args.log_dir,
        "memory_budget": args.memory_budget, "optimizer_states": args.optimizer_states,
    }
    chosen = {k: v for k, v in fields.items() if v is not None}
    chosen.update({k: True for k, flag in (("activation_checkpointing", args.checkpointing),
                                            ("ema_apply", args.ema_apply),
                                            ("merge_adapters", args.merge_adapters),
                                            ("restore_best", args.restore_best)) if flag})
    if args.no_track:
        chosen["track"] = False
    if args.no_memory_plan:
        chosen["memory_plan"] = False
    try:
        return TrainConfig(**chosen)
    except GpunbError as error:
        raise UsageError(_as_option_hint(str(error))) from None


def _int_or(value, name):
    if value is None or not value.strip().lstrip("-").isdigit():
        return value
    return int(value)


def _as_option_hint(message: str) -> str:
    """Config errors speak of `field=value`; in a magic the fix is `--field value`."""
    import re

    return re.sub(r"`(\w+)=([^`]*)`", lambda m: f"`--{m.group(1).replace('_', '-')} "
                  f"{m.group(2).strip(chr(39))}`", message)


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


def _dashboard_mode(shell) -> str:
    from gpunb.notebook.frontends import dashboard_mode

    try:
        return dashboard_mode(shell)
    except GpunbError as error:
        raise UsageError(str(error)) from None


def _find_lr(found, config):
    from gpunb.runtime.probes.lr_find import find_lr

    try:
        return find_lr(found["model"], found["train_data"], config=config, optimizer=found["optimizer"],
                       loss_fn=found["loss_fn"], step=found["step"])
    except GpunbError as error:
        raise UsageError(str(error)) from None


def _evaluate(shell, found, config, args):
    from gpunb.notebook.cell_modes import evaluate_cell

    try:
        shell.user_ns[args.out] = evaluate_cell(found, config, args)
    except GpunbError as error:
        raise UsageError(str(error)) from None


def _dry_run(shell, found, config, args):
    from gpunb.notebook.cell_modes import dry_run_cell

    try:
        shell.user_ns[args.out] = dry_run_cell(found, config)
    except GpunbError as error:
        raise UsageError(str(error)) from None
