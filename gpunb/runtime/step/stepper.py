"""One optimizer step: forward and backward over micro-batches, then the update.

A CUDA out-of-memory error halves the micro-batch: gradients of the step so far are
dropped, each loaded batch is cut into twice as many pieces, and the step is replayed
from its first batch. Each piece's loss is weighted by its share of the step, so the
gradient, and hence the whole run, is the same as with the smaller batch from the start.
An epoch's last step may hold fewer than `grad_accum` batches: its gradient and loss are
rescaled to the mean over the batches it really had.

The step runs on one engine at a time (engines.py: eager, compiled, or the whole step as
one CUDA graph); `switch` changes it between steps. An engine that fails (a compiled forward
that raises, a step that cannot be captured) is left for the eager one it came from, with a
warning, and the step so far runs again; `failure` keeps what happened for the result.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from gpunb.errors import GpunbError
from gpunb.runtime.device import out_of_memory
from gpunb.runtime.feed.inputs import split_batch
from gpunb.runtime.step.engines import EagerEngine
from gpunb.runtime.step.step_graph import CaptureError


_NO_CONTEXT = contextlib.nullcontext()


class Unmarked:
    """Marks of a step that no profiler watches (the batch-size probe, the LR sweep)."""

    profile = False


def phase_range(name: str):
    """A named profiler range around one phase of a step (only while a profiler asks for them)."""
    return torch.profiler.record_function(f"gpunb/{name}")


class Stepper:
    """The training step of fit, and of the batch-size probe and the LR sweep (one batch a step).

    `split_on_oom=False` lets a CUDA out-of-memory error through (the probe asks "does it fit?").
    """

    def __init__(self, model, optimizer, objective, precision, schedule, config, marks=Unmarked,
                 no_sync=None, split_on_oom: bool = True, ema=None):
        self.model, self.optimizer, self.objective = model, optimizer, objective  # model: as trained, uncompiled
        self.precision, self.schedule, self.config = precision, schedule, config
        self.marks = marks  # `marks.profile`: name the step's phases for a profiler (the RunState's PhaseMarks)
        self.ema = ema  # runtime.ema.WeightEma, averaged after each optimizer step
        self.no_sync = no_sync  # DDP: skips the all-reduce of a step's micro-batches but the last
        self.split_on_oom = split_on_oom
        self.splits = 1  # pieces each loaded batch is cut into (grows on OOM)
        self.oom_recoveries = 0
        self.pending: list = []  # loaded batches of the step in progress, kept for a replay
        self.step_loss = None  # device tensor: this step's mean loss so far
        # One autocast context, entered for every micro-batch (never nested); fp32: a shared no-op.
        self.autocast = precision.autocast()
        # fp32 without a loss scaler: a micro-batch needs no context at all (unless profiled or
        # a DDP micro-batch skips its all-reduce), so that common case runs with none.
        self.bare = precision.dtype is None and precision.scaler is None
        self.weight = 1.0 / config.grad_accum  # each loaded batch's share of an optimizer step
        # An optimizer with a zero_grad of its own (a subclass's, or one set on it) has it called (clear_grads).
        self.own_zero_grad = getattr(optimizer.zero_grad, "__func__", None) is not torch.optim.Optimizer.zero_grad
        self.replayed = False  # the engine took the whole step, update included
        self.failure = None  # (engine, error): the engine that failed, left for eager (compiling.py reports it)
        self._use(EagerEngine(model, objective))
        # the memory plan's next measure after an OOM smaller micro-batches cannot fix (runtime/memory/measures.py)
        self.memory_fallback = None
        self.steps_taken = 0  # for the fallback's note

    def phase(self, name: str):
        """The profiler range of phase `name` while profiling, else a shared no-op context."""
        return phase_range(name) if self.marks.profile else _NO_CONTEXT

    def switch(self, engine) -> None:
        """Run `engine` from the next step on (a step runs on one engine: only between steps)."""
        if self.pending or self.step_loss is not None:
            raise RuntimeError("Stepper.switch is for step boundaries; a step is in progress.")
        if engine is not self.engine:
            self.engine.close()
            self._use(engine)

    def _use(self, engine) -> None:
        """`engine.graphed`: its outputs live in memory the next replay overwrites, so the kept loss
        is a copy; and with gradient accumulation the gradients live in buffers of their own, zeroed
        rather than dropped after each step (a .grad made by a graph would be overwritten by the
        next micro-batch's)."""
        self.engine, self.cuda_graphs = engine, engine.graphed
        self.whole_step = engine.whole_step if engine.whole_steps else None  # checked once a micro-batch
        self.stable_grads = engine.graphed and self.config.grad_accum > 1
        if self.stable_grads:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)

    def accumulate(self, batch, last_in_step: bool) -> None:
        """Forward and backward of one loaded batch (in `splits` pieces), or the whole step when
        the engine takes it."""
        __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
        if self.whole_step is not None and self._take_whole_step(batch):
            return
        self.pending.append(batch)
        try:
            self._backward(batch, last_in_step)
        except Exception as error:
            if out_of_memory(error):  # on the GPU, or the host's allocator
                self._drop_step()
                if not self.split_on_oom:
                    raise
                self._recover_from_oom(batch)
            elif self.engine.compiles:  # a compiled model that cannot run: replayed eagerly
                self._fall_back(error)
                self._drop_step()
            else:
                raise  # the model's own error
            self._replay(last_in_step)

    def _take_whole_step(self, batch) -> bool:
        """The step on `batch` by the engine at once; False: run it micro-batch by micro-batch."""
        try:
            loss = self.whole_step(self, batch)
        except CaptureError as error:
            self._fall_back(error)
            return False
        if loss is None:  # not taken (a graph's first step; another shape, as an epoch's partial last batch)
            return False
        self.step_loss, self.replayed = loss, True
        return True

    def _fall_back(self, error: BaseException) -> None:
        """The engine failed: eager from now on, with a warning that says why."""
        failed = self.engine
        self.failure = (failed, error)
        failed.close()
        self._use(failed.eager)
        warnings.warn(failed.failure_warning(error), RuntimeWarning, stacklevel=3)

    def _replay(self, last_in_step: bool) -> None:
        """The whole step so far again, in smaller pieces (halved again on each further OOM)."""
        while True:
            try:
                for i, loaded in enumerate(self.pending):
                    self._backward(loaded, sync=last_in_step and i == len(self.pending) - 1)
                return
            except Exception as error:
                if not out_of_memory(error):
                    raise
                self._drop_step()
                self._recover_from_oom(self.pending[-1])

    def update(self) -> torch.Tensor:
        """Clip, step the optimizer, the schedule and the weight average; returns the step's mean
        loss (on device)."""
        if self.replayed:  # the engine (a CUDA graph) took the optimizer step
            self.replayed = False
            self._after_update()
        else:
            self._update()
        loss, self.step_loss = self.step_loss, None
        return loss

    def _update(self) -> None:
        short = len(self.pending) < self.config.grad_accum  # the epoch ended mid-group
        scale = self.config.grad_accum / len(self.pending) if short else None
        self.pending.clear()  # backward is done: the batches are no longer needed for a replay
        if self.marks.profile:
            with phase_range("optimizer"):
                self._step(scale)
        else:
            self._step(scale)

    def _step(self, scale: float | None) -> None:
        if scale is not None:
            self._rescale(scale)
        self.clip()
        self.precision.step(self.optimizer)
        self.clear_grads()
        self._after_update()

    def clip(self) -> None:
        """Clip the global gradient norm to `clip_grad_norm`, when set (unscaled first)."""
        if self.config.clip_grad_norm:
            self.precision.unscale(self.optimizer)
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.config.clip_grad_norm)

    def _after_update(self) -> None:
        self.steps_taken += 1
        if self.schedule is not None:
            self.schedule.after_step()
        if self.ema is not None:
            self.ema.update(self.precision.step_taken)

    def clear_grads(self) -> None:
        """`optimizer.zero_grad()`: the gradients set to None (zeroed in place for CUDA graphs with
        accumulation, see _use). torch's own method enters a profiler range on every call,
        which on a small CPU step costs several times the loop over the parameters itself
        (benchmarks/RESULTS.md), so an optimizer that does not override zero_grad has its
        gradients dropped here directly."""
        if self.stable_grads or self.own_zero_grad:
            self.optimizer.zero_grad(set_to_none=not self.stable_grads)
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def _rescale(self, scale: float) -> None:
        """Each batch was weighted 1/grad_accum; a short group's are re-weighted to 1/its size."""
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale)  # device ops, once per epoch: no sync
        if self.step_loss is not None:
            self.step_loss = self.step_loss * scale

    def micro_batch_size(self, batch_size: int) -> int:
        return -(-batch_size // self.splits)

    def _backward(self, batch, sync: bool) -> None:
        __tracebackhide__ = True  # noqa: F841
        if self.splits == 1:  # the common case, kept free of per-piece bookkeeping
            self._piece(batch, self.weight, sync)
            return
        size = self.objective.samples(batch)
        pieces = split_batch(batch, self.splits, size)
        for i, piece in enumerate(pieces):
            # Weight = the piece's share of the optimizer step, so sums of pieces equal the mean.
            self._piece(piece, self.objective.samples(piece) / size / self.config.grad_accum,
                        sync and i == len(pieces) - 1)

    def _piece(self, piece, weight: float, sync: bool) -> None:
        """Forward and backward of one micro-batch; `sync=False` skips DDP's all-reduce."""
        __tracebackhide__ = True  # noqa: F841
        if self.cuda_graphs:  # a new iteration: the graphs may reuse the last one's memory
            torch.compiler.cudagraph_mark_step_begin()
        if self.bare and (sync or self.no_sync is None) and not self.marks.profile:
            loss = self.engine.loss(piece)  # as a plain loop: no context to enter
            if weight != 1.0:  # skipping the multiply keeps the common case one op shorter
                loss = loss * weight
            loss.backward()
        else:
            with _NO_CONTEXT if sync or self.no_sync is None else self.no_sync():
                with self.phase("forward"), self.autocast:
                    loss = self.engine.loss(piece)
                if weight != 1.0:
                    loss = loss * weight
                with self.phase("backward"):
                    self.precision.backward(loss)
        contribution = loss.detach().clone() if self.cuda_graphs else loss.detach()
        self.step_loss = contribution if self.step_loss is None else self.step_loss + contribution

    def _drop_step(self) -> None:
        """Forget the step's gradients and loss so far (its batches stay in `pending` for a replay)."""
        self.clear_grads()
        self.step_loss = None
        if not self.split_on_oom:
            self.pending.clear()  # no replay: the caller gets the error

    def _recover_from_oom(self, batch) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        size = self.objective.samples(batch)
        fallback = self.memory_fallback
        cannot_split = self.micro_batch_size(size) <= 1 or (fallback is not None and not fallback.splittable)
        if cannot_split and fallback is not None and fallback.next_measure(self.steps_taken + 1):
            self.oom_recoveries += 1
            return
        if cannot_split and self.micro_batch_size(size) > 1:
            raise GpunbError("Out of memory with the optimizer step fused into backward, which rules out smaller "
                             "micro-batches (each piece would take a step of its own), and the memory plan has no "
                             "measure left.", "pass a smaller `batch_size` (with `grad_accum=N` the plan keeps "
                             "the optimizer step apart), or train fewer parameters (LoRA).")
        if cannot_split:
            raise GpunbError("Out of memory even with a micro-batch of 1 sample.",
                             "the model itself does not fit: try `precision='bf16-mixed'`, "
                             "`activation_checkpointing=True`, a smaller model, or "
                             "`devices=N, strategy='fsdp'` to shard it.")
        self.splits *= 2
        self.oom_recoveries += 1
