"""The summary of a run before its first step: parameters, FLOPs, memory.

One forward + backward of one micro-batch, at the batch size training will use, tells
- the FLOPs per sample (torch.utils.flop_counter, the same on every machine);
- the activations' memory: on CUDA the peak of that step above the weights and
  gradients; elsewhere the tensors autograd saved for backward (saved_tensors_hooks);
- the share of those saved inside the model's repeated blocks, and the blocks' inputs,
  which the memory plan's activation checkpointing needs (runtime/memory/plan.py).
The step runs on MEASURED_SAMPLES samples of the batch, not all of it, and the activations
are scaled up to the batch: a check before training never sets the run's peak itself (with
compile, a full eager step beforehand left its blocks cached beside the compiled step's).
Weights and gradients are counted from the parameters; the optimizer's state from its
tensors when it has some (a run that continues), else from its type (AdamW keeps two
tensors the size of each parameter). Nothing is stepped: gradients, buffers, each
module's mode and the RNGs (drawing the batch included) are put back as they were
(preflight's Untouched).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from gpunb.runtime.feed.augmenter import apply_transforms
from gpunb.runtime.feed.inputs import batch_size_of, first_batch, is_mapping, map_tensors
from gpunb.runtime.memory.blocks import repeated_blocks
from gpunb.runtime.probes.batch_size import count_flops
from gpunb.runtime.probes.preflight import Untouched, small_sample
from gpunb.runtime.trainable import parameter_count

MEASURED_SAMPLES = 2  # samples of the batch the step before training runs on

# Tensors of a parameter's size each optimizer keeps per parameter (None: it depends).
_STATES = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2,
           "Adagrad": 1, "ASGD": 1, "SGD": 0, "RMSprop": 1}


@dataclass
class RunSummary:
    """What a run will train and what it needs; `repr` is deterministic (no machine facts)."""

    model: str  # the model's class name
    trainable_params: int
    frozen_params: int
    batch_size: int  # the micro-batch measured
    device: str
    precision: str
    forward_flops: int | None = None  # per sample; None: not counted
    train_flops: int | None = None  # forward + backward, per sample
    tokens_per_sample: int | None = None  # T when the inputs are token ids of shape (B, T)
    weights_bytes: int = 0  # parameters and buffers
    gradients_bytes: int = 0
    optimizer_bytes: int | None = None
    optimizer_note: str = ""
    activations_bytes: int | None = None
    activations_note: str = ""
    ema_bytes: int = 0  # the weight average `ema` keeps: a copy of the trainable weights and buffers
    free_bytes: int | None = None  # free GPU memory, or the system's available memory on CPU
    memory_kind: str = "system"  # "GPU" or "system"
    blocks: int = 0  # the model's repeated blocks (a transformer's layers)
    block_class: str = ""
    block_saved_bytes: int = 0  # of the activations, those saved inside the blocks
    block_input_bytes: int = 0  # the blocks' inputs (what a checkpointed block keeps)
    plan: str = ""  # the memory plan's measures ("" when none was needed)
    run: str = ""  # the run's name, where one was given (the result's repr starts with it too)
    strategy: str = ""  # strategy="auto" that shards: "strategy: fsdp — DDP needs ... per device of ...; sharded: ..."

    @property
    def params(self) -> int:
        return self.trainable_params + self.frozen_params

    @property
    def estimated_bytes(self) -> int:
        """Weights + gradients + optimizer state + weight average + activations (the parts known)."""
        parts = (self.weights_bytes, self.gradients_bytes, self.optimizer_bytes, self.ema_bytes,
                 self.activations_bytes)
        return sum(p for p in parts if p is not None)

    @property
    def fits(self) -> bool | None:
        """Whether the estimate is within the free memory (None when that is unknown)."""
        return None if self.free_bytes is None else self.estimated_bytes <= self.free_bytes

    def as_plain(self) -> dict:
        """The fields and the derived values as plain data: what a rank sends to the kernel and
        what the progress displays read (as attributes, through SimpleNamespace)."""
        return {**asdict(self), "params": self.params, "estimated_bytes": self.estimated_bytes,
                "fits": self.fits}

    @classmethod
    def from_plain(cls, plain: dict) -> "RunSummary":
        return cls(**{f.name: plain[f.name] for f in fields(cls) if f.name in plain})  # older: fewer

    def __repr__(self) -> str:
        from gpunb.render import summary_text

        return summary_text(self)

    def _repr_html_(self) -> str:
        from gpunb.render import summary_html

        return summary_html(self)


def summarize(model, optimizer, objective, precision, data, device, batch_size: int, config,
              measure: bool = True) -> RunSummary:
    """The summary of training `model` on `data` (adapted) at `batch_size`.

    `measure=False` (or a custom `step`, which is never run ahead of time) skips the
    forward + backward: FLOPs and activations are then left unknown.
    """
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    summary = RunSummary(
        model=type(model).__name__, trainable_params=sum(parameter_count(p) for p in trainable),
        frozen_params=sum(parameter_count(p) for p in params if not p.requires_grad), batch_size=batch_size,
        device=device.type, precision=precision.name, run=config.name or "",
        weights_bytes=sum(_nbytes(t) for t in [*params, *model.buffers()]),
        gradients_bytes=sum(_nbytes(p) for p in trainable))
    if config.ema is not None:  # the trainable parameters and the buffers (frozen ones are not averaged)
        summary.ema_bytes = sum(_nbytes(t) for t in [*trainable, *model.buffers()])
    summary.optimizer_bytes, summary.optimizer_note = optimizer_state_bytes(optimizer)
    summary.free_bytes, summary.memory_kind = free_memory(device)
    if objective.step_fn is not None:
        summary.activations_note = "not measured: a custom step is not run ahead of time"
    elif measure and params and params[0].device.type != "meta":
        try:
            _measure(summary, model, objective, precision, data, device, batch_size, config)
        except torch.OutOfMemoryError:
            summary.activations_note = f"not measured: out of memory at batch {batch_size}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as error:  # noqa: BLE001 - the loop's first step reports it, to the callbacks
            summary.activations_note = f"not measured: {type(error).__name__} in the model or loss"
    return summary


def optimizer_state_bytes(optimizer) -> tuple[int | None, str]:
    """The optimizer's state: measured when it holds some, else from its type."""
    if optimizer is None:
        return None, "no optimizer"
    name = type(optimizer).__name__
    held = [t for state in optimizer.state.values() for t in state.values()
            if isinstance(t, torch.Tensor) and t.ndim > 0]
    if held:
        return sum(_nbytes(t) for t in held), f"{name}: measured from its state"
    per_param = _STATES.get(name)
    if per_param is None:
        return None, f"{name}: unknown until its first step"
    defaults = optimizer.defaults
    per_param += bool(defaults.get("amsgrad")) + (name == "SGD" and bool(defaults.get("momentum")))
    per_param += name == "RMSprop" and (bool(defaults.get("momentum")) + bool(defaults.get("centered")))
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    plural = "s" if per_param != 1 else ""
    return per_param * sum(_nbytes(p) for p in params), f"{name}: {per_param} tensor{plural} per parameter"


def free_memory(device) -> tuple[int | None, str]:
    """Free GPU memory on CUDA; the system's available memory elsewhere."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], "GPU"
    try:
        import psutil
    except ImportError:
        return None, "system"
    return psutil.virtual_memory().available, "system"


def _measure(summary, model, objective, precision, data, device, batch_size, config) -> None:
    """One forward + backward of a few samples of a training micro-batch: FLOPs and activations
    (scaled to the batch). Nothing stays changed."""
    _, blocks = repeated_blocks(model)
    summary.blocks, summary.block_class = len(blocks), type(blocks[0]).__name__ if blocks else ""
    grads = [(p, p.grad) for p in model.parameters()]
    held = {}

    # the batch is drawn inside too: a collate function or stream that draws random numbers
    # (masking, random windows) would otherwise start training one batch ahead
    with Untouched(model, device):
        batch = map_tensors(first_batch(data, batch_size, device), torch.clone)  # transforms may work in place
        if config.transforms:  # as the feed applies them: the model sees transformed batches
            batch = apply_transforms(batch, config.transforms)
        # tensors of its own (not views into the data), so that saved storages are the sample's
        sample = map_tensors(small_sample(batch, MEASURED_SAMPLES), torch.clone)
        try:
            model.train()
            try:
                saved, flops = _step(model, objective, precision, sample, device, held)
            except torch.OutOfMemoryError:
                raise
            except Exception:  # noqa: BLE001 - a model that takes only whole batches: measured whole
                if batch_size_of(sample) == batch_size_of(batch):
                    raise
                _restore(grads)
                sample = map_tensors(batch, torch.clone)
                saved, flops = _step(model, objective, precision, sample, device, held)
        finally:
            held.clear()
            _restore(grads)
        scale = batch_size_of(batch) / max(1, batch_size_of(sample))
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) - saved.base - summary.gradients_bytes
            summary.activations_bytes = round(max(0, peak) * scale)
            summary.activations_note = "peak of one step above weights and gradients"
        else:
            summary.activations_bytes = round(saved.bytes * scale)
            summary.activations_note = "tensors saved for backward in one step"
        summary.block_saved_bytes = round(saved.block_bytes * scale)
        summary.block_input_bytes = round(saved.block_inputs * scale)
    summary.tokens_per_sample = tokens_per_sample(batch)
    size = max(1, batch_size_of(sample))
    forward_flops, backward_flops = flops
    if forward_flops is not None:
        summary.forward_flops = round(forward_flops / size)
        if backward_flops is not None:
            summary.train_flops = round((forward_flops + backward_flops) / size)


def _step(model, objective, precision, batch, device, held):
    """Forward and backward of `batch` under the FLOP counter and the saved-tensor count."""
    _, blocks = repeated_blocks(model)
    saved = _SavedTensors(model, blocks)

    def forward():
        with saved, precision.autocast():
            held["loss"] = objective.loss(model, batch)

    try:  # the blocks' hooks go whatever happens: a failed try is retried or given up, and training goes on
        saved.base = _start_peak(device)
        forward_flops = count_flops(forward)
        if "loss" not in held:  # the counter could not trace an op: run it plain
            forward()
        backward_flops = count_flops(lambda: held.pop("loss").backward())
        if "loss" in held:
            held.pop("loss").backward()
    finally:
        saved.remove()
    return saved, (forward_flops, backward_flops)


def _restore(grads) -> None:
    for param, grad in grads:
        param.grad = grad


def tokens_per_sample(batch) -> int | None:
    """T when the model's input is integer token ids of shape (B, T): a tensor, the first part of a
    tuple, or a dict's `input_ids`; None otherwise (class labels of shape (B,) are not tokens)."""
    if is_mapping(batch):
        inputs = batch.get("input_ids")
    elif isinstance(batch, (list, tuple)) and batch:
        inputs = batch[0]
    else:
        inputs = batch
    if isinstance(inputs, torch.Tensor) and inputs.ndim == 2 and not inputs.is_floating_point() \
            and not inputs.is_complex() and inputs.dtype != torch.bool:
        return inputs.shape[1]
    return None


def _start_peak(device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


class _SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the distinct storages autograd saves for backward, weights excepted,
    and of those, the ones saved inside `blocks`; and the blocks' inputs."""

    def __init__(self, model, blocks=()):
        self.bytes = self.block_bytes = self.block_inputs = self.base = 0
        self._seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._inside = 0
        self._hooks = [hook for block in blocks for hook in (
            block.register_forward_pre_hook(self._enter, with_kwargs=True),
            block.register_forward_hook(self._leave, always_call=True))]
        super().__init__(self._pack, lambda tensor: tensor)

    def _enter(self, module, args, kwargs):
        if not self._inside and torch.is_grad_enabled():
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            self.block_inputs += _nbytes(first) if first is not None else 0
        self._inside += 1

    def _leave(self, module, args, output):
        self._inside -= 1

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
            if self._inside:
                self.block_bytes += storage.nbytes()
        return tensor

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()
