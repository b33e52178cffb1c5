"""TrainConfig: every knob of a training run, in one dataclass.

String shorthands ("bf16", "auto", "one-cycle", ...) are parsed here and nowhere
else, so the runtime only ever sees canonical values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

from gpunb.errors import GpunbError

PRECISIONS = ("auto", "bf16-mixed", "16-mixed", "32")
_PRECISION_ALIASES = {
    "bf16": "bf16-mixed", "bfloat16": "bf16-mixed", "bf16-mixed": "bf16-mixed",
    "16": "16-mixed", "fp16": "16-mixed", "float16": "16-mixed", "16-mixed": "16-mixed",
    "32": "32", "fp32": "32", "float32": "32", "32-true": "32",
    "auto": "auto",
}
LR_SCHEDULES = ("none", "one-cycle", "cosine")
_COMPILE_ALIASES = {"auto": "auto", "true": True, "on": True, "default": True, "false": False,
                    "off": False, "eager": False, "reduce-overhead": "reduce-overhead",
                    "cuda-graphs": "reduce-overhead", "cudagraphs": "reduce-overhead",
                    "max-autotune": "max-autotune", "step-graph": "step-graph"}
_SCHEDULE_ALIASES = {"none": "none", "constant": "none", "one-cycle": "one-cycle",
                     "onecycle": "one-cycle", "cosine": "cosine"}
LOGGERS = ("csv", "tensorboard", "mlflow", "wandb")
_LOGGER_ALIASES = {name: name for name in LOGGERS} | {"tb": "tensorboard", "w&b": "wandb"}
ACCELERATORS = ("auto", "cuda", "mps", "cpu")
STRATEGIES = ("auto", "ddp", "fsdp")
OPTIMIZER_STATES = ("auto", "full", "8bit", "cpu")
BACKENDS = ("auto", "nccl", "gloo")
LOG_POINTS = 100  # log_every="auto" aims at about this many log points a run
FALLBACK_LOG_EVERY = 50  # log_every="auto" when the run's length is unknown


def setting(default: Any = None, help: str = "", *, section: str | None = None, factory=None):
    """A TrainConfig field with its help: the one text for readers of this file, `%%gputrain?`
    and the exported script's `--help`. `section` starts a group of fields (it holds until
    the next field that names one)."""
    metadata = {"help": help, "section": section}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    """Every setting of a run. Build it with keywords; strings are parsed on creation."""

    epochs: int | None = setting(None, "passes over train_data; None: 1, or as many as max_steps needs",
                                 section="how long")
    max_steps: int | None = setting(None, "stop after this many optimizer steps")
    batch_size: Union[int, str] = setting(64, "samples per device per micro-batch, or \"auto\"; an optimizer "
                                              "step sees batch_size x grad_accum x devices", section="batching")
    grad_accum: int = setting(1, "micro-batches accumulated per optimizer step")
    shuffle: bool = setting(True, "reshuffle the training data every epoch")
    drop_last: bool = setting(False, "drop a final partial batch")
    accelerator: str = setting("auto", "\"auto\" (cuda > mps > cpu), \"cuda\", \"mps\" or \"cpu\"", section="hardware")
    devices: Union[int, str] = setting(1, "processes/devices to train on, or \"all\"")
    strategy: str = setting("auto", "with devices > 1: \"auto\" (DDP, or FSDP when the memory estimate fits "
                                    "only sharded), \"ddp\" (replicate) or \"fsdp\" (shard)")
    backend: str = setting("auto", "how the processes talk: \"auto\" (NCCL between GPUs, gloo between CPU "
                                   "processes), \"nccl\" or \"gloo\"; under \"gloo\" there may be more processes "
                                   "than GPUs (they share them: multi-process code on one GPU)")
    precision: str = setting("auto", "\"auto\", \"bf16-mixed\", \"16-mixed\" or \"32\"")
    compile: Union[bool, str] = setting("auto", "\"auto\": on one CUDA device, time the first steps; launch-bound: "
                                                "the whole step as one CUDA graph, else compile once the rest of the "
                                                "run pays for it; True: torch.compile from the start; False: eager; "
                                                "\"reduce-overhead\" / \"max-autotune\": torch.compile from the start "
                                                "in that mode; \"step-graph\": the whole step (forward, backward, "
                                                "optimizer) captured as one CUDA graph")
    activation_checkpointing: bool = setting(False, "recompute each child module's activations in backward "
                                                    "(saves memory)")
    memory_plan: bool = setting(True, "take memory-saving measures when the estimate does not fit the budget "
                                      "(runtime/memory/plan.py); False: only those set by hand")
    memory_budget: Union[int, str, None] = setting(None, "bytes (or \"24GiB\") the run may use; None: the "
                                                         "device's free memory")
    optimizer_states: str = setting("auto", "\"auto\" (the memory plan's choice), \"full\", \"8bit\" (torchao) "
                                            "or \"cpu\" (on the host)")
    lr: float | None = setting(None, "learning rate of the default AdamW (1e-3 when unset)", section="optimisation")
    clip_grad_norm: float | None = setting(None, "clip the global gradient norm to this value")
    lr_schedule: str = setting("none", "\"none\", \"one-cycle\" or \"cosine\" (with warmup)")
    warmup_steps: int = setting(0, "linear warmup steps for the cosine schedule")
    min_lr_ratio: float = setting(0.0, "the cosine schedule decays to lr * min_lr_ratio (e.g. 0.1), not below")
    ema: float | None = setting(None, "decay of an average of the weights (e.g. 0.999), used for validation; "
                                      "None: off")
    ema_warmup: bool = setting(True, "the average's decay grows as min(ema, (1 + n) / (10 + n)) over updates n")
    ema_apply: bool = setting(False, "at the end, load the averaged weights into the model (else: "
                                     "result.ema_state_dict); restore_best goes first: it loads the best "
                                     "checkpoint's averaged weights, the ones validated")
    merge_adapters: bool = setting(False, "a peft model (LoRA, ...): at the end, merge the trained adapters into "
                                          "the base weights (peft's merge_and_unload); the merged base model is "
                                          "result.model")
    num_workers: Union[int, str] = setting("auto", "DataLoader workers, or \"auto\"", section="data")
    gpu_resident: Union[bool, str] = setting("auto", "keep tensor data on the GPU: \"auto\", True or False")
    transforms: Sequence[Callable[[Any], Any]] = setting((), "applied to each batch on the device")
    batch_size_fn: Callable[[Any], int] | None = setting(None, "samples in a batch; None: the target's first "
                                                               "dimension")
    log_every: Union[int, str] = setting("auto", "steps between metric reads (the only host syncs); \"auto\": "
                                                 "~100 a run, >= 1 an epoch", section="logging")
    val_every: int = setting(1, "epochs between validation passes")
    val_every_steps: int | None = setting(None, "validate every N optimizer steps instead of at epoch ends")
    detect_nan: bool = setting(True, "stop with advice when the loss becomes NaN/inf")
    name: str | None = setting(None, "run name shown in dashboards and the run registry")
    track: bool = setting(True, "record the run in the run registry (sidebar, gpunb.runs())")
    sweep: dict | None = setting(None, "set by a sweep on each trial: the sweep's name, the trial's number, "
                                       "its trials, monitor and direction (the registry groups them by it)")
    loggers: Union[str, Sequence[Any]] = setting((), "\"csv\", \"tensorboard\", \"mlflow\", \"wandb\" (or "
                                                     "\"tensorboard,csv\") or logger objects; rank 0 writes")
    log_dir: str | None = setting(None, "where loggers write; None: <checkpoint_dir>/logs, else ./gpunb_logs")
    checkpoint_dir: str | None = setting(None, "where checkpoints go; None disables them", section="checkpoints")
    checkpoint_every: int | None = setting(None, "optimizer steps between checkpoints; None: each epoch")
    keep_last: int = setting(3, "checkpoints kept on disk")
    resume: Union[bool, str, None] = setting(None, "True/\"last\": the newest in checkpoint_dir; \"best\"; or "
                                                   "a path")
    save_top_k: int = setting(0, "also keep the k best checkpoints by `monitor` (0: off)")
    monitor: str | None = setting(None, "validation metric that ranks them (None: \"val_loss\")")
    mode: str | None = setting(None, "\"min\" or \"max\" (None: \"max\" for acc/f1/auroc/precision/recall..., "
                                     "else \"min\")")
    restore_best: bool = setting(False, "load the best checkpoint's weights into the model when fit ends")
    cluster: str | None = setting(None, "None: in this process (the kernel); \"local\": a job of its own on this "
                                        "machine that outlives the kernel; \"slurm\": a Slurm job (settings from "
                                        "~/.config/gpunb/clusters.toml and `slurm`)", section="where the run executes")
    nodes: int = setting(1, "a job's nodes (Slurm)")
    gpus_per_node: int | None = setting(None, "a job's GPUs, one process each, per node; None: `devices` processes")
    slurm: dict = setting(help="the job's settings for its cluster, over the cluster file's; Slurm's: partition, "
                               "time, account, qos, constraint, any sbatch key (on a command line: --partition, "
                               "--time, ..., --slurm KEY=VALUE)", factory=dict)
    gpu_hour_price: float | None = setting(None, "a GPU-hour's price, for the job's cost; None: the cluster file's")
    resubmit: bool = setting(False, "submit anew even when this run's job exists (else its job is attached to)")
    seed: int | None = setting(0, "seeds python, numpy and torch; None leaves RNGs alone",
                               section="reproducibility")
    deterministic: bool = setting(False, "deterministic algorithms (slower; errors on ops without one)")

    def __post_init__(self) -> None:
        self.precision = _choice("precision", self.precision, _PRECISION_ALIASES,
                                 "use one of " + ", ".join(f"`{p}`" for p in PRECISIONS))
        self.lr_schedule = _choice("lr_schedule", self.lr_schedule, _SCHEDULE_ALIASES,
                                   "use `none`, `one-cycle` or `cosine`")
        self.accelerator = _choice("accelerator", self.accelerator,
                                   {a: a for a in ACCELERATORS} | {"gpu": "cuda"},
                                   "use `auto`, `cuda`, `mps` or `cpu`")
        self.compile = _choice("compile", self.compile, _COMPILE_ALIASES,
                               "use `'auto'`, `True`, `False`, `'reduce-overhead'` (CUDA graphs), `'max-autotune'` "
                               "or `'step-graph'` (the whole step as one CUDA graph)")
        self.strategy = _choice("strategy", self.strategy, {s: s for s in STRATEGIES},
                                "use `auto`, `ddp` or `fsdp`")
        self.backend = _choice("backend", self.backend, {b: b for b in BACKENDS},
                               "use `auto`, `nccl` or `gloo`")
        if self.backend == "nccl" and self.accelerator in ("cpu", "mps"):
            raise GpunbError(f"backend='nccl' connects CUDA GPUs, and accelerator={self.accelerator!r}.",
                             "use `backend='gloo'` (or 'auto') between CPU processes, or `accelerator='cuda'`.")
        self.batch_size = _positive_or_auto("batch_size", self.batch_size)
        self.memory_budget = _byte_count("memory_budget", self.memory_budget)
        self.optimizer_states = _choice("optimizer_states", self.optimizer_states,
                                        {s: s for s in OPTIMIZER_STATES} | {"8-bit": "8bit", "host": "cpu"},
                                        "use `auto`, `full`, `8bit` or `cpu`")
        self.num_workers = _count_or_auto("num_workers", self.num_workers)
        if self.devices != "all":
            self.devices = _positive_int("devices", self.devices)
        if self.epochs is not None:
            self.epochs = _positive_int("epochs", self.epochs)
        self.grad_accum = _positive_int("grad_accum", self.grad_accum)
        self.log_every = _positive_or_auto("log_every", self.log_every)
        self.val_every = _positive_int("val_every", self.val_every)
        self.loggers = _loggers(self.loggers)
        self.keep_last = _positive_int("keep_last", self.keep_last)
        self.warmup_steps = _count("warmup_steps", self.warmup_steps)
        self._check_min_lr_ratio()
        if self.max_steps is not None:
            self.max_steps = _positive_int("max_steps", self.max_steps)
        if self.val_every_steps is not None:
            self.val_every_steps = _positive_int("val_every_steps", self.val_every_steps)
        self._check_best()
        self._check_job()
        if self.checkpoint_every is not None:
            self.checkpoint_every = _positive_int("checkpoint_every", self.checkpoint_every)
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise GpunbError(f"clip_grad_norm must be positive, got {self.clip_grad_norm!r}.",
                             "pass a max norm such as `clip_grad_norm=1.0`, or None to disable.")
        self._check_ema()
        if self.lr is not None and not self.lr > 0:
            raise GpunbError(f"lr must be positive, got {self.lr!r}.", "pass e.g. `lr=3e-4`.")
        if self.batch_size_fn is not None and not callable(self.batch_size_fn):
            kind = type(self.batch_size_fn).__name__
            raise GpunbError(f"batch_size_fn must be a function of a batch, got a {kind}.",
                             "pass e.g. `batch_size_fn=lambda batch: len(batch[-1])` (the labels' count).")
        if self.gpu_resident not in ("auto", True, False):
            raise GpunbError(f"gpu_resident must be 'auto', True or False, got {self.gpu_resident!r}.")
        if self.resume and not self.checkpoint_dir and self.resume in (True, "last", "best"):
            which = "best" if self.resume == "best" else "last"
            raise GpunbError(f"resume='{which}' needs a checkpoint_dir to look in.",
                             "pass `checkpoint_dir=...` too, or `resume=<path to a checkpoint>`.")

    def _check_ema(self) -> None:
        if self.ema is not None and (isinstance(self.ema, bool) or not isinstance(self.ema, (int, float))
                                     or not 0 < self.ema < 1):
            raise GpunbError(f"ema must be a decay between 0 and 1, got {self.ema!r}.",
                             "pass e.g. `ema=0.999` (closer to 1 averages over more steps), or None to disable.")
        if self.ema_apply and self.ema is None:
            raise GpunbError("ema_apply=True asks for the averaged weights, and `ema` is not set.",
                             "pass `ema=0.999` too, or drop `ema_apply`.")

    def _check_min_lr_ratio(self) -> None:
        ratio = self.min_lr_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise GpunbError(f"min_lr_ratio must be a fraction of the learning rate between 0 and 1, got {ratio!r}.",
                             "pass e.g. `min_lr_ratio=0.1`: the cosine schedule then ends at a tenth of `lr`.")
        if ratio and self.lr_schedule != "cosine":
            raise GpunbError(f"min_lr_ratio={ratio} sets where the cosine schedule ends, and "
                             f"lr_schedule is {self.lr_schedule!r}.",
                             "pass `lr_schedule='cosine'` too (`--lr-schedule cosine`), or drop `min_lr_ratio`.")

    def _check_best(self) -> None:
        """save_top_k / monitor / mode / restore_best: what they need, before any work."""
        self.save_top_k = _count("save_top_k", self.save_top_k)
        check_mode(self.mode, "TrainConfig")
        if self.save_top_k and not self.checkpoint_dir:
            raise GpunbError(f"save_top_k={self.save_top_k} keeps the best checkpoints, and no "
                             "checkpoint_dir is set to write them to.",
                             "pass `checkpoint_dir='checkpoints'` too, or drop `save_top_k`.")
        if self.restore_best and not self.save_top_k:
            raise GpunbError("restore_best=True loads the best checkpoint's weights at the end, and "
                             "save_top_k is 0, so no best checkpoint is kept.",
                             "pass `save_top_k=1` and a `checkpoint_dir` too.")
        if self.monitor is not None and not isinstance(self.monitor, str):
            raise GpunbError(f"monitor must be a metric name, got {self.monitor!r}.",
                             "pass e.g. `monitor='val_loss'` or `monitor='val_acc'`.")

    def _check_job(self) -> None:
        """cluster / nodes / gpus_per_node / slurm / gpu_hour_price, before anything is submitted."""
        self.cluster = _cluster_name(self.cluster)  # which names exist is the jobs' table's (jobs/backends)
        self.nodes = _positive_int("nodes", self.nodes)
        if self.gpus_per_node is not None:
            self.gpus_per_node = _positive_int("gpus_per_node", self.gpus_per_node)
        if self.nodes > 1 and self.cluster is None:
            raise GpunbError(f"nodes={self.nodes} needs a cluster, and cluster=None.",
                             "pass `cluster='slurm'` too (`--cluster slurm`), or drop `nodes`.")
        if not isinstance(self.slurm, dict):
            raise GpunbError(f"slurm must be a dict of Slurm settings, got {self.slurm!r}.",
                             "pass e.g. `slurm={'partition': 'gpu', 'time': '2:00:00'}`.")
        price = self.gpu_hour_price
        if price is not None and (isinstance(price, bool) or not isinstance(price, (int, float)) or price < 0):
            raise GpunbError(f"gpu_hour_price must be a price >= 0, got {price!r}.", "pass e.g. `gpu_hour_price=2.5`.")

    def resolved_log_every(self, total_steps: int | None, steps_per_epoch: int | None) -> int:
        """`log_every`, or for "auto" an interval giving ~LOG_POINTS points a run and >= 1 an epoch."""
        if self.log_every != "auto":
            return self.log_every
        if total_steps is None:  # data without a length and no max_steps: nothing to divide
            return FALLBACK_LOG_EVERY
        every = max(1, total_steps // LOG_POINTS)
        return min(every, steps_per_epoch) if steps_per_epoch else every

    def replace(self, **overrides: Any) -> "TrainConfig":
        """A copy with some fields changed (validated like a new config)."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise unknown_option_error(sorted(unknown)[0])
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict:
        """JSON-friendly view: callables and sequences of them become their names."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "transforms":
                value = [getattr(t, "__name__", type(t).__name__) for t in value]
            elif f.name == "batch_size_fn" and value is not None:
                value = getattr(value, "__name__", type(value).__name__)
            elif f.name == "loggers":
                value = [v if isinstance(v, str) else type(v).__name__ for v in value]
            out[f.name] = value
        return out


def make_config(config: TrainConfig | None = None, **overrides: Any) -> TrainConfig:
    """`config` with `overrides` applied; a misspelt keyword names the closest field."""
    return (config or TrainConfig()).replace(**overrides) if overrides else (config or TrainConfig())


def unknown_option_error(name: str) -> GpunbError:
    import difflib

    names = [f.name for f in dataclasses.fields(TrainConfig)]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean `{close[0]}`?" if close else "valid options: " + ", ".join(names)
    return GpunbError(f"TrainConfig has no option `{name}`.", hint)


def check_mode(mode, owner: str) -> str | None:
    """A monitor's mode: "min", "max", or None (chosen by the metric's name)."""
    if mode not in (None, "min", "max"):
        raise GpunbError(f"{owner} mode must be 'min' or 'max', got {mode!r}.",
                         "pass `mode='min'` for losses or `mode='max'` for accuracy-like metrics, "
                         "or leave it unset to choose by the metric's name.")
    return mode


def _loggers(value: Any) -> tuple:
    """Logger names made canonical ("tb" -> "tensorboard"); logger objects kept as they are."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    elif not isinstance(value, (list, tuple)):
        value = [value]
    hint = "use " + ", ".join(f"`{name}`" for name in LOGGERS) + ", or a logger object"
    resolved = []
    for item in value:
        if isinstance(item, str):
            item = _choice("logger", item, _LOGGER_ALIASES, hint)
        elif not any(callable(getattr(item, event, None)) for event in ("on_log", "on_epoch_end", "on_fit_end")):
            raise GpunbError(f"loggers got a {type(item).__name__}, which is neither a logger name nor a "
                             "logger (an object with on_log / on_epoch_end / on_fit_end).", hint + ".")
        if item not in resolved:
            resolved.append(item)
    return tuple(resolved)


def _choice(name: str, value: Any, aliases: dict, hint: str) -> str:
    key = str(value).strip().lower()
    if key not in aliases:
        raise GpunbError(f"Unknown {name} {value!r}.", hint + ".")
    return aliases[key]


def _cluster_name(value: Any) -> str | None:
    """None ("none": in this process) or a backend's name, as written (gpunb.jobs knows the names)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if not isinstance(value, str):
        raise GpunbError(f"cluster must be a cluster's name, got {value!r}.",
                         "pass e.g. `cluster='local'` (a detached job on this machine) or `cluster='slurm'`.")
    return value.strip().lower()


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GpunbError(f"{name} must be a positive integer, got {value!r}.",
                         f"pass e.g. `{name}=1`.")
    return value


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GpunbError(f"{name} must be an integer >= 0, got {value!r}.")
    return value


def _positive_or_auto(name: str, value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GpunbError(f"{name} must be a positive integer or 'auto', got {value!r}.",
                         f"pass e.g. `{name}=64` or `{name}='auto'`.")
    return value


def _byte_count(name: str, value: Any) -> int | None:
    """None, a positive int of bytes, or a string such as "24GiB" / "80 GB"."""
    from gpunb.units import parse_bytes

    if value is None:
        return None
    count = parse_bytes(value) if isinstance(value, str) else value
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise GpunbError(f"{name} must be a number of bytes or a size such as '24GiB', got {value!r}.",
                         f"pass e.g. `{name}='24GiB'` (GiB, GB, MiB, MB also read), or None for the device's free memory.")
    return count


def _count_or_auto(name: str, value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return _count(name, value)
