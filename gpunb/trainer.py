"""gpunb.Trainer: the front door. It decides where a fit runs, then hands it on.

    one process          runtime.loop.run with the runtime's LocalContext
    devices > 1          distributed.launch starts one process per device; each runs `_rank_entry`
    inside a group       (torchrun, or a rank the launcher started) distributed.context joins it
    cluster="local"|...  jobs.submit runs it as a job through the cluster's backend and follows it from here

It also composes the default callbacks (telemetry, the run registry). A one-process
run imports nothing from gpunb.distributed, so nothing of the launcher or cloudpickle.
"""

from __future__ import annotations

import os

from gpunb.config import TrainConfig, make_config
from gpunb.runtime.adapters import check_adapters, merge_adapters
from gpunb.runtime.context import LocalContext
from gpunb.runtime.loop import run
from gpunb.runtime.placement import ALONE
from gpunb.runtime.result import TrainResult
from gpunb.runtime.roles import check_kinds


class Trainer:
    """Trains a plain PyTorch model with the managed runtime.

    >>> result = Trainer(epochs=3, precision="auto").fit(model, (x, y), loss_fn=nn.CrossEntropyLoss())

    `config` is a TrainConfig; keyword overrides are applied on top of it.

    With `devices=N` (or "all") fit starts one process per device and trains under
    DDP, or sharded with FSDP when only the sharded memory estimate fits (`strategy="auto"`;
    "ddp" or "fsdp" to choose); each process reads its own share of the data.
    `batch_size` is per device, so an optimizer step sees batch_size x grad_accum x N
    samples. The learning rate is never scaled for you: when moving from one device to
    N, raise `lr` yourself if the larger batch calls for it. Under torchrun (or any
    initialised process group) fit joins the group instead of starting processes.

    `loggers=["tensorboard", "csv"]` (or logger objects from gpunb.loggers) write the run
    from rank 0; `metrics=` takes functions and torchmetrics metrics.

    With `cluster="local"` the fit runs as a job of its own on this machine, which outlives
    the kernel; with `cluster="slurm"` (and `nodes`, `gpus_per_node`, `slurm={...}`) as a Slurm
    job. fit follows the job (the same callbacks hear its events) and loads its weights into
    `model` at the end; a named run finds its job again instead of submitting twice
    (`resubmit=True` submits anew), and `gpunb.attach(name)` follows it from any kernel.
    """

    def __init__(self, config: TrainConfig | None = None, **overrides):
        self.config = make_config(config, **overrides)
        if self.config.cluster is not None:
            from gpunb.jobs.backends import chosen

            chosen(self.config)  # an unknown cluster, or nodes it cannot give, is refused before any work

    def fit(self, model, train_data, val_data=None, *, optimizer=None, scheduler=None, loss_fn=None, step=None,
            metrics=None, callbacks=(), continue_from=None, state_type=None, job_key=None) -> TrainResult:
        """Train `model` on `train_data`; returns a TrainResult. The model is trained in place.

        `scheduler`: a torch LR scheduler on `optimizer`, a factory `f(optimizer, total_steps)`,
        or `{"scheduler": ..., "interval": "epoch"}` (stepped per optimizer step by default;
        ReduceLROnPlateau with `"monitor"` at each validation). `continue_from`: the result of
        an earlier fit of this model, to go on with its optimizer, schedule and step count;
        `epochs` / `max_steps` then count the steps added. `state_type`: a subclass of
        gpunb.runtime.run_state.RunState with fields of your own (a curriculum's level, a data
        cursor): they are checkpointed, resumed, continued and relayed from the ranks as gpunb's are.

        `step(model, batch)`: computes the loss itself; it returns the loss, `(loss, output)` or
        `{"loss": loss, "output": output, "target": target}` (no "target": the batch's labels or
        last item), and `metrics` score the output against the target.

        `job_key`: with a `cluster`, what finds this run's job again (the magic passes the cell's
        hash); None: the run's name and config, when it has a name.
        """
        __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
        check_kinds(dict(model=model, optimizer=optimizer, loss_fn=loss_fn, step=step))  # the schedule: when built
        config = self.config
        check_adapters(model, config)  # quantized layers without bitsandbytes, merge_adapters without adapters
        arguments = dict(optimizer=optimizer, scheduler=scheduler, loss_fn=loss_fn, step=step, metrics=metrics,
                         state_type=state_type)
        if config.cluster is not None:
            return self._job(model, train_data, val_data, callbacks, continue_from, job_key, True, **arguments)
        if continue_from is not None:  # checked here too: a launch would start processes first
            from gpunb.runtime.state.continuing import continue_state_of

            continue_state_of(continue_from, model, config, world_size=1)
            arguments["continue_from"] = continue_from
        loggers = _loggers(config)  # a missing package fails here, before any work
        if config.devices != 1 and not _in_process_group():
            from gpunb.distributed import launch

            if launch.needs_processes(config):
                # One process per device; this one drives them: the registry and the loggers write here.
                parent = [*_registry_callbacks(config), *callbacks, *loggers]
                result = launch.fit(config, _rank_entry, model, train_data, val_data, callbacks=parent, **arguments)
                return _finished(result, model, config, loss_fn=loss_fn, step=step, metrics=metrics)
        context = LocalContext()
        if _in_process_group():
            from gpunb.distributed.context import current_context

            context = current_context(config)  # joins torchrun's group when it is not joined yet
        if context.rank == 0:
            callbacks = [*callbacks, *loggers]  # last: they see what the others noted (a profile trace)
        result = _rank_entry(config, context, model, train_data, val_data, callbacks=callbacks, **arguments)
        return _finished(result, model, config, loss_fn=loss_fn, step=step, metrics=metrics)

    def submit(self, model, train_data, val_data=None, *, optimizer=None, scheduler=None, loss_fn=None,
               step=None, metrics=None, job_key=None):
        """With a `cluster`: submit the fit as a job (or find this run's job) and return at once; the
        JobResult's `status` says queued or running, and `gpunb.attach(name)` follows it later."""
        __tracebackhide__ = True  # noqa: F841
        check_kinds(dict(model=model, optimizer=optimizer, loss_fn=loss_fn, step=step))
        if self.config.cluster is None:
            from gpunb.errors import GpunbError

            raise GpunbError("submit() sends the fit to a cluster, and this Trainer has none.",
                             "pass `cluster='local'` (a detached job on this machine) or `cluster='slurm'`.")
        return self._job(model, train_data, val_data, (), None, job_key, False, optimizer=optimizer,
                         scheduler=scheduler, loss_fn=loss_fn, step=step, metrics=metrics)

    def _job(self, model, train_data, val_data, callbacks, continue_from, job_key, wait, **arguments):
        from gpunb.jobs.submit import run_job

        config = self.config
        if job_key is None and config.name:
            import hashlib
            import json

            settings = {k: v for k, v in config.to_dict().items() if k != "resubmit"}
            job_key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:24]
        _loggers(config)  # a missing package fails here, before the job is submitted
        result = run_job(config, _rank_entry, model, train_data, val_data, callbacks=callbacks, key=job_key,
                         wait=wait, continue_from=continue_from, **arguments)
        return result.attach(model, loss_fn=arguments["loss_fn"], step=arguments["step"],
                             metrics=arguments["metrics"], transforms=config.transforms)

    def summary(self, model, train_data, val_data=None, *, optimizer=None, loss_fn=None, step=None,
                metrics=None):
        """What fit would train and need, without training: parameters (trainable / frozen),
        FLOPs per sample, memory (weights, gradients, optimizer state, activations at the batch
        size) against free memory. One forward + backward, undone: no optimizer step, no
        checkpoint, no registry run. Returns a RunSummary (in one process: this device's view)."""
        __tracebackhide__ = True  # noqa: F841
        from gpunb.runtime.loop import dry_run

        check_kinds(dict(model=model, optimizer=optimizer, loss_fn=loss_fn, step=step))
        return dry_run(self.config, LocalContext(), model, train_data, val_data, optimizer=optimizer,
                       loss_fn=loss_fn, step=step, metrics=metrics)

    dry_run = summary

    def sweep(self, build, trials: int, *, monitor: str | None = None, direction: str | None = None,
              sampler: str = "tpe", prune: str = "none", seed: int | None = None, name: str | None = None,
              on_trial=None, callbacks=(), parallel: int = 1, key: str | None = None):
        """Run `trials` fits with hyperparameters an Optuna study samples; returns a SweepResult.

        `build(trial)` returns fit's arguments (`model`, `train_data`, `val_data`, `loss_fn`, ...),
        built afresh for that trial: inside it, `gpunb.suggest("lr", 1e-4, 1e-1, log=True)` (or
        the Optuna trial's own `suggest_*`) gives the trial's value. Each trial's value is
        `monitor` (default: the config's, else "val_loss") of the weights it ends with (with
        `restore_best`: of its best); `prune="asha"|"median"` stops poor trials at a validation.
        `result.best_model` is the best trial's trained model, `result.table` has one row per trial;
        `on_trial(row)` is called as each trial ends; `callbacks` hear every trial's fit (as jobs:
        its relayed events), and their `trial_started(row)`, where they have one, as it starts.

        With `parallel=K` (or a `cluster`) each trial is a job (`cluster="local"` unless the config
        names one), K at a time, followed and pruned from here; the same sweep run again (after a
        kernel restart) follows the jobs of the trials it left running. Without a `name` (nor the
        config's), the sweep is named after `key` (default: build's source) and these settings, so
        the same sweep run again finds its own while it is unfinished; a finished one is left as it is.
        A trial that fails is recorded failed and the sweep goes on (docs/sweeps.md: Faults).
        """
        __tracebackhide__ = True  # noqa: F841
        from gpunb.sweeps import SweepSettings, run_sweep

        settings = SweepSettings(trials, sampler=sampler, prune=prune, direction=direction, seed=seed,
                                 monitor=monitor or self.config.monitor or "val_loss").check()
        if not isinstance(parallel, int) or parallel < 1:
            from gpunb.errors import GpunbError

            raise GpunbError(f"parallel is how many trials run at once, at least 1; got {parallel!r}.",
                             "e.g. `parallel=2` (`--parallel 2`).")
        as_jobs = parallel > 1 or self.config.cluster is not None
        registry = None
        if self.config.track:
            from gpunb.runs import Registry

            registry = Registry()  # where the trials are recorded, and a stop of the whole sweep is asked
        return run_sweep(build, self._trial_fit, settings, name=name or self.config.name, on_trial=on_trial,
                         watch=callbacks, parallel=parallel, start=self._trial_job if as_jobs else None, key=key,
                         registry=registry, packer=self._packer() if as_jobs else None)

    def _packer(self):
        """Trials on this machine share its GPUs by their memory estimate; a cluster's are placed by it."""
        from gpunb.jobs import backends

        if not backends.get(self.config.cluster or "local").on_this_machine:
            return None
        from gpunb.sweeps.packing import Packer

        return Packer(self.config)

    def _trial_job(self, arguments: dict, callbacks: list, trial_name: str, key: str, sweep: dict | None = None,
                   visible: str | None = None):
        """One trial of a sweep as a job (this machine's unless the config names a cluster): its Follower.
        `sweep`: the trial's tag (sweeps/control.py), which its registry row keeps; `visible`: the GPUs
        the trial's packing gave it (CUDA_VISIBLE_DEVICES)."""
        from gpunb.jobs.submit import job_follower

        config = Trainer(self.config, name=trial_name, cluster=self.config.cluster or "local", sweep=sweep).config
        arguments = dict(arguments)
        model, train_data = arguments.pop("model"), arguments.pop("train_data")
        callbacks = [*arguments.pop("callbacks", ()), *callbacks]
        check_kinds(dict(model=model, optimizer=arguments.get("optimizer"), loss_fn=arguments.get("loss_fn"),
                         step=arguments.get("step")))
        _loggers(config)  # a missing package fails here, before the job is submitted
        return job_follower(config, _rank_entry, model, train_data, callbacks=callbacks, key=key, visible=visible,
                            **arguments)

    def _trial_fit(self, arguments: dict, callbacks: list, trial_name: str, sweep: dict | None = None) -> TrainResult:
        """One trial of a sweep: an ordinary fit under the trial's name, with the sweep's callbacks, its
        config tagged with the trial (`sweep`, which its registry row keeps)."""
        arguments = dict(arguments)
        model, train_data = arguments.pop("model"), arguments.pop("train_data")
        callbacks = [*arguments.pop("callbacks", ()), *callbacks]
        return Trainer(self.config, name=trial_name, sweep=sweep).fit(model, train_data, callbacks=callbacks,
                                                                      **arguments)


def _finished(result, model, config, **objective) -> TrainResult:
    """The result, ready for predict and evaluate; with merge_adapters, the adapters merged."""
    if config.merge_adapters:
        merge_adapters(result, model)
    return result.attach(result.model or model, transforms=config.transforms, **objective)


def _rank_entry(config, context, model, train_data, val_data=None, *, callbacks=(), placement=ALONE,
                **arguments) -> TrainResult:
    """One process's fit (alone, or one rank of a group): the defaults, then the runtime's loop.
    Top-level, so that the launcher can hand it to spawned ranks; `placement`: how the launcher or
    a job placed this process (runtime/placement.py)."""
    __tracebackhide__ = True  # noqa: F841
    defaults = _default_callbacks(config, context, placement)
    return run(config, context, model, train_data, val_data, callbacks=[*defaults, *callbacks], placement=placement,
               **arguments)


def _in_process_group() -> bool:
    """Under torchrun (its environment) or inside an initialised torch.distributed group."""
    if "WORLD_SIZE" in os.environ:
        return True
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _default_callbacks(config, context, placement=ALONE) -> list:
    """Telemetry, and the run registry on rank 0 when this process records its run (a launched
    rank's or a job's run is recorded by its launcher or its job), when their packages are there."""
    found = []
    try:
        from gpunb.telemetry import TelemetryCallback

        found.append(TelemetryCallback())
    except ImportError:
        pass
    if context.rank == 0 and placement.records:
        found.extend(_registry_callbacks(config))
    return found


def _loggers(config) -> list:
    if not config.loggers:
        return []
    from gpunb.loggers import make_loggers

    return make_loggers(config)


def _registry_callbacks(config) -> list:
    if not config.track:
        return []
    try:
        from gpunb.runs import RunRecorder
    except ImportError:
        return []
    return [RunRecorder()]
