"""torch.compile in a run: compile="auto" (decision, switch, checks), forced modes, the eager fallback."""

from __future__ import annotations

import functools
import shutil
import warnings

import pytest
import torch
from torch import nn

from gpunb import Trainer
from gpunb.config import TrainConfig
from gpunb.errors import GpunbError
from gpunb.runtime.step import compile_decision, compiling, step_timing
from gpunb.runtime.step.compile_decision import Decision, decide, expected_compile_s, signature_of
from gpunb.runtime.step.engines import EagerEngine, GraphEngine
from gpunb.runtime.step.step_graph import CaptureError
from gpunb.runtime.step.stepper import Stepper


@pytest.fixture(autouse=True)
def _no_compile_history(monkeypatch):
    """Each test starts as a fresh kernel: no compile measured earlier in this process, and no
    code Dynamo compiled earlier (the same step code, with another test's backend, would be
    reused by its cache, and forked ranks inherit that cache: their backend never ran)."""
    monkeypatch.setattr(compile_decision, "_measured_compile_s", {})
    torch._dynamo.reset()


def _data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :2].sum(1) > 0).long()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _fit(model, **options):
    options = {"max_steps": 30, "batch_size": 32, "log_every": 1, "track": False, "lr": 1e-2, **options}
    return Trainer(**options).fit(model, _data(), loss_fn=nn.CrossEntropyLoss())


# --- config and the magic's option


@pytest.mark.parametrize("given, canonical", [("auto", "auto"), (True, True), (False, False), ("on", True),
                                              ("off", False), ("cuda-graphs", "reduce-overhead"),
                                              ("max-autotune", "max-autotune")])
def test_compile_values_are_made_canonical(given, canonical):
    assert TrainConfig(compile=given).compile == canonical


def test_auto_is_the_default_and_a_bad_value_is_refused():
    assert TrainConfig().compile == "auto"
    with pytest.raises(GpunbError, match="reduce-overhead"):
        TrainConfig(compile="fast")


# --- the decision


def test_a_launch_bound_step_is_captured_whole_as_one_cuda_graph():
    decision = decide(step_s=0.003, gpu_share=0.11, remaining_steps=1_000, expected_compile_s=12)
    assert decision.mode == "step-graph"  # no compile to pay back: 1,000 steps are plenty
    assert "launch-bound" in decision.reason and "busy 11%" in decision.reason


def test_a_launch_bound_step_that_cannot_be_one_graph_gets_reduce_overhead_when_it_pays():
    why = "gradient accumulation runs several backward passes a step"
    decision = decide(step_s=0.003, gpu_share=0.11, remaining_steps=100_000, expected_compile_s=12, graph_blocker=why)
    assert decision.mode == "reduce-overhead" and why in decision.reason
    assert decide(0.003, 0.11, 1_000, 12, graph_blocker=why).mode is None  # 1.3 s to save: not worth 12 s


def test_a_gpu_bound_step_gets_the_default_mode():
    decision = decide(step_s=0.053, gpu_share=0.84, remaining_steps=20_000, expected_compile_s=30)
    assert decision.mode is True and "GPU-bound" in decision.reason and "84%" in decision.reason
    assert decide(0.053, None, 20_000, 30).mode is True  # not probed: taken as GPU-bound


def test_a_short_remainder_stays_eager_and_says_the_numbers():
    decision = decide(step_s=0.053, gpu_share=0.9, remaining_steps=300, expected_compile_s=30)
    assert decision.mode is None
    assert "300 steps" in decision.reason and "~30 s compile" in decision.reason


def test_the_break_even_point_follows_the_margin():
    # saving = steps * 0.01 s * (1 - 1/1.3); eager below PAYBACK_MARGIN x 10 s of compile
    saving_per_step = 0.01 * (1 - 1 / compile_decision.ASSUMED_SPEEDUP[True])
    needed = compile_decision.PAYBACK_MARGIN * 10 / saving_per_step
    assert decide(0.01, 0.9, int(needed * 0.95), 10).mode is None
    assert decide(0.01, 0.9, int(needed * 1.05), 10).mode is True


def test_expected_compile_time_is_an_estimate_then_what_was_measured(monkeypatch):
    model = _model()
    signature = signature_of(model, 32)
    assert expected_compile_s(model, signature) == 10 + 0.25 * 3  # three leaf modules
    compile_decision._measured_compile_s[signature] = 2.5
    assert expected_compile_s(model, signature) == 2.5
    assert signature_of(_model(), 32) == signature  # a new instance of the same model: the same key
    assert signature_of(_model(), 64) != signature


# --- the whole step as one CUDA graph: what is checked before any capture (the capture itself
# needs a GPU: tests/test_cuda_compile.py)


def _stepper(optimizer=None, device="cuda", **config):
    """A Stepper as fit builds one (nothing of it touches the device until a step runs)."""
    from gpunb.runtime.step.objective import Objective
    from gpunb.runtime.step.precision import Precision

    model = _model()
    optimizer = optimizer or torch.optim.AdamW(model.parameters())
    device = torch.device(device)
    return Stepper(model, optimizer, Objective(loss_fn=nn.CrossEntropyLoss()), Precision("32", device),
                   schedule=None, config=TrainConfig(**config))


def test_what_keeps_a_step_from_being_one_cuda_graph():
    from gpunb.runtime.step import step_graph
    from gpunb.runtime.step.schedule import Schedule

    assert step_graph.blocker(_stepper(), world_size=1) is None
    assert "between processes" in step_graph.blocker(_stepper(), world_size=2)
    assert "accumulation" in step_graph.blocker(_stepper(grad_accum=2), world_size=1)
    sgd = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert "(SGD) has no capturable mode" in step_graph.blocker(_stepper(sgd), world_size=1)
    stepper = _stepper()
    stepper.schedule = Schedule(torch.optim.lr_scheduler.OneCycleLR(stepper.optimizer, max_lr=0.1, total_steps=10))
    assert "momentum" in step_graph.blocker(stepper, world_size=1)


def test_step_graph_on_the_cpu_trains_eager_and_says_why():
    with pytest.warns(RuntimeWarning, match="cannot capture"):
        result = _fit(_model(), compile="step-graph")
    assert result.compilation["mode"] is None and "need a CUDA device" in result.compilation["reason"]
    assert result.steps == 30


def test_on_the_cpu_no_step_is_probed_for_the_gpus_busy_time(monkeypatch):
    _auto_everywhere(monkeypatch)
    seen = []
    real = step_timing.StepTimings.result
    monkeypatch.setattr(step_timing.StepTimings, "result", lambda self: seen.append(real(self)) or seen[-1])
    _fit(_model())
    assert len(seen) == 1 and seen[0][1] is None  # not measured: taken as GPU-bound


def test_a_probed_step_starts_its_probe_once_at_its_start():
    calls = []

    class Timings:  # what the probe asks of StepTimings
        def start_probe(self):
            calls.append(len(calls))

    stepper = _stepper(device="cpu", grad_accum=2)
    eager = stepper.engine
    stepper.switch(step_timing.Probed(eager, Timings()))
    batch = _data(n=8)
    for _ in range(2):
        stepper.accumulate(batch, False)
        stepper.accumulate(batch, True)
        stepper.update()
    assert calls == [0]  # once, at the first micro-batch of the first step after the switch
    with pytest.raises(RuntimeError, match="step boundaries"):  # a step runs on one engine
        stepper.accumulate(batch, False)
        stepper.switch(eager)


# --- what a run reports


def test_auto_on_cpu_stays_eager_and_says_why():
    result = _fit(_model())
    assert result.compilation["requested"] == "auto" and result.compilation["mode"] is None
    assert "CUDA only" in result.compilation["reason"]


def test_auto_keeps_fsdp_and_short_runs_eager():
    cuda = torch.device("cuda")
    assert "FSDP" in compile_decision.auto_blocker(cuda, 2, 10_000, "fsdp")
    assert compile_decision.auto_blocker(cuda, 2, 10_000, "ddp") is None
    assert "too few" in compile_decision.auto_blocker(cuda, 1, compile_decision.SHORTEST_RUN - 1)
    assert compile_decision.auto_blocker(cuda, 1, compile_decision.SHORTEST_RUN) is None
    assert compile_decision.auto_blocker(cuda, 1, None) is None  # a stream: timed, then judged by its length


def test_several_processes_never_get_cuda_graphs():
    assert decide(0.003, 0.1, 10**6, 1, cuda_graphs=False).mode is True


def _auto_everywhere(monkeypatch, decision=None, backend="eager"):
    """compile='auto' as on a GPU, with a quick backend (and a decision, when given)."""
    monkeypatch.setattr(compiling, "auto_blocker", lambda *args: None)
    monkeypatch.setattr(compiling, "BACKEND", backend)
    if decision is not None:
        monkeypatch.setattr(compiling, "decide", lambda *args, **options: decision)


def test_auto_times_the_first_steps_then_compiles_and_measures(monkeypatch):
    _auto_everywhere(monkeypatch, Decision(True, "GPU-bound (test)"))
    real_result = step_timing.StepTimings.result
    measured = []

    def result(self):  # the real medians, then a compiled step reported twice as fast as eager
        measured.append(real_result(self))
        return measured[-1] if len(measured) == 1 else (measured[0][0] / 2, measured[-1][1])

    monkeypatch.setattr(step_timing.StepTimings, "result", result)
    calls = []
    real = Stepper.switch
    monkeypatch.setattr(Stepper, "switch", lambda self, engine: (
        calls.append(type(engine.model).__name__), real(self, engine))[1])
    result = _fit(_model())
    info = result.compilation
    switch = step_timing.WARMUP_STEPS + step_timing.TIMED_STEPS
    assert info["mode"] == "default" and info["at_step"] == switch
    assert len(measured) == 2 and measured[1][0] > 0  # the compiled steps were timed too
    assert info["eager_step_ms"] == pytest.approx(1000 * measured[0][0]) and info["speedup"] == pytest.approx(2)
    assert info["compile_s"] >= 0 and info["reason"] == "GPU-bound (test)"
    assert calls == ["OptimizedModule"]  # one switch, kept
    assert result.steps == 30 and all(torch.isfinite(torch.tensor(r["loss"])) for r in result.history)


def test_auto_times_a_resumed_run_from_where_it_starts(monkeypatch, tmp_path):
    first = _fit(_model(), compile=False, max_steps=10, checkpoint_dir=str(tmp_path), checkpoint_every=10)
    assert first.steps == 10
    _auto_everywhere(monkeypatch, Decision(True, "test"))
    resumed = _fit(_model(), max_steps=40, checkpoint_dir=str(tmp_path), resume="last")
    assert resumed.start_step == 10 and resumed.steps == 40
    assert resumed.compilation["at_step"] == 10 + step_timing.WARMUP_STEPS + step_timing.TIMED_STEPS


def test_a_run_that_compiles_lets_go_of_its_run_without_the_garbage_collector(monkeypatch):
    """The callback holds the stepper, never the run: no reference cycle keeps the run's memory
    (optimizer state, data on the device) after fit returns, even when it ends mid-decision."""
    import gc
    import weakref

    from gpunb.runtime import loop

    _auto_everywhere(monkeypatch, Decision(True, "test"))
    _fit(_model(), max_steps=20)  # first imports inside a fit hold its frames until gc
    runs, train = [], loop._train
    monkeypatch.setattr(loop, "_train", lambda run: runs.extend(
        weakref.ref(part) for part in (run, run.compilation, run.callbacks, run.state, run.stepper)) or train(run))
    gc.collect()
    gc.disable()
    try:
        result = _fit(_model(), max_steps=20)  # ends while the compiled steps are being timed
        assert result.compilation["mode"] == "default" and result.compilation["speedup"] is None
        del result
        assert [part() for part in runs] == [None] * 5
    finally:
        gc.enable()


def test_auto_goes_back_to_eager_when_the_compiled_steps_are_slower(monkeypatch):
    _auto_everywhere(monkeypatch, Decision(True, "test"))
    timings = iter([(0.001, 0.5), (0.002, 0.5)])  # eager, then compiled: twice as slow
    monkeypatch.setattr(step_timing.StepTimings, "result", lambda self: next(timings))
    model = _model()
    result = _fit(model)
    assert result.compilation["mode"] is None and result.compilation["speedup"] == 0.5
    assert "went back to eager" in result.compilation["reason"]


def test_auto_stays_eager_when_the_run_is_too_short_to_pay(monkeypatch):
    _auto_everywhere(monkeypatch)
    result = _fit(_model())
    assert result.compilation["mode"] is None and result.compilation["eager_step_ms"] > 0
    assert "too little" in result.compilation["reason"]


def test_a_partial_last_batch_counts_a_second_compile():
    class Run:
        pass

    from gpunb.runtime.feed.augmenter import Augmenter
    from gpunb.runtime.feed.feeds import EpochOrder, TensorFeed

    run, cpu = Run(), torch.device("cpu")

    def feed(batch_size, drop_last):
        return TensorFeed(_data(100), batch_size, EpochOrder(100, True, 0), cpu, drop_last, Augmenter((), 0, cpu))

    run.feed = feed(32, drop_last=False)
    assert compile_decision.partial_last_batch(run.feed)
    run.feed = feed(25, drop_last=False)
    assert not compile_decision.partial_last_batch(run.feed)
    run.feed = feed(32, drop_last=True)
    assert not compile_decision.partial_last_batch(run.feed)


# --- when compiling fails


def _failing_backend(graph_module, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def test_a_compile_that_fails_is_replayed_eagerly_and_the_run_is_the_eager_one(monkeypatch):
    monkeypatch.setattr(compiling, "BACKEND", _failing_backend)
    eager = _fit(_model(), compile=False)
    with pytest.warns(RuntimeWarning, match="goes on eager"):
        fallen = _fit(_model(), compile=True)
    assert fallen.compilation["mode"] is None
    assert "failed" in fallen.compilation["reason"] and "cannot compile" in fallen.compilation["reason"]
    assert [r["loss"] for r in fallen.history] == [r["loss"] for r in eager.history]


class _CannotCapture(GraphEngine):
    """A whole-step engine whose capture always fails (on the CPU, in place of a CUDA graph's)."""

    def whole_step(self, stepper, batch):
        raise CaptureError("RuntimeError: this step reads a device value on the host (test)")


def test_a_step_that_cannot_be_taken_whole_runs_eagerly_and_eager_goes_on():
    stepper, reference = _stepper(device="cpu"), _stepper(device="cpu")
    eager = stepper.engine
    stepper.switch(_CannotCapture(eager))
    batch = _data(n=8)
    with pytest.warns(RuntimeWarning, match="could not run as one CUDA graph"):
        stepper.accumulate(batch, True)
    assert stepper.engine is eager and "device value" in str(stepper.failure[1])
    reference.accumulate(batch, True)
    assert stepper.update() == reference.update()  # the step at hand ran, eagerly


def test_a_run_whose_step_cannot_be_captured_trains_as_eager_and_says_why(monkeypatch):
    from gpunb.runtime.step import step_graph

    monkeypatch.setattr(step_graph, "blocker", lambda stepper, world_size: None)  # as on a GPU
    monkeypatch.setattr(compiling, "GraphEngine", _CannotCapture)
    eager = _fit(_model(), compile=False)
    with pytest.warns(RuntimeWarning, match="could not run as one CUDA graph"):
        result = _fit(_model(), compile="step-graph")
    assert result.compilation["mode"] is None and "no CUDA graph of the step" in result.compilation["reason"]
    assert "device value" in result.compilation["reason"] and result.steps == 30
    assert [r["loss"] for r in result.history] == [r["loss"] for r in eager.history]


def test_a_model_that_fails_eagerly_too_raises_its_own_error(monkeypatch):
    monkeypatch.setattr(compiling, "BACKEND", "eager")

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 2)

        def forward(self, x):
            raise ValueError("the model's own bug")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(ValueError, match="own bug"):
            _fit(Broken(), compile=True)


def test_an_eager_step_error_is_never_swallowed():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 2)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 3:
                raise ValueError("third call")
            return self.linear(x)

    with pytest.raises(ValueError, match="third call"):
        _fit(Broken(), compile=False)


def test_the_result_counts_graph_breaks(monkeypatch):
    monkeypatch.setattr(compiling, "BACKEND", "eager")

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 2)

        def forward(self, x):
            out = self.linear(x)
            return out * 2 if out.sum().item() > 0 else out  # a host read: Dynamo breaks the graph

    result = _fit(Branchy(), compile=True, max_steps=3)
    assert result.compilation["mode"] == "default" and result.compilation["graph_breaks"] >= 1
    assert "graph break" in result.compilation["reason"]
    assert _fit(_model(), compile=True, max_steps=3).compilation["graph_breaks"] == 0


def test_the_loss_is_compiled_as_well_and_validation_keeps_the_eager_one(monkeypatch):
    graphs = []  # the functions each compiled graph calls

    def recording(graph_module, example_inputs):
        graphs.append({str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"})
        return graph_module.forward

    monkeypatch.setattr(compiling, "BACKEND", recording)
    calls = []

    def loss_fn(output, target):
        calls.append(torch.compiler.is_compiling())
        return nn.functional.cross_entropy(output, target)

    options = dict(max_steps=3, batch_size=32, log_every=1, track=False)
    result = Trainer(**options, compile=True).fit(_model(), _data(), _data(64, 1), loss_fn=loss_fn)
    assert any(any("cross_entropy" in target for target in graph) for graph in graphs)
    assert True in calls  # traced for the training steps
    assert calls[-1] is False  # validation, after the last step, called it eagerly
    eager = Trainer(**options, compile=False).fit(_model(), _data(), _data(64, 1), loss_fn=loss_fn)
    assert [r["loss"] for r in result.history] == [r["loss"] for r in eager.history]


# --- CUDA graphs: outputs live in memory the next replay overwrites


class _Graphed(EagerEngine):
    """The model as if it replayed CUDA graphs (as a compiled engine in "reduce-overhead" mode does)."""

    graphed = True


def _graphed_stepper(model, loss_fn) -> Stepper:
    """fit's step over `model` as if it replayed CUDA graphs: SGD, fp32, two micro-batches a step."""
    from gpunb.runtime.step.objective import Objective
    from gpunb.runtime.step.precision import Precision

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = Stepper(model, optimizer, Objective(loss_fn, None, None), Precision("32", torch.device("cpu")),
                      None, TrainConfig(grad_accum=2))
    stepper.switch(_Graphed(model, stepper.objective))
    return stepper


def test_with_cuda_graphs_the_kept_loss_is_a_copy_and_each_step_is_marked(monkeypatch):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    outputs = []

    class LossModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 1)

        def forward(self, x, y):
            loss = self.linear(x).square().mean()
            outputs.append(loss)
            return loss

    model = LossModel()
    stepper = _graphed_stepper(model, loss_fn=None)
    x, y = _data(8)
    stepper.accumulate((x, y), last_in_step=False)
    stepper.accumulate((x, y), last_in_step=True)
    assert len(marks) == 2  # one per micro-batch: each is a forward and its backward
    loss = stepper.update()
    assert all(loss.data_ptr() != out.data_ptr() for out in outputs)


def test_cuda_graphs_with_gradient_accumulation_keep_gradients_in_buffers_of_their_own(monkeypatch):
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    model = _model()
    stepper = _graphed_stepper(model, loss_fn=nn.CrossEntropyLoss())
    buffers = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in buffers)  # made before any graph runs
    x, y = _data(16)
    stepper.accumulate((x[:8], y[:8]), last_in_step=False)
    stepper.accumulate((x[8:], y[8:]), last_in_step=True)
    assert all(p.grad is g for p, g in zip(model.parameters(), buffers))  # accumulated in place
    stepper.update()
    assert all(p.grad is g and not g.any() for p, g in zip(model.parameters(), buffers))  # zeroed, kept
    stepper.switch(EagerEngine(model, stepper.objective))
    stepper.accumulate((x, y), last_in_step=False)
    stepper.accumulate((x, y), last_in_step=True)
    stepper.update()
    assert all(p.grad is None for p in model.parameters())  # eager: dropped after the step, as before


# --- torch's caches make a second compile of the same model cheap


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor on the CPU needs a C++ compiler")
def test_compiling_the_same_model_again_reuses_the_compile_caches():
    from torch._dynamo.utils import get_compilation_metrics

    source = ("class Net(nn.Module):\n"
              "    def __init__(self):\n"
              "        super().__init__()\n"
              "        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 2)\n"
              "    def forward(self, x):\n"
              "        return self.b(torch.relu(self.a(x)) * 2 + 1)\n")
    hits = []
    for _ in range(2):  # a notebook cell defining and training the model, run twice
        namespace = {"nn": nn, "torch": torch}
        exec(source, namespace)
        before = len(get_compilation_metrics())
        torch.manual_seed(0)
        _fit(namespace["Net"](), compile=True, max_steps=3)
        new = get_compilation_metrics()[before:]
        hits.append(sum((m.aotautograd_local_cache_hit_count or 0) + (m.inductor_fx_local_cache_hit_count or 0)
                        for m in new))
    assert hits[1] > 0  # the second run's graphs came from the caches


# --- the summary says it


def test_the_summary_row_says_what_compile_did():
    from gpunb.render import compile_text

    info = {"requested": "auto", "mode": "reduce-overhead", "at_step": 13, "compile_s": 11.24, "speedup": 1.934,
            "eager_step_ms": 3.1, "compiled_step_ms": 1.603, "reason": "launch-bound: the GPU was busy 14% ..."}
    assert compile_text(info) == ("CUDA graphs from step 13: compile 11.2 s, 1.93x faster (3.10 -> 1.60 ms a step); "
                                  "launch-bound: the GPU was busy 14% ...")
    info.update(mode="step-graph", compile_s=0.04, speedup=5.84, compiled_step_ms=0.531)
    assert compile_text(info).startswith("one CUDA graph a step from step 13: capture 0.0 s, 5.84x faster")
    assert compile_text({"mode": None, "reason": "eager: compile='auto' compiles on CUDA only"}).startswith("eager")


# --- several processes (DDP over gloo): every rank compiles, or none


def _ddp_fit(model, **options):
    import torch.distributed  # noqa: F401 (the backends below ask for the rank)

    x, y = _data(512)
    options = {"max_steps": 30, "batch_size": 16, "log_every": 5, "devices": 2, "accelerator": "cpu",
               "track": False, **options}
    return Trainer(**options).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss())


class Net(nn.Module):
    """A model class of the user's (for nn.Sequential: the test after these)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hidden, self.out = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def _rank() -> int:
    return torch.distributed.get_rank()


def _same_weights(a, b, atol=1e-5):
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, atol=atol, rtol=0, msg=name)


def test_ddp_ranks_that_agree_all_compile_and_train_as_eager_does(monkeypatch):
    _auto_everywhere(monkeypatch, Decision(True, "GPU-bound (test)"))
    timings = iter([(0.002, 0.5), (0.001, 0.5)])  # eager, then compiled: faster
    monkeypatch.setattr(step_timing.StepTimings, "result", lambda self: next(timings))
    eager = Net()
    _ddp_fit(eager, compile=False)
    compiled = Net()
    result = _ddp_fit(compiled)
    info = result.compilation
    assert info["mode"] == "default" and info["at_step"] == step_timing.WARMUP_STEPS + step_timing.TIMED_STEPS
    assert info["speedup"] == pytest.approx(2)
    _same_weights(compiled, eager)


def test_ddp_ranks_compile_only_when_every_rank_says_it_pays(monkeypatch):
    _auto_everywhere(monkeypatch)
    monkeypatch.setattr(compiling, "decide", lambda *args, **options: (
        Decision(True, "pays here") if _rank() == 0 else Decision(None, "eager: does not pay here")))
    result = _ddp_fit(Net())  # rank 0's result
    assert result.compilation["mode"] is None
    assert result.compilation["reason"] == "eager: another process found that compiling would not pay"


def test_a_rank_whose_compiled_step_fails_takes_every_rank_back_to_eager(monkeypatch):
    def fails_on_rank_1(graph_module, example_inputs):
        if _rank() == 1:
            raise RuntimeError("no compiler on this rank")
        return graph_module.forward

    _auto_everywhere(monkeypatch, Decision(True, "test"), backend=fails_on_rank_1)
    timings = iter([(0.002, 0.5), (0.001, 0.5)])  # rank 0's compiled steps are faster
    monkeypatch.setattr(step_timing.StepTimings, "result", lambda self: next(timings))
    eager = Net()
    _ddp_fit(eager, compile=False)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = _ddp_fit(model)
    assert result.compilation["mode"] is None and "another process" in result.compilation["reason"]
    assert result.steps == 30
    _same_weights(model, eager)


def test_under_ddp_a_model_of_torchs_own_classes_compiles_too(monkeypatch, tmp_path):
    """Dynamo starts no trace in torch's files, where nn.Sequential's forward is: without a frame
    of gpunb's in front of it, the DDP-wrapped model ran eager though "compiled"."""
    def recording(graph_module, example_inputs):
        (tmp_path / f"rank{_rank()}").touch()  # the ranks are forked: a file says what they did
        return graph_module.forward

    _auto_everywhere(monkeypatch, Decision(True, "test"), backend=recording)
    timings = iter([(0.002, 0.5), (0.001, 0.5)])
    monkeypatch.setattr(step_timing.StepTimings, "result", lambda self: next(timings))
    eager = _model()
    _ddp_fit(eager, compile=False)
    assert not list(tmp_path.iterdir())
    model = _model()
    result = _ddp_fit(model)
    assert result.compilation["mode"] == "default"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]  # both ranks ran graphs
    _same_weights(model, eager)


def test_the_frame_in_front_of_torchs_forward_is_there_only_while_wrapped():
    from types import SimpleNamespace

    from gpunb.runtime.step.wrap import wrap_model

    ddp = SimpleNamespace(world_size=2, wrap=lambda model, device: nn.Module())  # a wrapper, as DDP is
    sequential, net, x = _model(), Net(), torch.randn(4, 8)
    expected = sequential(x)
    _, unwrap = wrap_model(sequential, TrainConfig(), ddp, torch.device("cpu"))
    assert sequential.forward.__name__ == "forward_traced_from_here"
    torch.testing.assert_close(sequential(x), expected)
    unwrap()
    assert "forward" not in sequential.__dict__  # the model is as it was given
    for model, config in ((net, TrainConfig()), (_model(), TrainConfig(compile=False))):
        _, unwrap = wrap_model(model, config, ddp, torch.device("cpu"))
        assert "forward" not in model.__dict__  # a forward Dynamo traces, or nothing to compile
        unwrap()
    own = functools.partial(nn.Sequential.forward, sequential)  # a forward set on the instance stays
    sequential.forward = own
    _, unwrap = wrap_model(sequential, TrainConfig(), ddp, torch.device("cpu"))
    assert sequential.forward is not own
    unwrap()
    assert sequential.forward is own
