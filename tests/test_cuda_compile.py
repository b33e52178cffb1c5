"""GPU-only: CUDA-graph training against eager, and compile="auto" switching on a real GPU."""

import pytest
import torch
from torch import nn

from gpunb import Trainer
from gpunb.runtime import compiling

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each test compiles anew: Dynamo would otherwise reuse an earlier test's graphs for this
    same model class (and CUDA-graph trees their recordings), so no test would see a compile.
    The on-disk caches stay, so a compile here takes seconds."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    return x, (x[:, :4].sum(1) > 0).long()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 2))


def _fit(compile, n=512, steps=20, **options):
    return Trainer(max_steps=steps, batch_size=64, precision="32", log_every=1, track=False, lr=1e-3,
                   compile=compile, **options).fit(_model(), _data(n), loss_fn=nn.CrossEntropyLoss())


def _skips() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def test_cuda_graph_training_follows_the_eager_loss_curve():
    eager = _fit(False)
    skips = _skips()
    graphed = _fit("reduce-overhead")
    assert graphed.compilation["mode"] == "reduce-overhead"  # no fallback to eager
    assert _skips() == skips  # torch captured every graph
    torch.testing.assert_close(torch.tensor([r["loss"] for r in graphed.history]),
                               torch.tensor([r["loss"] for r in eager.history]), rtol=1e-2, atol=1e-3)


def test_cuda_graphs_with_a_partial_last_batch_still_follow_eager():
    # 500 samples, batch 64: each epoch ends with a batch of 52, a second shape to capture
    eager = _fit(False, n=500, steps=24)
    graphed = _fit("reduce-overhead", n=500, steps=24)
    assert graphed.compilation["mode"] == "reduce-overhead"
    torch.testing.assert_close(torch.tensor([r["loss"] for r in graphed.history]),
                               torch.tensor([r["loss"] for r in eager.history]), rtol=1e-2, atol=1e-3)


def test_cuda_graphs_with_gradient_accumulation_follow_eager():
    # each .grad is a buffer of its own: a graph's output would be overwritten by the next micro-batch
    eager = _fit(False, grad_accum=2)
    graphed = _fit("reduce-overhead", grad_accum=2)
    assert graphed.compilation["mode"] == "reduce-overhead", graphed.compilation["reason"]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in graphed.history]),
                               torch.tensor([r["loss"] for r in eager.history]), rtol=1e-2, atol=1e-3)


def test_auto_times_a_small_model_finds_it_launch_bound_and_captures_it(monkeypatch):
    # With no compile cost to pay back, the decision rests on the measured step alone.
    monkeypatch.setattr(compiling, "expected_compile_s", lambda model, signature: 0.0)
    result = _fit("auto", steps=60)
    info = result.compilation
    assert info["at_step"] == compiling.WARMUP_STEPS + compiling.TIMED_STEPS
    assert "launch-bound" in info["reason"]  # a 32-64-2 MLP: microsecond kernels, the host is slower
    assert info["mode"] == "reduce-overhead", info["reason"]  # the graphs were faster, and kept
    assert info["cuda_graph_skips"] == 0
    assert info["eager_step_ms"] > 0 and info["compiled_step_ms"] > 0 and info["compile_s"] > 0
    assert info["speedup"] is not None
    assert result.steps == 60 and all(r["loss"] == r["loss"] for r in result.history)  # no NaN
