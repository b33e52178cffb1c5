"""torch.compile in a run: forced from the first step, or `compile="auto"`: when it pays.

`compile="auto"` on one CUDA device starts eager. After WARMUP_STEPS steps it times
TIMED_STEPS steps one by one, each between two syncs (the only syncs it adds, once per
run): the step's wall time, and the share of it the host spent issuing the work. A step
whose GPU work ends about when the host finishes issuing it is launch-bound: the GPU
waits on Python, and a CUDA graph (`torch.compile(mode="reduce-overhead")`) replays the
whole forward and backward in one launch. Otherwise the default mode fuses elementwise
ops. The model is compiled when the time the remaining steps would save, at a modest
assumed speed-up, is well above the compile's expected cost (what the same model cost to
compile earlier in this process, else an estimate from its size). Then the compiled
steps are timed the same way; slower than eager, the run goes back to eager.

Whatever the mode, a compiled step that raises (an op Dynamo or Inductor cannot handle,
a capture that is not possible) is replayed eagerly and the run goes on eager, with a
warning that says why. A model whose own code fails fails again eagerly, with its own
traceback. `TrainResult.compilation` says what happened: when, in which mode, how long
the compile took and the measured speed-up.

Only the training step is compiled under "auto" (validation runs eager: a second graph
for eval mode would cost another compile); a forced compile covers validation too.
Torch's compile caches (Dynamo's, the FX graph and AOTAutograd caches) are left on, so
compiling the same model again in the kernel reuses them.

Under DDP every process times its own steps and the processes vote (one all-reduce at
each of the two decisions, at the same step on every rank): all compile, or none, and
all keep the compiled step only if it is faster on every one. A process whose compiled
step failed votes to go back to eager. CUDA graphs are left out (the all-reduce hooks
run between the graphs), and FSDP runs compile only when asked to.
"""

from __future__ import annotations

import statistics
import time
import warnings
import weakref
from dataclasses import dataclass

import torch

WARMUP_STEPS = 5  # eager steps before timing: allocator growth, cuDNN autotuning, lazy inits
TIMED_STEPS = 8  # steps timed one by one, eager and then compiled
COMPILED_WARMUP = 3  # compiled steps before timing them: the compile, CUDA-graph recording
LAUNCH_BOUND = 0.8  # host issue time over step time above this: the GPU waits on the host
ASSUMED_SPEEDUP = {True: 1.3, "reduce-overhead": 1.8}  # what deciding counts on (measured after)
PAYBACK_MARGIN = 1.5  # the saving must exceed the expected compile time this many times
SHORTEST_RUN = WARMUP_STEPS + 2 * TIMED_STEPS + COMPILED_WARMUP + 1  # time, compile, check, then gain
BACKEND = "inductor"
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay CUDA graphs

_measured_compile_s: dict = {}  # model signature -> seconds its last compile took in this process


@dataclass
class Decision:
    mode: object  # None (stay eager), True (default mode) or "reduce-overhead"
    reason: str


def decide(step_s: float, host_share: float, remaining_steps: int, expected_compile_s: float,
           cuda_graphs: bool = True) -> Decision:
    """Whether to compile, and in which mode, from eager timings and the steps left
    (`cuda_graphs=False`: the default mode even when launch-bound)."""
    launch_bound = host_share >= LAUNCH_BOUND
    mode = "reduce-overhead" if launch_bound and cuda_graphs else True
    why = (f"launch-bound: the host spent {100 * host_share:.0f}% of each step issuing work"
           if launch_bound else f"GPU-bound: the host issued each step in {100 * host_share:.0f}% of its time")
    saving = remaining_steps * step_s * (1 - 1 / ASSUMED_SPEEDUP[mode])
    if saving < PAYBACK_MARGIN * expected_compile_s:
        return Decision(None, f"eager: the remaining {remaining_steps} steps (~{remaining_steps * step_s:.0f} s "
                              f"at {1000 * step_s:.1f} ms) would save ~{saving:.0f} s at a "
                              f"{ASSUMED_SPEEDUP[mode]}x speed-up, too little for a ~{expected_compile_s:.0f} s "
                              f"compile ({why})")
    return Decision(mode, why)


def auto_blocker(device, world_size: int, total_steps: int | None, strategy: str = "ddp") -> str | None:
    """Why compile="auto" keeps this run eager from the start; None: it times the steps."""
    if device.type != "cuda":
        return f"eager: compile='auto' compiles on CUDA only (this run is on {device.type})"
    if world_size > 1 and strategy == "fsdp":
        return "eager: FSDP runs compile only with compile=True"
    if total_steps is not None and total_steps < SHORTEST_RUN:
        return f"eager: {total_steps} steps are too few to time and then compile"
    return None


def expected_compile_s(model: torch.nn.Module, signature) -> float:
    """What the same model cost to compile earlier in this process (the caches only make it
    cheaper), else 10 s plus 0.25 s per leaf module (GPT-2 124M: ~30 s on an H100)."""
    if signature in _measured_compile_s:
        return _measured_compile_s[signature]
    leaves = sum(1 for m in model.modules() if next(m.children(), None) is None)
    return 10.0 + 0.25 * leaves


def signature_of(model: torch.nn.Module, batch_size) -> tuple:
    """The same model class, parameter shapes and batch size: what torch's caches key on."""
    shapes = tuple((name, tuple(p.shape), p.dtype) for name, p in model.named_parameters())
    return type(model).__qualname__, hash(shapes), batch_size


class Compilation:
    """Owns which module the training step calls: the eager one or its compiled form."""

    def __init__(self, run, device, world_size: int):
        # The run owns this object: a weak reference back keeps the two out of a reference cycle,
        # so that the run's GPU memory (resident data, optimizer state) goes when fit returns
        self.run, self.eager, self.world_size = weakref.proxy(run), run.stepper.model, world_size
        self.failed = False  # a compiled step raised here (a vote for eager in multi-process runs)
        self.requested = run.config.compile
        self.info = {"requested": self.requested, "mode": None, "at_step": None, "compile_s": None,
                     "speedup": None, "eager_step_ms": None, "compiled_step_ms": None, "reason": ""}
        run.stepper.on_model_error = self.fall_back
        self.timings = self.signature = None
        if self.requested is False:
            self.info["reason"] = "compile=False"
        elif self.requested != "auto":
            self.compile(self.requested, at_step=0, training_only=False)
            self.info["reason"] = f"compile={self.requested!r}"
        elif blocker := auto_blocker(device, world_size, run.state.total_steps, run.config.strategy):
            self.info["reason"] = blocker
        else:
            self.timings = StepTimings(device)  # started at on_fit_start, from the step the fit starts at
            self.info["reason"] = "eager: the run ended while its first steps were being timed"
            run.callbacks.add(self)

    def report(self) -> dict:
        """What the result says: `info`, with what torch did while compiled (graph breaks, parts
        it ran without CUDA graphs)."""
        info = dict(self.info)
        if info["mode"] is not None:
            breaks, skips = (now - before for now, before in zip(_torch_counts(), self.counts_before))
            info.update(graph_breaks=breaks, cuda_graph_skips=skips)
            if breaks:
                info["reason"] += f"; torch split the model at {breaks} graph break(s), each a return to Python"
            if skips and (why := cudagraph_skip_reason()):
                info["reason"] += f"; torch ran parts without CUDA graphs: {why}"
        return info

    def compile(self, mode, at_step: int, training_only: bool = True) -> None:
        self.counts_before = _torch_counts()
        options = {"mode": mode} if isinstance(mode, str) else {}
        compiled = torch.compile(self.eager, backend=BACKEND, **options)
        self.run.stepper.use_model(compiled, cuda_graphs=mode in CUDA_GRAPH_MODES)
        if not training_only:  # validation and callbacks see the compiled module too
            self.run.train_model = self.run.state.model = compiled
        self.info.update(mode="default" if mode is True else mode, at_step=at_step)

    def fall_back(self, error: BaseException) -> bool:
        """A compiled step raised: go on eager (the stepper replays the step). False when the step
        was eager already: the error is the model's own."""
        if self.run.stepper.model is self.eager:
            return False
        self.failed = True
        self._use_eager(keep_voting=self.world_size > 1 and self.info["compiled_step_ms"] is None)
        what = f"{type(error).__name__}: {_gist(error)}"
        self.info.update(mode=None, reason=f"compiled step failed ({what}); eager from then on")
        warnings.warn(f"gpunb: torch.compile failed on this model, so training goes on eager: {what}",
                      RuntimeWarning, stacklevel=2)
        return True

    def _use_eager(self, keep_voting: bool = False) -> None:
        self.run.stepper.use_model(self.eager, cuda_graphs=False)
        self.run.train_model = self.run.state.model = self.eager
        if not keep_voting:  # the other processes wait for this one's vote
            self.run.callbacks.remove(self)

    def _agreed(self, yes: bool) -> bool:
        """Whether every process says yes (one all-reduce in multi-process runs)."""
        return bool(self.run.dist.smallest(int(yes))) if self.world_size > 1 else yes

    # --- compile="auto": a callback until it has decided and checked the decision
    def on_fit_start(self, state) -> None:
        self.timings.restart(state.step, warmup=WARMUP_STEPS)  # a resumed fit starts above 0

    def on_step_end(self, state) -> None:
        if state.profile and self.world_size == 1:  # a profiler looks at the steps as they are
            self._stay_eager("eager: the run was profiled")
        elif self.timings.record(state.step):
            if self.info["eager_step_ms"] is None:
                self._after_eager_timing(state)
            else:
                self._after_compiled_timing()

    def _after_eager_timing(self, state) -> None:
        step_s, host_share = self.timings.result()
        self.info["eager_step_ms"] = 1000 * step_s
        if state.total_steps is None:
            self._stay_eager("eager: the run's length is unknown (give max_steps, or data with a length)")
            return
        model = self.run.model
        self.signature = signature_of(model, self.run.batch_size)
        # a partial last batch is a second shape: a second compile (and CUDA graph)
        expected = expected_compile_s(model, self.signature) * (2 if _partial_last_batch(self.run) else 1)
        decision = decide(step_s, host_share, state.total_steps - state.step, expected,
                          cuda_graphs=self.world_size == 1)
        if state.profile:  # the processes of a profiled run vote for eager
            decision = Decision(None, "eager: the run was profiled")
        if not self._agreed(decision.mode is not None):
            self._stay_eager(decision.reason if decision.mode is None
                             else "eager: another process found that compiling would not pay")
            return
        self.compile(decision.mode, at_step=state.step)
        self.info["reason"] = decision.reason
        self.timings.restart(state.step, warmup=COMPILED_WARMUP, compiling=True)

    def _after_compiled_timing(self) -> None:
        self.run.callbacks.remove(self)
        if self.failed:  # eager since the failure (the reason says why); its vote still counts
            self._agreed(False)
            return
        step_s, _ = self.timings.result()
        eager_s = self.info["eager_step_ms"] / 1000
        compile_s = max(0.0, self.timings.first_step_s - eager_s)
        _measured_compile_s[self.signature] = compile_s
        speedup = eager_s / step_s
        self.info.update(compiled_step_ms=1000 * step_s, compile_s=compile_s, speedup=speedup)
        if not self._agreed(speedup >= 1.0):
            self._use_eager()
            why = (f"compiled steps were slower ({speedup:.2f}x)" if speedup < 1.0
                   else "another process found its compiled steps slower, or failing")
            self.info.update(mode=None, reason=f"{self.info['reason']}; {why}, so the run went back to eager")

    def _stay_eager(self, reason: str) -> None:
        self.info["reason"] = reason
        self.run.callbacks.remove(self)


def _gist(error: BaseException) -> str:
    """The message's first line, and the next when the first only introduces it (Dynamo's
    "backend='inductor' raised:")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines[0] = f"{lines[0]} {lines[1]}"
    return lines[0][:300] if lines else ""


def _partial_last_batch(run) -> bool:
    """Whether an epoch ends with a smaller batch (unknown lengths count as no)."""
    feed = run.feed
    order, loader = getattr(feed, "order", None), getattr(feed, "loader", None)
    if order is not None:
        return not feed.drop_last and len(order) % feed.batch_size != 0
    try:
        return bool(not loader.drop_last and loader.batch_size and len(loader.dataset) % loader.batch_size)
    except TypeError:
        return False


class StepTimings:
    """Times steps one by one after a warm-up: wall time and the host's share issuing it."""

    def __init__(self, device):
        self.device = device

    def restart(self, step: int, warmup: int, compiling: bool = False) -> None:
        """Time again from `step`; `compiling`: the next step compiles, and its time is kept."""
        self.start, self.warmup, self.samples = step, warmup, []
        self.first_step_s, self.compiling = None, compiling
        self.mark = self._synced_now() if compiling else None

    def record(self, step: int) -> bool:
        """Called at each step's end; True once TIMED_STEPS steps are timed."""
        if self.compiling:
            self.first_step_s, self.compiling = self._synced_now() - self.mark, False
        done = step - self.start
        if done < self.warmup:
            return False
        if done == self.warmup:
            self.mark = self._synced_now()
            return False
        issued = time.perf_counter() - self.mark
        end = self._synced_now()
        self.samples.append((issued, end - self.mark))
        self.mark = end
        return len(self.samples) >= TIMED_STEPS

    def result(self) -> tuple[float, float]:
        """(median step seconds, median share of it the host spent issuing)."""
        step_s = statistics.median(total for _, total in self.samples)
        share = statistics.median(min(1.0, issued / total) if total else 1.0 for issued, total in self.samples)
        return step_s, share

    def _synced_now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _torch_counts() -> tuple[int, int]:
    """(graph breaks, graphs run without CUDA graphs) so far in this process, from Dynamo's counters."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["inductor"]["cudagraph_skips"]


def cudagraph_skip_reason() -> str | None:
    """Why torch ran a compiled graph without CUDA graphs, from its compile records (private
    API: None when it is not there)."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:
        return None
    reasons = [m.cudagraph_skip_reason for m in get_compilation_metrics()
               if getattr(m, "cudagraph_skip_reason", None)]
    return reasons[-1] if reasons else None
