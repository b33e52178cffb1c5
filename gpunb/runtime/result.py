"""TrainResult: what a run did, as fields; gpunb.render shows it to people (HTML, text, plot)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainResult:
    run_name: str
    history: list = field(default_factory=list)  # per log interval: step, epoch, loss (the interval's mean), lr, ...
    epochs: list = field(default_factory=list)  # per epoch: epoch, step, train_loss (the epoch's mean), val_*, elapsed_s
    validations: list = field(default_factory=list)  # per validation pass: step, epoch, val_*, elapsed_s
    final_metrics: dict = field(default_factory=dict)  # train_loss of the last epoch, the last val_* metrics
    config: dict = field(default_factory=dict)  # the config actually used
    device: str = "cpu"
    precision: str = "32"
    precision_reason: str = ""
    batch_size: int = 0  # samples per micro-batch as loaded
    batch_size_reason: str = ""  # how batch_size="auto" chose it ("" when it was given)
    micro_batch_size: int = 0  # after OOM recovery (== batch_size when none happened)
    grad_accum: int = 1  # loaded batches per optimizer step
    world_size: int = 1
    strategy: str | None = None  # devices > 1: "ddp" or "fsdp" (strategy="auto" resolved); None: one process
    strategy_reason: str = ""  # "asked for", or under "auto" why: the memory estimate's numbers when it shards
    steps: int = 0
    start_step: int = 0  # the step this fit began at (> 0 when it resumed or continued a run)
    total_steps: int | None = None  # optimizer steps the run was set to take, when known
    samples: int = 0  # over the whole run, a resumed or continued one's earlier fits included
    start_samples: int = 0  # of those, seen before this fit began
    wall_time_s: float = 0.0  # this fit's
    data_wait_s: float = 0.0  # host time spent waiting for the next batch
    compute_s: float = 0.0  # the rest of the training loop (steps, logging)
    validation_s: float = 0.0
    peak_memory_mb: float | None = None  # accelerator memory; None on CPU
    oom_recoveries: int = 0
    memory_plan: str = ""  # the memory plan's measures and any taken after an OOM ("" when none)
    skipped_steps: int = 0  # fp16 steps skipped by the GradScaler (inf/NaN gradients)
    checkpoint_path: str | None = None
    best_checkpoint: str | None = None  # the best of the save_top_k checkpoints by best_monitor
    best_monitor: str | None = None
    best_value: float | None = None
    best_step: int | None = None
    restored_best: bool = False  # restore_best: the model holds the best checkpoint's weights
    log_dir: str | None = None  # where the run's loggers wrote (set by them at the end)
    resumed_from: dict | None = None  # path, run, step, epoch, saved_at of the checkpoint resumed
    interrupted: bool = False
    stop_reason: str | None = None
    energy_j: float | None = None  # GPU energy over the run (NVIDIA only)
    peak_tflops: float | None = None  # the device's dense peak for the precision used; None: unknown (CPU)
    per_rank: list = field(default_factory=list)  # timings of each rank in multi-process runs
    # torch.compile in this run: requested, mode (None: eager), at_step, compile_s, speedup,
    # eager_step_ms, compiled_step_ms, reason (see runtime/step/compiling.py)
    compilation: dict | None = None
    summary: object = None  # RunSummary: parameters, FLOPs, memory, measured before the first step
    # with `ema`: the averaged weights on the CPU, keyed like model.state_dict() (`model.load_state_dict(...)`;
    # a model with frozen parameters: what trains, `strict=False`)
    ema_state_dict: dict | None = field(default=None, repr=False)
    # with merge_adapters: the base model with the trained adapters merged into its weights (peft's
    # merge_and_unload); the fitted peft model wraps it still
    model: object = field(default=None, repr=False)
    # what `fit(..., continue_from=result)` goes on from (optimizer, schedule, step; one-process
    # fits); it keeps the optimizer state alive: set it to None to free that memory
    continue_state: object = field(default=None, repr=False)

    # a sweep's best trial: the sweep (gpunb.sweeps.result.SweepResult: every trial, the study)
    sweep: object = field(default=None, repr=False)
    batch_probe: tuple = field(default=(), repr=False)  # batch_size="auto": what each probed size did

    @classmethod
    def from_state(cls, state, **figures) -> "TrainResult":
        """The result of the fit whose RunState (runtime/run_state.py) is `state`; `figures`: what
        the loop measured beside it (timings, memory, compilation, ...)."""
        from gpunb.runtime.probes.summary import RunSummary

        plan, final = state.plan, last_epoch_train_loss(state.history)  # also when stopped within that epoch
        if state.validations:
            final.update({k: v for k, v in state.validations[-1].items() if k.startswith("val_")})
        resolved = state.settings()
        fields = dict(
            run_name=state.run_name, history=list(state.history), epochs=list(state.epochs),
            validations=list(state.validations), final_metrics=final, config=resolved, device=str(state.device),
            grad_accum=state.config.grad_accum, world_size=state.world_size, steps=state.step,
            start_step=state.start_step, start_samples=state.start_samples, total_steps=state.total_steps,
            samples=state.samples_seen, peak_tflops=state.peak_tflops, checkpoint_path=state.checkpoint_path,
            resumed_from=state.resumed, interrupted=state.stop_reason == "interrupted",
            stop_reason=state.stop_reason,
            summary=RunSummary.from_plain(state.summary) if state.summary is not None else None)
        if plan is not None:
            fields.update(precision=plan.precision, precision_reason=plan.precision_reason,
                          batch_size=plan.batch_size, batch_size_reason=plan.batch_size_reason,
                          micro_batch_size=plan.batch_size, batch_probe=plan.batch_probe,
                          strategy=plan.strategy, strategy_reason=plan.strategy_reason)
        elif isinstance(state.config.batch_size, int):  # a launch that ended before rank 0 set up
            fields.update(batch_size=state.config.batch_size)
        return cls(**{**fields, **figures})

    @property
    def trainable_params(self) -> int | None:
        """Parameters that trained (a LoRA model: its adapters); None without a summary."""
        return getattr(self.summary, "trainable_params", None)

    @property
    def frozen_params(self) -> int | None:
        """Parameters left as they were (`requires_grad=False`: a LoRA model's base)."""
        return getattr(self.summary, "frozen_params", None)

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step across all devices."""
        return self.batch_size * self.grad_accum * self.world_size

    @property
    def samples_per_s(self) -> float:
        """This fit's samples over this fit's wall time."""
        return (self.samples - self.start_samples) / self.wall_time_s if self.wall_time_s else 0.0

    @property
    def train_s(self) -> float:
        """Seconds of training: wall time less validation (data waits count: they slow the steps)."""
        return max(0.0, self.wall_time_s - self.validation_s)

    @property
    def _steps_here(self) -> int:
        """Optimizer steps this fit took: the step counter of a resumed or continued run starts above 0."""
        return self.steps - self.start_step

    @property
    def flops_per_step(self) -> int | None:
        """FLOPs of one optimizer step on all devices: the summary's forward + backward FLOPs per
        sample x samples per step; None when they were not counted (a custom step, FSDP)."""
        per_sample = getattr(self.summary, "train_flops", None)
        return None if per_sample is None else per_sample * self.effective_batch_size

    @property
    def achieved_tflops(self) -> float | None:
        """Model FLOPs per second over the training time (train_s), in TFLOPS."""
        per_step = self.flops_per_step
        if per_step is None or not self.train_s:
            return None
        return per_step * self._steps_here / self.train_s / 1e12

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: achieved_tflops / the device's dense peak (0..1); None when unknown."""
        achieved = self.achieved_tflops
        return None if achieved is None or not self.peak_tflops else achieved / self.peak_tflops

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second over the training time when the inputs are token ids (B, T); else None."""
        per_sample = getattr(self.summary, "tokens_per_sample", None)
        if per_sample is None or not self.train_s:
            return None
        return per_sample * self.effective_batch_size * self._steps_here / self.train_s

    @property
    def energy_wh(self) -> float | None:
        return None if self.energy_j is None else self.energy_j / 3600

    @property
    def joules_per_sample(self) -> float | None:
        return None if self.energy_j is None or not self.samples else self.energy_j / self.samples

    @property
    def status(self) -> str:
        if self.interrupted:
            return "interrupted"
        return "stopped" if self.stop_reason else "completed"

    def loss_series(self) -> dict:
        series = {"train": [(row["step"], row["loss"]) for row in self.history if "loss" in row]}
        val = [(row["step"], row["val_loss"]) for row in self.validations or self.epochs if "val_loss" in row]
        if val:
            series["val"] = val
        return series

    def attach(self, model, **fit_arguments) -> "TrainResult":
        """Point at the trained model and keep fit's loss_fn/step/metrics/transforms for predict
        and evaluate (an attribute, not a field: never saved, shipped or compared). The model
        is held weakly: deleting it in the notebook frees it."""
        import weakref

        self._fitted = (weakref.ref(model), fit_arguments)
        return self

    def __getstate__(self) -> dict:
        # The model and what a continued fit goes on from (optimizer, schedule) stay here.
        state = {k: v for k, v in self.__dict__.items() if k != "_fitted"}
        state["continue_state"] = state["model"] = None
        return state

    def predict(self, data, **overrides):
        """gpunb.predict with this run's model, device, precision and batch size."""
        from gpunb.runtime.predict import predict

        model, fit_arguments = self._fitted_or_error("predict")
        return predict(model, data, **{**self._feeding(fit_arguments), **overrides})

    def evaluate(self, data, **overrides) -> dict:
        """gpunb.evaluate with this run's model, loss, metrics, device, precision and batch size."""
        from gpunb.runtime.predict import evaluate

        model, fit_arguments = self._fitted_or_error("evaluate")
        chosen = {k: fit_arguments.get(k) for k in ("loss_fn", "step", "metrics")}
        return evaluate(model, data, **{**chosen, **self._feeding(fit_arguments), **overrides})

    def _feeding(self, fit_arguments) -> dict:
        return {"batch_size": self.batch_size, "precision": self.precision,
                "accelerator": self.device.split(":")[0], "transforms": fit_arguments.get("transforms", ())}

    def _fitted_or_error(self, what: str):
        fitted = getattr(self, "_fitted", None)
        if fitted is None:
            from gpunb.errors import GpunbError

            raise GpunbError(f"This TrainResult holds no model to {what} with (it was not returned by "
                             "Trainer.fit or %%gputrain in this process).",
                             f"call `gpunb.{what}(model, data)` with the model itself.")
        model = fitted[0]()
        if model is None:
            from gpunb.errors import GpunbError

            raise GpunbError(f"The model this run trained has been deleted, so the result cannot {what}.",
                             f"keep a reference to the model, or call `gpunb.{what}(model, data)` with one.")
        return model, fitted[1]

    # Display lives in gpunb.render (imported lazily): the result renders without %load_ext.
    def __repr__(self) -> str:
        from gpunb.render import result_text

        return result_text(self)

    def _repr_html_(self) -> str:
        from gpunb.render import result_html

        return result_html(self)

    def plot(self, ax=None):
        """Loss curves with matplotlib; returns the Axes."""
        from gpunb.render import plot_losses

        return plot_losses(self, ax)


def epoch_mean_loss(rows: list) -> float:
    """`train_loss`: the mean step loss over an epoch's log rows (each the mean of its interval)."""
    return sum(r["loss"] * r["steps"] for r in rows) / sum(r["steps"] for r in rows)


def last_epoch_train_loss(history: list) -> dict:
    """{"train_loss": the mean over the last epoch's log rows}, or {} before the first log."""
    if not history:
        return {}
    last = history[-1]["epoch"]
    return {"train_loss": epoch_mean_loss([row for row in history if row["epoch"] == last])}
