"""compile= in a run: which engine the step runs on (engines.py), and what the result says of it.

A forced mode (`compile=True`, "reduce-overhead", "max-autotune", "step-graph") starts
the run on its engine (in one process, compiled beside the first steps: below). `compile="auto"` on one CUDA device starts eager and is a callback:
it times the first steps (step_timing.py), decides (compile_decision.py), asks the loop for
the chosen engine at that step's end, times the new steps the same way, and asks for eager
again when they are slower. It never touches the run's objects: after each step's callbacks
the loop takes its request (`asking`, `take_request`), switches the stepper's engine and,
once it has decided and checked, stops calling it.

In one process a compile runs beside the eager steps (compile_beside.py): the first step
keeps a micro-batch of the training shapes; after the eager steps are timed, a spawned
worker compiles the step into the Inductor cache directory it shares with this process,
while training goes on eagerly; at the first step end after it is done, the loop switches
to a compiled engine that compiles from that warm cache and checks its first micro-batch
against eager (engines.CheckedEngine). The stall left is that compile; it is what
compile="auto" now pays for, so it compiles early. A step compiled here before loads its
artifacts (compile_cache.py) and compiles at once; where the worker would not fit on the
GPU, or the model cannot be sent, the compile is inline, as with GPUNB_COMPILE_BESIDE=0.

Whatever the mode, a compiled step that raises (an op Dynamo or Inductor cannot handle, a
capture that is not possible) is replayed eagerly by the stepper, which goes on eager with
a warning that says why; a model whose own code fails fails again eagerly, with its own
traceback. `report()` (`TrainResult.compilation`) says what happened: when, in which mode,
how long the compile took and the measured speed-up.

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

import os
import time
import warnings

from gpunb.runtime.step import compile_cache, step_graph
from gpunb.runtime.step.compile_beside import Sampling, Worker, memory_blocker
from gpunb.runtime.step.compile_decision import (Decision, auto_blocker, decide, expected_compile_s,
                                                 partial_last_batch, record_compile_s, signature_of)
from gpunb.runtime.step.engines import CheckedEngine, CompiledEngine, GraphEngine
from gpunb.runtime.step.step_timing import COMPILED_WARMUP, WARMUP_STEPS, Probed, StepTimings

BACKEND = "inductor"
TOLERANCE = {True: 1e-3, False: 5e-2}  # the first compiled step against eager: fp32, and under autocast


def beside_enabled() -> bool:
    """Compile beside eager steps (one process); GPUNB_COMPILE_BESIDE=0: compile inline, stalling."""
    return os.environ.get("GPUNB_COMPILE_BESIDE", "1") != "0"


class Compilation:
    """Decides the step's engine, asks the loop for it, and reports. `model`: the user's module
    (its size and shapes key the compile-time estimate); `feed`: whether epochs end short."""

    def __init__(self, config, stepper, dist, model, feed, batch_size: int, total_steps: int | None, device):
        self.stepper, self.dist, self.world_size = stepper, dist, dist.world_size
        self.eager = stepper.engine  # the stepper starts eager
        self.model, self.feed, self.batch_size = model, feed, batch_size
        self.requested = config.compile
        self.info = {"requested": self.requested, "mode": None, "at_step": None, "compile_s": None,
                     "speedup": None, "eager_step_ms": None, "compiled_step_ms": None, "reason": ""}
        self.asking = False  # a request for the loop: another engine, or to stop calling this callback
        self.wanted, self.done = None, False  # what is asked: the engine from the next step on; done
        self.failed = False  # the engine failed here (a vote for eager in multi-process runs)
        self.timings = self.signature = self.counts_before = None
        self.device, self.beside = device, self.world_size == 1 and beside_enabled()
        self.worker = self.key = self.piece = None  # the compile worker; its cache key; a training micro-batch
        self.validation = False  # the compiled engine serves validation too (forced modes)
        if self.requested is False:
            self.info["reason"] = "compile=False"
        elif self.requested == "step-graph" and (why := step_graph.blocker(stepper, self.world_size)):
            self.info["reason"] = f"eager: no CUDA graph of the step ({why})"
            warnings.warn(f"gpunb: compile='step-graph' cannot capture this run's step, so it trains eager: {why}",
                          RuntimeWarning, stacklevel=3)
        elif self.requested != "auto" and not (self.beside and self.requested != "step-graph"):
            self._compile(self.requested, at_step=0, validation=True)
            self.info["reason"] = f"compile={self.requested!r}"
        elif self.requested != "auto":  # eager first steps, timed; compiled once compiled beside them
            self.timings = StepTimings(device)
            self.info["reason"] = "eager: the run ended while its first steps were being timed, before the compile"
            self._ask(Sampling(self.eager))
        elif blocker := auto_blocker(device, self.world_size, total_steps, getattr(dist, "strategy", "ddp")):
            self.info["reason"] = blocker
        else:
            self.timings = StepTimings(device)  # started at on_fit_start, from the step the fit starts at
            self.info["reason"] = "eager: the run ended while its first steps were being timed"
            if self.beside:
                self._ask(Sampling(self.eager))

    @property
    def timing(self) -> bool:
        """compile="auto" (or a compile beside eager steps) times this run's steps: the loop adds
        this object to its callbacks."""
        return self.timings is not None

    def take_request(self) -> tuple:
        """(the engine to run from the next step on or None, whether this callback is done); the
        loop takes it at a step boundary."""
        request, self.wanted, self.asking = (self.wanted, self.done), None, False
        return request

    def _ask(self, engine=None, done: bool = False) -> None:
        self.wanted = engine if engine is not None else self.wanted
        self.done, self.asking = done or self.done, True

    def report(self) -> dict:
        """What the result says: `info`, with what torch did while compiled (graph breaks, parts
        it ran without CUDA graphs)."""
        self._stop_worker("the run ended while the step compiled beside it")
        self._note_failure()
        info = dict(self.info)
        if info["mode"] is not None and self.counts_before is not None:
            breaks, skips = (now - before for now, before in zip(_torch_counts(), self.counts_before))
            info.update(graph_breaks=breaks, cuda_graph_skips=skips)
            if breaks:
                info["reason"] += f"; torch split the model at {breaks} graph break(s), each a return to Python"
            if skips and (why := cudagraph_skip_reason()):
                info["reason"] += f"; torch ran parts without CUDA graphs: {why}"
        return info

    def _compile(self, mode, at_step: int, validation: bool = False) -> None:
        """Ask for the engine of `mode`: "step-graph" captures the training step at its next batch
        (validation stays eager: a graph holds one step's work); any other compiles the model,
        beside the eager steps where it can (one process, a training micro-batch at hand)."""
        self.info.update(mode="default" if mode is True else mode, at_step=at_step)
        if mode == "step-graph" or self.piece is None:
            self.counts_before = _torch_counts()
            self._ask(GraphEngine(self.eager) if mode == "step-graph"
                      else CompiledEngine(self.eager, mode, BACKEND, validation=validation))
            if self.info["eager_step_ms"] is not None:  # compile="auto" times the new steps
                self.timings.restart(at_step, warmup=COMPILED_WARMUP, compiling=True)
            return
        self.validation, precision = validation, self.stepper.precision
        self.key = compile_cache.key_of(self.model, self.piece, precision.name, mode, self.device)
        if compile_cache.load(self.key):  # compiled here before: from the warm cache at once
            self.info["cache"] = "hit"
            self._switch(at_step, "from the compile cache")
            return
        blocker = memory_blocker(self.device)
        from gpunb.runtime.step import compile_worker  # here: it imports cloudpickle, which eager runs never need

        try:
            payload = None if blocker else compile_worker.ship(self.model, self.stepper.objective, self.piece,
                                                               precision.dtype, mode, BACKEND)
        except Exception as error:  # noqa: BLE001 - something the model holds cannot be pickled
            blocker = f"the model could not be sent to a compile worker ({type(error).__name__}: {error})"
        if blocker:
            self._switch(at_step, f"compiled inline, stalling training: {blocker}")
            return
        self.worker = Worker(payload, compile_cache.inductor_dir())

    def _switch(self, step: int, how: str) -> None:
        """Ask for the compiled engine from the next step on (it compiles in its first step, from
        the cache the worker warmed), and time its steps."""
        self.counts_before = _torch_counts()
        directory = compile_cache.inductor_dir()
        tolerance = TOLERANCE[self.stepper.precision.dtype is None]
        self._ask(CheckedEngine(self.eager, self.wanted_mode(), BACKEND, tolerance,
                                lambda: compile_cache.inductor_cache(directory), validation=self.validation))
        self.info.update(at_step=step, beside=how)
        self.timings.restart(step, warmup=COMPILED_WARMUP, compiling=True)

    def wanted_mode(self):
        return True if self.info["mode"] == "default" else self.info["mode"]

    def _poll(self, state) -> None:
        """At a step end while the worker compiles: switch once it is done, or stay eager when it failed."""
        answer = self.worker.poll()
        if answer is None:
            return
        seconds, self.worker = time.perf_counter() - self.worker.began, None
        if answer[0] == "ok":
            compile_cache.save(self.key, answer[2])
            self._switch(state.step, f"compiled beside training in {seconds:.1f} s")
            return
        warnings.warn(f"gpunb: the compile beside training failed, so training goes on eager: {answer[1]}",
                      RuntimeWarning, stacklevel=2)
        self._stay_eager(f"{self.info['reason']}; the compile beside training failed ({answer[1]}), "
                         "eager from then on")
        self.info["mode"] = None

    def _stop_worker(self, reason: str) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
            self.info.update(mode=None, at_step=None, reason=f"eager: {reason} ({self.info['reason']})")

    def _note_failure(self) -> bool:
        """When the stepper's engine failed (it went on eager), the result says why, once. True:
        nothing is left to do here (a multi-process run still votes after its compiled timing)."""
        if self.stepper.failure is None or self.failed:
            return False
        engine, error = self.stepper.failure
        self.failed = True
        self.info.update(mode=None, reason=engine.failure_reason(error, self.info["reason"]))
        return not (self.world_size > 1 and self.info["compiled_step_ms"] is None)  # votes after its timing

    def _agreed(self, yes: bool) -> bool:
        """Whether every process says yes (one all-reduce in multi-process runs)."""
        return bool(self.dist.smallest(int(yes))) if self.world_size > 1 else yes

    # --- a callback until it has decided and checked the decision (compile="auto", or beside)
    def on_fit_start(self, state) -> None:
        self.timings.restart(state.step, warmup=WARMUP_STEPS)  # a resumed fit starts above 0

    def on_fit_end(self, state) -> None:
        self._stop_worker("the run ended while the step compiled beside it")

    def on_exception(self, state, error) -> None:
        self._stop_worker("the run failed while the step compiled beside it")

    def on_step_end(self, state) -> None:
        if isinstance(self.stepper.engine, Sampling):  # the first step: a micro-batch of the training shapes
            self.piece = self.stepper.engine.piece
            self._ask(self.eager)
        if self._note_failure():
            self._ask(done=True)
        elif state.profile and self.world_size == 1:  # a profiler looks at the steps as they are
            self._stay_eager("eager: the run was profiled")
        elif self.worker is not None:
            self._poll(state)
        elif self.timings.record(state.step):
            if self.info["eager_step_ms"] is None:
                self._after_eager_timing(state)
            else:
                self._after_compiled_timing()
        elif self.timings.probing:
            self._ask(Probed(self.eager, self.timings))  # the next step, behind a GPU sleep

    def _after_eager_timing(self, state) -> None:
        step_s, gpu_share = self.timings.result()
        self.info["eager_step_ms"] = 1000 * step_s
        self.signature = signature_of(self.model, self.batch_size)
        if self.requested != "auto":  # forced: compiled from here (beside the steps)
            self.info["reason"] = f"compile={self.requested!r}"
            self._compile(self.requested, at_step=state.step, validation=True)
            return
        if state.total_steps is None:
            self._stay_eager("eager: the run's length is unknown (give max_steps, or data with a length)")
            return
        # beside eager steps, the price of compiling is the stall at the switch; a partial last
        # batch is a second shape: a second compile (and CUDA graph), inline
        expected = expected_compile_s(self.model, self.signature, beside=self.piece is not None)
        if partial_last_batch(self.feed):
            expected += expected_compile_s(self.model, self.signature)
        decision = decide(step_s, gpu_share, state.total_steps - state.step, expected,
                          cuda_graphs=self.world_size == 1,
                          graph_blocker=step_graph.blocker(self.stepper, self.world_size))
        if state.profile:  # the processes of a profiled run vote for eager
            decision = Decision(None, "eager: the run was profiled")
        if not self._agreed(decision.mode is not None):
            self._stay_eager(decision.reason if decision.mode is None
                             else "eager: another process found that compiling would not pay")
            return
        self.info["reason"] = decision.reason
        self._compile(decision.mode, at_step=state.step)

    def _after_compiled_timing(self) -> None:
        self._ask(done=True)
        if self.failed:  # eager since the failure (the reason says why); its vote still counts
            self._agreed(False)
            return
        step_s, _ = self.timings.result()
        eager_s = self.info["eager_step_ms"] / 1000
        compile_s = max(0.0, self.timings.first_step_s - eager_s)  # beside the steps: the stall at the switch
        if self.info["mode"] != "step-graph":  # a capture is no compile
            record_compile_s(self.signature, compile_s)
        speedup = eager_s / step_s
        self.info.update(compiled_step_ms=1000 * step_s, compile_s=compile_s, speedup=speedup)
        if self.info.get("beside"):
            self.info["reason"] += (f"; {self.info['beside']}, switched at step {self.info['at_step']}, "
                                    f"remaining stall {compile_s:.1f} s, speed-up {speedup:.2f}x")
        if self.requested != "auto":
            return  # forced: compiled, faster or not
        if not self._agreed(speedup >= 1.0):
            self._ask(self.eager)
            why = (f"compiled steps were slower ({speedup:.2f}x)" if speedup < 1.0
                   else "another process found its compiled steps slower, or failing")
            self.info.update(mode=None, reason=f"{self.info['reason']}; {why}, so the run went back to eager")

    def _stay_eager(self, reason: str) -> None:
        self._stop_worker("stopped")
        self.info["reason"] = reason
        self._ask(self.eager, done=True)  # eager after a probed step too


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
