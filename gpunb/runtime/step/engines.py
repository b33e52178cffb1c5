"""How the training step runs: eagerly, compiled, or captured whole as one CUDA graph.

The stepper (stepper.py) runs one engine at a time; compiling.py decides which, and the loop
switches at a step's end. Every engine answers the same calls:

    loss(piece) -> loss            one micro-batch's forward (the stepper runs its backward)
    whole_step(stepper, batch)     the whole step at once, update included: its loss, or None
                                   when the step runs micro-batch by micro-batch (a graph's first
                                   step; a batch of other shapes)
    close()                        let go of what it holds (a CUDA graph and its memory)

and says what it is:

    model, eval_model              the module a step calls, and the one validation calls
    whole_steps                    whole_step may take the step (else the stepper skips the call)
    graphed                        its outputs live in CUDA-graph memory that the next replay
                                   overwrites: the stepper copies the loss and marks each iteration
    compiles                       a failed forward may be the compiler's: the stepper goes on eager
    eager                          the eager engine to go on with when this one fails (None: eager)

CheckedEngine is the compiled engine that checks its first micro-batch against eager before it
counts (compile_beside.py: the switch after a compile beside the eager steps).

An engine that can fail also words it: `failure_warning(error)`, the warning the stepper gives,
and `failure_reason(error, reason)`, what the result says after (compiling.py).

An engine holds the eager engine it came from and nothing of the run: what a whole step needs
(optimizer, clipping) comes with the call, from the stepper.
"""

from __future__ import annotations

import torch

from gpunb.runtime.step.step_graph import StepGraph

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay CUDA graphs


class EagerEngine:
    """The module as given (or as DDP wraps it)."""

    whole_steps = graphed = compiles = False
    eager = None

    def __init__(self, model: torch.nn.Module, objective):
        self.model = self.eval_model = model
        self.objective = objective

    def loss(self, piece) -> torch.Tensor:
        __tracebackhide__ = True  # noqa: F841 (IPython and pytest hide gpunb frames)
        return self.objective.loss(self.model, piece)

    def whole_step(self, stepper, batch) -> None:
        return None

    def close(self) -> None:
        pass


class CompiledEngine:
    """torch.compile of the eager engine's module, in `mode` (True: the default mode), and of
    the objective's loss_fn as a graph of its own: a language model's cross-entropy is then one
    fused pass over its logits (the cast to fp32, log-softmax and the pick of each target's
    log-probability; and back) instead of several, each as large as the logits. nanoGPT gets
    the same by computing its loss inside the compiled forward. `validation`: validation calls
    the compiled module too (a forced compile); else it stays eager (a second graph for eval
    mode would cost another compile)."""

    whole_steps = False
    compiles = True

    def __init__(self, eager: EagerEngine, mode, backend, validation: bool = False):
        options = {"mode": mode} if isinstance(mode, str) else {}
        self.eager, self.objective = eager, eager.objective
        self.model = torch.compile(eager.model, backend=backend, **options)
        loss_fn = eager.objective.loss_fn
        self.loss_fn = torch.compile(loss_fn, backend=backend, **options) if loss_fn is not None else None
        self.eval_model = self.model if validation else eager.model
        self.graphed = mode in CUDA_GRAPH_MODES

    def loss(self, piece) -> torch.Tensor:
        __tracebackhide__ = True  # noqa: F841
        return self.objective.loss(self.model, piece, self.loss_fn)

    def whole_step(self, stepper, batch) -> None:
        return None

    def close(self) -> None:
        pass  # the compiled module goes with the engine; torch's caches stay for a later compile

    @staticmethod
    def failure_warning(error: BaseException) -> str:
        return f"gpunb: torch.compile failed on this model, so training goes on eager: {error_text(error)}"

    @staticmethod
    def failure_reason(error: BaseException, reason: str) -> str:
        """What the result says after the failure (`reason`: what it said before)."""
        return f"compiled step failed ({error_text(error)}); eager from then on"


class CheckError(RuntimeError):
    """The compiled step's loss or gradients differ from the eager step's."""


class CheckedEngine(CompiledEngine):
    """A compiled engine whose first micro-batch is checked against the eager engine's before it
    counts: both compute the loss and the gradients of that micro-batch, from the same random
    state and the same buffers, and they must agree within `tolerance` (relative; rounding
    differs between fused and unfused kernels); else CheckError, and the stepper goes on eager
    with a warning. A forward that draws random numbers (dropout) draws others once compiled,
    so such a model is checked loosely: finite, and a loss of the same size; under CUDA graphs
    ("reduce-overhead") the loss alone is checked. The compile itself
    happens in that first call, inside `cache()` (the Inductor cache directory to use)."""

    def __init__(self, eager: EagerEngine, mode, backend, tolerance: float, cache, validation: bool = False):
        super().__init__(eager, mode, backend, validation=validation)
        self.tolerance, self.cache, self.unchecked = tolerance, cache, True

    def loss(self, piece) -> torch.Tensor:
        __tracebackhide__ = True  # noqa: F841
        if self.unchecked:
            self.unchecked = False
            with self.cache():
                return self._checked_loss(piece)
        return self.objective.loss(self.model, piece, self.loss_fn)

    def _checked_loss(self, piece) -> torch.Tensor:
        """Eager and compiled passes on `piece`, compared, each from the same random state and
        buffers; then the step's own compiled pass (a compiled backward runs once per forward:
        Inductor reuses, "donates", the buffers it saved)."""
        model = self.eager.model
        params = [p for p in model.parameters() if p.requires_grad]
        buffers = [(b, b.clone()) for b in model.buffers()]
        devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        passes = []
        for forward in (self.eager.loss, lambda batch: self.objective.loss(self.model, batch, self.loss_fn)):
            with torch.random.fork_rng(devices=devices):  # each pass draws the numbers the step will
                loss = forward(piece)
                # a CUDA graph's backward replays into memory the next replay reuses: its loss alone is checked
                grads = None if self.graphed and passes else torch.autograd.grad(loss, params, allow_unused=True)
            passes.append((loss.detach(), grads))
            with torch.no_grad():
                for buffer, saved in buffers:  # the pass's updates (running statistics) undone
                    buffer.copy_(saved)
        (reference, expected), (checked, got) = passes
        why = mismatch(reference, checked, expected, got, self.tolerance, loose=draws_random(model))
        if why:
            raise CheckError(why)
        return self.objective.loss(self.model, piece, self.loss_fn)

    @staticmethod
    def failure_warning(error: BaseException) -> str:
        if isinstance(error, CheckError):
            return f"gpunb: the compiled step disagrees with the eager step, so training goes on eager: {error}"
        return CompiledEngine.failure_warning(error)


def mismatch(reference, loss, expected, got, tolerance: float, loose: bool = False) -> str | None:
    """Why a compiled step's loss and gradients differ from the eager step's (None: they agree).
    Gradients are compared as a whole: the norm of their difference over the eager norm (`got`
    None: not compared)."""
    pairs = [(e.float(), g.float()) for e, g in zip(expected, got or ()) if e is not None and g is not None]
    pairs = pairs or [(torch.zeros(()), torch.zeros(()))]
    difference = torch.stack([(g - e).square().sum() for e, g in pairs]).sum()
    size = torch.stack([e.square().sum() for e, _ in pairs]).sum()
    finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(difference))  # one host sync, once
    if not finite:
        return f"the compiled step's loss or gradients are not finite (loss {float(loss):.4g})"
    ref, value = float(reference), float(loss)
    loss_tolerance = 0.25 if loose else tolerance
    if abs(value - ref) > loss_tolerance * abs(ref) + 1e-6:
        return f"loss {value:.6g} against the eager step's {ref:.6g}"
    relative = float(difference.sqrt() / size.sqrt().clamp_min(1e-12))
    if not loose and got is not None and relative > tolerance:
        return f"the gradients differ by {relative:.2g} of their norm (tolerance {tolerance:g})"
    return None


def draws_random(model: torch.nn.Module) -> bool:
    """Whether the model's training forward draws random numbers (dropout that drops)."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
               for m in model.modules())


class GraphEngine:
    """The whole step (forward, backward, clipping, update) as one CUDA graph (step_graph.py),
    captured at the first step once the optimizer has state (an eager step makes it), then
    replayed for batches of the captured shapes; other batches run eagerly. Validation is eager."""

    whole_steps = True
    graphed = compiles = False

    def __init__(self, eager: EagerEngine):
        self.eager, self.model, self.eval_model = eager, eager.model, eager.eval_model
        self.graph = None

    def loss(self, piece) -> torch.Tensor:
        __tracebackhide__ = True  # noqa: F841
        return self.eager.loss(piece)

    def whole_step(self, stepper, batch) -> torch.Tensor | None:
        """The step by the graph (captured first); None: run it eagerly. Raises CaptureError when
        the step cannot be captured, or its replays must end."""
        if self.graph is None:
            if not stepper.optimizer.state:  # capture needs the state an eager step makes
                return None
            self.graph = StepGraph(stepper, batch)
        return self.graph.replay(batch)

    def close(self) -> None:
        self.graph = None  # its memory pool goes with it

    @staticmethod
    def failure_warning(error: BaseException) -> str:
        return ("gpunb: the training step could not run as one CUDA graph, so training goes on eager: "
                f"{error_gist(error)}")

    @staticmethod
    def failure_reason(error: BaseException, reason: str) -> str:
        return f"{reason}; no CUDA graph of the step ({error_gist(error)}), eager from then on"


def error_gist(error: BaseException) -> str:
    """The message's first line, and the next when the first only introduces it (Dynamo's
    "backend='inductor' raised:")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines[0] = f"{lines[0]} {lines[1]}"
    return lines[0][:300] if lines else ""


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error_gist(error)}"
