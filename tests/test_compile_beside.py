"""Compiling beside eager steps: the worker, the switch at a step boundary, the check of the first
compiled step, what a dead worker or a failed compile leaves, and the compile cache in GPUNB_HOME.

The runs here train a tiny MLP until the compiled engine has run a few timed steps, then stop
(by a callback: by events, not by the clock), so they end whatever the machine's load.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import warnings

import pytest
import torch
from torch import nn

from gpunb import Trainer
from gpunb.cli import main as cli
from gpunb.runtime.step import compile_beside, compile_cache, compile_decision, compiling, step_timing
from gpunb.runtime.step.engines import CheckedEngine, EagerEngine, mismatch

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="Inductor on the CPU needs a C++ compiler")
AFTER_SWITCH = step_timing.COMPILED_WARMUP + step_timing.TIMED_STEPS + 2  # steps that time the compiled engine
GIVE_UP_S = 600  # a safety net only: a run that never switches fails its assertions
PAUSE_S = 0.02  # each eager step leaves the (shared, small) CPU to the worker a while


@pytest.fixture(autouse=True)
def _beside(monkeypatch):
    monkeypatch.setenv("GPUNB_COMPILE_BESIDE", "1")
    monkeypatch.setattr(compile_decision, "_measured_compile_s", {})
    torch._dynamo.reset()


def _data(n=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :2].sum(1) > 0).long()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


class _Events:
    """What the compile beside did, step by step: the worker's start and the switch; stops the run
    AFTER_SWITCH steps after the switch (or `stop_at` steps after the worker started, or once the
    worker has ended: `stop_when_gone`)."""

    def __init__(self, monkeypatch, stop_at=None, on_start=None, stop_when_gone=False):
        self.workers, self.switched, self.steps, self.stop_when_gone = [], [], 0, stop_when_gone
        self.stop_at, self.on_start, self.began = stop_at, on_start, time.monotonic()
        start, switch = compile_beside.Worker.__init__, compiling.Compilation._switch

        def started(worker, *args):
            start(worker, *args)
            self.workers.append((worker, self.steps))

        def switching(compilation, step, how):
            self.switched.append(step)
            switch(compilation, step, how)

        monkeypatch.setattr(compile_beside.Worker, "__init__", started)
        monkeypatch.setattr(compiling.Compilation, "_switch", switching)

    def on_step_end(self, state):
        self.steps = state.step
        if not self.switched:
            time.sleep(PAUSE_S)
        if self.workers and self.on_start is not None and state.step == self.workers[0][1] + 1:
            self.on_start(self.workers[0][0])
        ends = [s + AFTER_SWITCH for s in self.switched] + ([self.workers[0][1] + self.stop_at]
                                                            if self.workers and self.stop_at else [])
        if self.stop_when_gone and self.workers and _gone(self.workers[0][0]):
            self.gone_at = getattr(self, "gone_at", state.step)
        gone = getattr(self, "gone_at", None) is not None and state.step >= self.gone_at + 5  # its answer read
        if gone or any(state.step >= end for end in ends) or time.monotonic() - self.began > GIVE_UP_S:
            state.request_stop("stopped")


def _fit(model, events=None, **options):
    options = {"max_steps": 10**6, "batch_size": 32, "log_every": 1, "track": False, "lr": 1e-2,
               "compile": True, **options}
    return Trainer(**options).fit(model, _data(), loss_fn=nn.CrossEntropyLoss(),
                                  callbacks=[events] if events else [])


def _gone(worker) -> bool:
    return worker.process.poll() is not None


@needs_compiler
@pytest.mark.timeout(900)
def test_training_runs_eagerly_while_the_worker_compiles_then_switches_and_a_second_run_loads_the_cache(
        monkeypatch):
    events = _Events(monkeypatch)
    result = _fit(_model(), events)
    info = result.compilation
    (worker, started_at), = events.workers
    assert _gone(worker)
    timed = step_timing.WARMUP_STEPS + step_timing.TIMED_STEPS
    assert started_at == timed  # the eager steps were timed first, from the first step on
    assert info["mode"] == "default" and info["at_step"] == events.switched[0] > started_at  # eager meanwhile
    assert "compiled beside training in" in info["reason"] and f"switched at step {info['at_step']}" in info["reason"]
    assert info["speedup"] is not None and info["compile_s"] is not None and info.get("cache") is None
    # the compiled steps train as the eager ones do
    eager = _fit(_model(), compile=False, max_steps=result.history[-1]["step"])
    assert [r["loss"] for r in result.history] == pytest.approx([r["loss"] for r in eager.history], rel=1e-4)

    # the same cell again (torch's in-process compile state reset, as in a new kernel): the step's
    # artifacts load, and it compiles at once after the eager timing, with no worker
    torch._dynamo.reset()
    loaded = []
    real_load = torch.compiler.load_cache_artifacts
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(real_load(data)) or loaded[-1])
    again = _Events(monkeypatch)
    second = _fit(_model(), again)
    assert again.workers == [] and second.compilation["cache"] == "hit"
    assert second.compilation["at_step"] == timed and "from the compile cache" in second.compilation["reason"]
    assert len(loaded) == 1 and loaded[0] is not None  # torch read the first run's artifacts
    assert list(compile_cache.directory().glob(f"*{compile_cache.ARTIFACTS}"))


@needs_compiler
@pytest.mark.timeout(600)
def test_a_worker_that_dies_leaves_training_eager_with_a_warning_and_no_process(monkeypatch):
    events = _Events(monkeypatch, stop_at=40, on_start=lambda worker: os.kill(worker.pid, signal.SIGKILL))
    with pytest.warns(RuntimeWarning, match="compile beside training failed.*died"):
        result = _fit(_model(), events)
    (worker, _), = events.workers
    assert _gone(worker) and events.switched == []
    assert result.compilation["mode"] is None and "died" in result.compilation["reason"]


def _failing_backend(graph_module, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


@pytest.mark.timeout(600)
def test_a_compile_that_fails_in_the_worker_leaves_training_eager_as_an_eager_run(monkeypatch):
    monkeypatch.setattr(compiling, "BACKEND", _failing_backend)
    events = _Events(monkeypatch, stop_when_gone=True)
    with pytest.warns(RuntimeWarning, match="compile beside training failed.*cannot compile"):
        result = _fit(_model(), events)
    (worker, _), = events.workers
    assert _gone(worker) and events.switched == []
    assert result.compilation["mode"] is None and "cannot compile" in result.compilation["reason"]
    steps = result.history[-1]["step"]
    eager = _fit(_model(), compile=False, max_steps=steps)
    assert [r["loss"] for r in result.history] == [r["loss"] for r in eager.history]


def test_a_run_that_ends_while_the_worker_compiles_leaves_no_process(monkeypatch):
    events = _Events(monkeypatch, stop_at=1)
    result = _fit(_model(), events)
    (worker, _), = events.workers
    assert _gone(worker)
    assert result.compilation["mode"] is None and "ended while the step compiled beside it" in result.compilation["reason"]


# --- the check of the first compiled step


def _doubling_backend(graph_module, example_inputs):
    """A 'compiler' whose code is wrong: every output twice what it should be."""
    return lambda *args: [2 * out for out in graph_module(*args)]


def _stepper():
    from gpunb.config import TrainConfig
    from gpunb.runtime.step.objective import Objective
    from gpunb.runtime.step.precision import Precision
    from gpunb.runtime.step.stepper import Stepper

    model = _model()
    return Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), Objective(loss_fn=nn.CrossEntropyLoss()),
                   Precision("32", torch.device("cpu")), schedule=None, config=TrainConfig())


def _one_step(stepper, engine=None):
    if engine is not None:
        stepper.switch(engine)
    stepper.accumulate(_batch(), last_in_step=True)
    return float(stepper.update())


def _batch():
    x, y = _data(32)
    return x, y


def test_a_compiled_step_that_disagrees_with_eager_is_replayed_eagerly_with_a_warning():
    checked, reference = _stepper(), _stepper()
    engine = CheckedEngine(checked.engine, True, _doubling_backend, 1e-3, lambda: _nothing())
    with pytest.warns(RuntimeWarning, match="disagrees with the eager step.*: loss"):
        loss = _one_step(checked, engine)
    assert isinstance(checked.engine, EagerEngine) and checked.failure is not None
    assert loss == _one_step(reference)
    for a, b in zip(checked.model.parameters(), reference.model.parameters()):
        assert torch.equal(a, b)


def test_a_compiled_step_that_agrees_goes_on_compiled():
    checked, reference = _stepper(), _stepper()
    engine = CheckedEngine(checked.engine, True, "eager", 1e-3, lambda: _nothing())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [_one_step(checked, engine), _one_step(checked)]
    assert not [w for w in caught if "gpunb" in str(w.message)]
    assert checked.engine is engine and checked.failure is None
    assert losses == pytest.approx([_one_step(reference), _one_step(reference)], rel=1e-6)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_mismatch_names_the_gradients_that_differ_and_dropout_is_checked_loosely():
    grads = [torch.ones(3), torch.ones(2)]
    assert mismatch(torch.tensor(1.0), torch.tensor(1.0), grads, grads, 1e-3) is None
    off = [torch.ones(3), torch.full((2,), 1.1)]
    assert "gradients differ by" in mismatch(torch.tensor(1.0), torch.tensor(1.0), grads, off, 1e-3)
    assert mismatch(torch.tensor(1.0), torch.tensor(1.0), grads, off, 1e-3, loose=True) is None
    assert "not finite" in mismatch(torch.tensor(1.0), torch.tensor(float("nan")), grads, grads, 1e-3, loose=True)


# --- compile="auto": the stall is the price


def test_beside_eager_steps_auto_prices_a_compile_at_its_stall_and_compiles_earlier():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(40)])  # 40 leaves: ~20 s cold by the estimate
    cold = compile_decision.expected_compile_s(model, ("sig",))
    stall = compile_decision.expected_compile_s(model, ("sig",), beside=True)
    assert stall == pytest.approx(cold * compile_decision.BESIDE_STALL_SHARE)
    step_s, remaining = 0.053, 2000  # GPT-2's eager step on an H100, ~2 minutes left
    assert compile_decision.decide(step_s, 0.9, remaining, cold).mode is None
    assert compile_decision.decide(step_s, 0.9, remaining, stall).mode is True


# --- the cache in GPUNB_HOME


def test_cache_keys_follow_structure_shapes_and_precision(gpunb_home):
    cpu = torch.device("cpu")
    piece = _batch()
    key = compile_cache.key_of(_model(), piece, "32", True, cpu)
    assert key == compile_cache.key_of(_model(), _batch(), "32", True, cpu)
    assert key != compile_cache.key_of(_model(), (piece[0][:16], piece[1][:16]), "32", True, cpu)
    assert key != compile_cache.key_of(_model(), piece, "bf16-mixed", True, cpu)
    assert key != compile_cache.key_of(_model(), piece, "32", "max-autotune", cpu)
    assert key != compile_cache.key_of(nn.Sequential(nn.Linear(8, 17), nn.ReLU(), nn.Linear(17, 2)), piece, "32",
                                       True, cpu)
    assert compile_cache.directory().is_relative_to(gpunb_home)


def test_the_cache_is_trimmed_oldest_first_and_cleared_by_the_command(capsys):
    folder = compile_cache.directory()
    (folder / "inductor").mkdir(parents=True)
    for i, name in enumerate(["old", "mid", "new"]):
        path = folder / "inductor" / name
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1000 + i, 1000 + i))
    assert compile_cache.trim(cap=2000) == 1000
    assert sorted(p.name for p in (folder / "inductor").iterdir()) == ["mid", "new"]
    compile_cache.save("k" * 32, b"y" * 10)
    assert compile_cache.load("0" * 32) is False
    assert cli(["cache", "show"]) == 0 and "3 files" in capsys.readouterr().out
    assert cli(["cache", "clear"]) == 0
    assert "deleted 3 files" in capsys.readouterr().out and not folder.exists()


def test_artifacts_that_do_not_load_are_a_cold_cache_and_are_dropped():
    compile_cache.save("b" * 32, b"not artifacts")
    assert compile_cache.load("b" * 32) is False
    assert not (compile_cache.directory() / f"{'b' * 32}{compile_cache.ARTIFACTS}").exists()


# --- compile="auto" beside the steps (a worker that answers at once; torch's eager backend)


class _QuickWorker:
    """A worker that answers "compiled" at its third poll, each poll a step end."""

    made: list = []

    def __init__(self, payload, cache_dir):
        self.payload, self.polls, self.began = payload, 0, time.perf_counter()
        _QuickWorker.made.append(self)

    def poll(self):
        self.polls += 1
        return ("ok", 0.1, None) if self.polls == 3 else None

    def stop(self):
        pass


@pytest.mark.parametrize("compile, compiled_s, kept", [("auto", 0.0005, True), ("auto", 0.002, False),
                                                      (True, 0.002, True)])  # forced: kept, even slower
def test_auto_compiles_beside_then_keeps_the_compiled_step_only_when_faster(monkeypatch, compile, compiled_s, kept):
    monkeypatch.setattr(compiling, "auto_blocker", lambda *args: None)
    monkeypatch.setattr(compiling, "BACKEND", "eager")
    monkeypatch.setattr(compiling, "decide", lambda *args, **options: compile_decision.Decision(True, "test"))
    monkeypatch.setattr(compiling, "Worker", _QuickWorker)
    timings = iter([(0.001, 0.9), (compiled_s, 0.9)])  # eager, then compiled
    monkeypatch.setattr(step_timing.StepTimings, "result", lambda self: next(timings))
    _QuickWorker.made.clear()
    result = _fit(_model(), compile=compile, max_steps=60)
    info, timed = result.compilation, step_timing.WARMUP_STEPS + step_timing.TIMED_STEPS
    assert len(_QuickWorker.made) == 1 and _QuickWorker.made[0].polls == 3
    assert info["at_step"] == timed + 3  # eager while it compiled, switched at the step end it answered
    assert "compiled beside training in" in info["reason"] and "switched at step 16" in info["reason"]
    assert (info["mode"] == "default") is kept and ("went back to eager" in info["reason"]) is not kept


def test_the_worker_gets_the_structure_and_not_the_weights():
    import pickle

    from gpunb.runtime.step import compile_worker
    from gpunb.runtime.step.objective import Objective

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(1000, 64), nn.Linear(64, 1000, bias=False)
            self.head.weight = self.embed.weight
            self.norm = nn.BatchNorm1d(64)

        def forward(self, x):
            return self.head(self.norm(self.embed(x)))

    model = Tied()
    payload = compile_worker.ship(model, Objective(loss_fn=nn.CrossEntropyLoss()), torch.zeros(4, dtype=torch.long),
                                  None, True, "inductor")
    assert len(payload) < 64_000 * 4 / 10  # far less than the weights
    job = pickle.loads(payload)
    copy = job["model"]
    assert copy.head.weight is copy.embed.weight  # still tied
    assert [(n, p.shape, p.dtype) for n, p in copy.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in model.named_parameters()]
    assert not torch.equal(copy.embed.weight, model.embed.weight)
    assert torch.equal(copy.norm.running_var, torch.ones(64)) and isinstance(job["loss_fn"], nn.CrossEntropyLoss)
