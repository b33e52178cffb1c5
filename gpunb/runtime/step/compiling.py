"""torch.compile in a run: forced from the first step, or `compile="auto"`: when it pays.

`compile="auto"` on one CUDA device starts eager. After WARMUP_STEPS steps it times
TIMED_STEPS steps one by one, each between two syncs (the only syncs it adds, once per
run). The last PROBED_STEPS of them are queued behind a short GPU sleep, so that the host
has issued all of the step before the GPU starts it: the time the GPU then takes is its
busy time, free of any wait on the host. A step whose GPU is busy for less than half of
it is launch-bound: the GPU waits on Python. Such a step is captured whole, forward,
backward and optimizer, as one CUDA graph (step_graph.py: no compile, so it pays at
once), or where that is not possible the model's forward and backward are
(`torch.compile(mode="reduce-overhead")`). Otherwise the default mode fuses elementwise
ops, when the time the remaining steps would save, at a modest assumed speed-up, is well
above the compile's expected cost (what the same model cost to compile earlier in this
process, else an estimate from its size). Then the new steps are timed the same way;
slower than eager, the run goes back to eager.

Whatever the mode, a compiled step that raises (an op Dynamo or Inductor cannot handle,
a capture that is not possible) is replayed eagerly and the run goes on eager, with a
warning that says why. A model whose own code fails fails again eagerly, with its own
traceback. `TrainResult.compilation` says what happened: when, in which mode, how long
the compile took and the measured speed-up.

Where the run has a `loss_fn`, it is compiled too, as a graph of its own beside the model's.
Only the training step is compiled under "auto" (validation runs eager: a second graph
for eval mode would cost another compile); a forced compile covers validation's model too.
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

from gpunb.runtime.step import step_graph

WARMUP_STEPS = 5  # eager steps before timing: allocator growth, cuDNN autotuning, lazy inits
TIMED_STEPS = 8  # steps timed one by one, eager and then compiled
PROBED_STEPS = 3  # of the eager ones on CUDA, the last few: timed behind a GPU sleep for the GPU's busy time
COMPILED_WARMUP = 3  # compiled steps before timing them: the compile, CUDA-graph recording
LAUNCH_BOUND = 0.5  # GPU busy time over step time below this: the GPU waits on the host
ASSUMED_SPEEDUP = {True: 1.3, "reduce-overhead": 1.8, "step-graph": 2.0}  # what deciding counts on (measured after)
CAPTURE_STEPS = 3  # a step graph's cost, in eager steps: its warm-up passes and the capture
PAYBACK_MARGIN = 1.5  # the saving must exceed the expected compile time this many times
SHORTEST_RUN = WARMUP_STEPS + 2 * TIMED_STEPS + COMPILED_WARMUP + 1  # time, compile, check, then gain
BACKEND = "inductor"
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay CUDA graphs

_measured_compile_s: dict = {}  # model signature -> seconds its last compile took in this process


@dataclass
class Decision:
    mode: object  # None (stay eager), True (default mode) or "reduce-overhead"
    reason: str


def decide(step_s: float, gpu_share: float | None, remaining_steps: int, expected_compile_s: float,
           cuda_graphs: bool = True, graph_blocker: str | None = None) -> Decision:
    """Whether to compile or capture, and how, from eager timings and the steps left.
    `gpu_share`: the GPU's busy time over the step time (None: not measured, taken as GPU-bound);
    `cuda_graphs=False`: the default mode even when launch-bound; `graph_blocker`: why the whole step
    cannot be one CUDA graph (None: it can)."""
    launch_bound = gpu_share is not None and gpu_share < LAUNCH_BOUND
    why = (f"launch-bound: the GPU was busy {100 * gpu_share:.0f}% of each step, waiting on the host the rest"
           if launch_bound else "GPU-bound" + (f": the GPU was busy {100 * gpu_share:.0f}% of each step"
                                               if gpu_share is not None else ""))
    if launch_bound and cuda_graphs and not graph_blocker:
        mode, expected_compile_s = "step-graph", CAPTURE_STEPS * step_s  # no compile: a capture
    elif launch_bound and cuda_graphs:
        mode, why = "reduce-overhead", f"{why}; the whole step is not one graph: {graph_blocker}"
    else:
        mode = True
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
        run.stepper.on_graph_error = self.graph_failed
        self.timings = self.signature = None
        if self.requested is False:
            self.info["reason"] = "compile=False"
        elif self.requested == "step-graph" and (why := step_graph.blocker(run.stepper, world_size)):
            self.info["reason"] = f"eager: no CUDA graph of the step ({why})"
            warnings.warn(f"gpunb: compile='step-graph' cannot capture this run's step, so it trains eager: {why}",
                          RuntimeWarning, stacklevel=3)
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
        """Compile the model in `mode`, or with "step-graph" capture the training step at its next
        batch (validation stays eager: a graph holds one step's work)."""
        self.counts_before = _torch_counts()
        self.info.update(mode="default" if mode is True else mode, at_step=at_step)
        if mode == "step-graph":
            self.run.stepper.use_step_graph(True)
            return
        options = {"mode": mode} if isinstance(mode, str) else {}
        compiled = torch.compile(self.eager, backend=BACKEND, **options)
        self.run.stepper.use_model(compiled, cuda_graphs=mode in CUDA_GRAPH_MODES)
        objective = self.run.objective
        if objective.loss_fn is not None:
            # The loss compiled too, as a graph of its own: a language model's cross-entropy is
            # then one fused pass over its logits (the cast to fp32, log-softmax and the pick of
            # each target's log-probability; and back) instead of several, each as large as the
            # logits. nanoGPT gets the same by computing its loss inside the compiled forward.
            objective.train_loss_fn = torch.compile(objective.loss_fn, backend=BACKEND, **options)
        if not training_only:  # validation and callbacks see the compiled module too
            self.run.train_model = self.run.state.model = compiled

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

    def graph_failed(self, error: BaseException) -> None:
        """The step could not be captured as one CUDA graph, or its replays had to end: eager from
        then on (the stepper runs the step at hand eagerly)."""
        why = _gist(error)
        self.failed = True
        self._use_eager()
        self.info.update(mode=None, reason=f"{self.info['reason']}; no CUDA graph of the step ({why}), "
                                           "eager from then on")
        warnings.warn(f"gpunb: the training step could not run as one CUDA graph, so training goes on eager: "
                      f"{why}", RuntimeWarning, stacklevel=2)

    def _use_eager(self, keep_voting: bool = False) -> None:
        self.run.stepper.use_step_graph(False)
        self.run.stepper.use_model(self.eager, cuda_graphs=False)
        self.run.objective.train_loss_fn = self.run.objective.loss_fn
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
        elif self.timings.probing:
            self.run.stepper.before_step = self.timings.start_probe

    def _after_eager_timing(self, state) -> None:
        step_s, gpu_share = self.timings.result()
        self.info["eager_step_ms"] = 1000 * step_s
        if state.total_steps is None:
            self._stay_eager("eager: the run's length is unknown (give max_steps, or data with a length)")
            return
        model = self.run.model
        self.signature = signature_of(model, self.run.batch_size)
        # a partial last batch is a second shape: a second compile (and CUDA graph)
        expected = expected_compile_s(model, self.signature) * (2 if _partial_last_batch(self.run) else 1)
        decision = decide(step_s, gpu_share, state.total_steps - state.step, expected,
                          cuda_graphs=self.world_size == 1,
                          graph_blocker=step_graph.blocker(self.run.stepper, self.world_size))
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
        if self.info["mode"] != "step-graph":  # a capture is no compile
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
    """Times steps one by one after a warm-up: their wall time and, on CUDA, the GPU's busy time."""

    def __init__(self, device):
        self.device = device

    def restart(self, step: int, warmup: int, compiling: bool = False) -> None:
        """Time again from `step`; `compiling`: the next step compiles, and its time is kept (and
        the GPU's busy time is not probed: it is the eager step's that decides)."""
        self.start, self.warmup, self.samples, self.busy = step, warmup, [], []
        self.first_step_s, self.compiling = None, compiling
        self.probes = PROBED_STEPS if self.device.type == "cuda" and not compiling and _can_sleep() else 0
        self.probe = None  # the event after the sleep the step in progress is queued behind
        self.probing = False  # the next step is to be probed: start_probe at its start
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
        if self.probe is not None:  # the GPU ran this step from the sleep's end, all of it queued
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            self.busy.append(self.probe.elapsed_time(end) / 1000)
            self.probe = None
        else:
            now = self._synced_now()
            self.samples.append(now - self.mark)
            self.mark = now
        if len(self.samples) + len(self.busy) >= TIMED_STEPS:
            return True
        self.probing = len(self.samples) >= TIMED_STEPS - self.probes
        return False

    def start_probe(self) -> None:
        """At a probed step's start (after any sync of the last step's end, such as a log's): the
        GPU sleeps while the host issues the step."""
        self.probe = _sleep_then_mark(self.device, 2 * statistics.median(self.samples))

    def result(self) -> tuple[float, float | None]:
        """(median step seconds, median GPU busy time over it; None where not probed)."""
        step_s = statistics.median(self.samples)
        busy = min(1.0, statistics.median(self.busy) / step_s) if self.busy and step_s else None
        return step_s, busy

    def _synced_now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


_sleep_cycles_per_s: dict = {}  # device index -> the rate of torch.cuda._sleep, measured once


def _can_sleep() -> bool:
    return hasattr(torch.cuda, "_sleep")  # private, but in every release since 1.x


def _sleep_then_mark(device, seconds: float):
    """Queue a GPU sleep of about `seconds` (at most 0.5 s), then an event: work issued after
    it waits on the GPU, so its time from the event is the GPU's busy time alone."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sleep_cycles_per_s:
        cycles, begin, end = 20_000_000, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _sleep_cycles_per_s[index] = cycles / (begin.elapsed_time(end) / 1000)
    torch.cuda._sleep(int(_sleep_cycles_per_s[index] * min(seconds, 0.5)))
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark


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
