"""The whole training step as one CUDA graph: forward, backward, gradient clipping and the
optimizer's update captured once, then replayed for every batch of the same shapes.

On a launch-bound step (a small model: the GPU waits while the host issues hundreds of
few-microsecond kernels) the host's work shrinks to a copy of the batch into the graph's
input buffers and one launch, whatever the model. This is PyTorch's "whole-network
capture"; torch.compile's "reduce-overhead" graphs the model's forward and backward only,
and leaves the loss, the optimizer, autograd and the Python around them on the host, which
still issues them every step (benchmarks/RESULTS.md, "torch.compile", compares the two).

What capture asks of a step, and how it is met:
- The same work every step. A batch of other shapes (an epoch's partial last batch) runs
  eagerly. A model that reads device values on the host (`.item()`, data-dependent shapes)
  cannot be captured: capture fails and the run goes on without the graph, saying why.
  Python that decides differently from step to step is not seen after capture.
- Optimizer state on the device. The optimizer's groups become `capturable` (the step count
  lives on the device) and it has taken one eager step, so its state exists before capture:
  state created inside the capture would be re-created at every replay. The learning rate is
  read from a device tensor, refilled from the group's value before a replay when a schedule
  changed it; the other hyper-parameters are fixed at capture, and a change to one ends the
  replays (`replay` says so).
- Autocast without its cache of cast weights (`cache_enabled=False`), which capture needs.
- Warm-up on the capture's side stream: two forward and backward passes on the first batch
  (their gradients dropped, the model's buffers put back), so that lazily made handles and
  workspaces exist before capture.
Random ops (dropout) draw new numbers at every replay: torch registers its CUDA generator
with the graph.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils import _pytree as pytree

from gpunb.runtime.feed.inputs import is_mapping

WARMUP_PASSES = 2


class CaptureError(RuntimeError):
    """The step cannot be captured; the message says why."""


def blocker(stepper, world_size: int) -> str | None:
    """Why this run's step cannot be one CUDA graph; None when it can be tried."""
    optimizer, device = stepper.optimizer, stepper.precision.device
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, and this run is on {device.type}"
    if world_size > 1:
        return "gradients are all-reduced between processes"
    if stepper.config.grad_accum > 1:
        return "gradient accumulation runs several backward passes a step"
    if stepper.precision.scaler is not None:
        return "fp16's loss scaler decides on the host whether to skip a step"
    if getattr(optimizer, "steps_in_backward", False):
        return "the optimizer steps inside backward, one parameter at a time (the memory plan)"
    if not isinstance(optimizer, torch.optim.Optimizer) or any("capturable" not in g for g in optimizer.param_groups):
        return f"the optimizer ({type(optimizer).__name__}) has no capturable mode"
    if stepper.schedule is not None and getattr(stepper.schedule.scheduler, "cycle_momentum", False):
        return "the one-cycle schedule changes the optimizer's momentum every step"
    return None


class StepGraph:
    """One optimizer step of `stepper` (forward, backward, clipping, update) captured on `batch`'s shapes."""

    def __init__(self, stepper, batch):
        self.stepper = stepper
        # A mapping other than a dict (a BatchEncoding): the graph's batch is rebuilt as one.
        self.mapping = type(batch) if is_mapping(batch) and type(batch) is not dict else None
        leaves, self.spec = _flatten(batch)
        if not leaves or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in leaves):
            raise CaptureError("the batch holds more than CUDA tensors")
        self.inputs = [t.clone() for t in leaves]  # the graph reads the batch from these
        self.groups = stepper.optimizer.param_groups
        _make_capturable(stepper.optimizer)
        self.settings = [_settings(g) for g in self.groups]
        self.lrs = [g["lr"] for g in self.groups]
        self.lr_tensors = [torch.tensor(float(lr), device=leaves[0].device) for lr in self.lrs]
        stream = torch.cuda.Stream(leaves[0].device)
        self._warm_up(stream)
        self.graph = torch.cuda.CUDAGraph()
        try:
            for group, lr in zip(self.groups, self.lr_tensors):
                group["lr"] = lr
            with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
                self.loss = self._step(self._static_batch())
        except Exception as error:
            _close_rng_capture(leaves[0].device)
            raise CaptureError(f"{type(error).__name__}: {error}") from error
        finally:
            for group, lr in zip(self.groups, self.lrs):
                group["lr"] = lr
            stepper.clear_grads()  # the graph keeps writing them; no eager step may add to them
            self.stepper = None  # replays need none of it: no reference cycle through the stepper that holds this

    def replay(self, batch) -> torch.Tensor | None:
        """The step on `batch`; returns its loss (a tensor of its own), or None when `batch` has
        other shapes than the captured one (the caller runs the step eagerly). Raises CaptureError
        when an optimizer setting the graph holds has changed."""
        if changed := self._settings_changed():
            raise CaptureError(f"the optimizer's {changed!r} changed, and the graph holds the old value")
        leaves, spec = _flatten(batch)
        if spec != self.spec or any(t.shape != s.shape or t.dtype != s.dtype for t, s in zip(leaves, self.inputs)):
            return None
        for i, group in enumerate(self.groups):
            if group["lr"] != self.lrs[i]:  # a schedule set a new rate: one fill, no sync
                self.lr_tensors[i].fill_(group["lr"])
                self.lrs[i] = group["lr"]
        for static, t in zip(self.inputs, leaves):
            static.copy_(t)
        self.graph.replay()
        return self.loss.clone()

    def _settings_changed(self) -> str | None:
        """The first optimizer setting (other than the learning rate) changed since capture, if any."""
        for group, before in zip(self.groups, self.settings):
            for key, value in _settings(group).items():
                if before.get(key) != value:
                    return key
        return None

    def _step(self, batch) -> torch.Tensor:
        loss = self._forward_backward(batch)
        self.stepper.clip()
        self.stepper.optimizer.step()  # no loss scaler (see blocker)
        return loss.detach()

    def _forward_backward(self, batch) -> torch.Tensor:
        with self.stepper.precision.autocast(cache=False):
            loss = self.stepper.objective.loss(self.stepper.model, batch)
        loss.backward()
        return loss

    def _static_batch(self):
        """The batch made of the graph's input buffers, of the captured batch's kind."""
        batch = pytree.tree_unflatten(self.inputs, self.spec)
        return self.mapping(batch) if self.mapping is not None else batch

    def _warm_up(self, stream) -> None:
        model = self.stepper.model
        buffers = [b.clone() for b in model.buffers()]  # batch-norm statistics: the passes don't count
        batch = self._static_batch()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_PASSES):
                self._forward_backward(batch)
                self.stepper.clear_grads()
            with torch.no_grad():
                for b, saved in zip(model.buffers(), buffers):
                    b.copy_(saved)
        torch.cuda.current_stream().wait_stream(stream)


def _flatten(batch) -> tuple[list, object]:
    """The batch's leaves and layout. pytree knows dicts, not other mappings: a collator's
    `BatchEncoding` is flattened as the dict it holds (else it would be one opaque leaf)."""
    return pytree.tree_flatten(dict(batch) if is_mapping(batch) and type(batch) is not dict else batch)


def _settings(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "lr")}


def _make_capturable(optimizer) -> None:
    """Step counts on the device, so that the captured update advances them (fused optimizers
    keep them there already)."""
    for group in optimizer.param_groups:
        group["capturable"] = True
        for p in group["params"]:
            state = optimizer.state.get(p)
            step = state.get("step") if state else None
            if isinstance(step, torch.Tensor) and step.device != p.device:
                state["step"] = step.to(p.device)


def _close_rng_capture(device: torch.device) -> None:
    """A capture that fails leaves the device's default CUDA generator in capture mode (torch
    ends that mode only once a capture ends well), and every random op after it, Dropout's or
    a transform's, raises "Offset increment outside graph capture". A capture of one small
    kernel ends it, keeping the generator's seed and offset."""
    try:
        with torch.cuda.device(device):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the feed's thread may launch
                torch.zeros(1, device=device)
    except Exception as error:  # noqa: BLE001 - the run goes on eagerly either way
        warnings.warn(f"After the failed capture, CUDA's random number generator could not be taken out of "
                      f"capture mode ({type(error).__name__}: {error}); random ops on this GPU (Dropout) may "
                      "fail until the kernel is restarted.", RuntimeWarning, stacklevel=2)
