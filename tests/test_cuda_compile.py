"""GPU-only: CUDA-graph training against eager, and compile="auto" switching on a real GPU."""

import pytest
import torch
from torch import nn

from gpunb import Trainer
from gpunb.runtime.step import compiling

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
    options = {"precision": "32", **options}
    return Trainer(max_steps=steps, batch_size=64, log_every=1, track=False, lr=1e-3,
                   compile=compile, **options).fit(_model(), _data(n), loss_fn=nn.CrossEntropyLoss())


def _close(a, b, rtol=1e-2, atol=1e-3):
    """Two runs' logged losses, step by step."""
    torch.testing.assert_close(torch.tensor([r["loss"] for r in a.history]),
                               torch.tensor([r["loss"] for r in b.history]), rtol=rtol, atol=atol)


def _skips() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def test_cuda_graph_training_follows_the_eager_loss_curve():
    eager = _fit(False)
    skips = _skips()
    graphed = _fit("reduce-overhead")
    assert graphed.compilation["mode"] == "reduce-overhead"  # no fallback to eager
    assert _skips() == skips  # torch captured every graph
    _close(graphed, eager)


def test_cuda_graphs_with_a_partial_last_batch_still_follow_eager():
    # 500 samples, batch 64: each epoch ends with a batch of 52, a second shape to capture
    eager = _fit(False, n=500, steps=24)
    graphed = _fit("reduce-overhead", n=500, steps=24)
    assert graphed.compilation["mode"] == "reduce-overhead"
    _close(graphed, eager)


def test_cuda_graphs_with_gradient_accumulation_follow_eager():
    # each .grad is a buffer of its own: a graph's output would be overwritten by the next micro-batch
    eager = _fit(False, grad_accum=2)
    graphed = _fit("reduce-overhead", grad_accum=2)
    assert graphed.compilation["mode"] == "reduce-overhead", graphed.compilation["reason"]
    _close(graphed, eager)


def test_auto_times_a_small_model_finds_it_launch_bound_and_captures_the_whole_step():
    result = _fit("auto", steps=60)
    info = result.compilation
    assert info["at_step"] == compiling.WARMUP_STEPS + compiling.TIMED_STEPS
    assert "launch-bound" in info["reason"]  # a 32-64-2 MLP: microsecond kernels, the host is slower
    assert info["mode"] == "step-graph", info["reason"]  # the graph was faster, and kept
    assert info["eager_step_ms"] > info["compiled_step_ms"] > 0 and info["speedup"] > 1
    assert result.steps == 60 and all(r["loss"] == r["loss"] for r in result.history)  # no NaN


def test_auto_finds_a_large_step_gpu_bound():
    # 4 x 4096-wide layers at batch 4096: milliseconds of matrix work per step, the host long done
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(4)))
    x = torch.randn(4 * 4096, 4096)
    result = Trainer(max_steps=compiling.SHORTEST_RUN, batch_size=4096, precision="bf16-mixed", track=False,
                     compile="auto").fit(model, (x, x), loss_fn=nn.MSELoss())
    assert "GPU-bound: the GPU was busy" in result.compilation["reason"], result.compilation["reason"]


# --- the whole step as one CUDA graph


def test_the_whole_step_as_one_cuda_graph_follows_eager():
    eager = _fit(False, steps=30)
    graphed = _fit("step-graph", steps=30)
    assert graphed.compilation["mode"] == "step-graph", graphed.compilation["reason"]
    _close(graphed, eager, rtol=1e-3, atol=1e-4)


def test_a_step_graph_follows_a_schedule_clipping_and_partial_last_batches():
    # 500 samples, batch 64: each epoch ends with a batch of 52, run eagerly; the cosine schedule
    # changes the learning rate every step (the graph reads it from a device tensor)
    options = dict(n=500, steps=24, lr_schedule="cosine", warmup_steps=4, clip_grad_norm=0.5)
    eager, graphed = _fit(False, **options), _fit("step-graph", **options)
    assert graphed.compilation["mode"] == "step-graph", graphed.compilation["reason"]
    _close(graphed, eager, rtol=1e-3, atol=1e-4)
    assert [r["lr"] for r in graphed.history] == [r["lr"] for r in eager.history]


def test_a_step_graph_in_bf16_follows_eager():
    eager, graphed = _fit(False, precision="bf16-mixed"), _fit("step-graph", precision="bf16-mixed")
    assert graphed.compilation["mode"] == "step-graph"
    _close(graphed, eager, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("mode", ["step-graph", "reduce-overhead"])
def test_graphs_captured_while_a_thread_prepares_the_batches_follow_eager(mode):
    # RandomFlip takes its generator: the next batches are gathered and flipped in the feed's
    # thread on its side stream, while the loop captures the step on its own
    from gpunb.runtime.feed.transforms import RandomFlip

    eager = _fit(False, steps=30, transforms=[RandomFlip()])
    graphed = _fit(mode, steps=30, transforms=[RandomFlip()])
    assert graphed.compilation["mode"] == mode, graphed.compilation["reason"]
    _close(graphed, eager, rtol=1e-3, atol=1e-4)


class ReadsTheDevice(nn.Module):
    """A forward that reads a device value on the host: it cannot be captured."""

    def __init__(self):
        super().__init__()
        self.body = _model()

    def forward(self, x):
        out = self.body(x)
        if out.abs().max().item() > 1e6:
            out = out.clamp(-1e6, 1e6)
        return out


def test_a_step_that_cannot_be_captured_goes_on_eager_and_says_why():
    torch.manual_seed(0)
    eager = Trainer(max_steps=20, batch_size=64, precision="32", log_every=1, track=False,
                    compile=False).fit(ReadsTheDevice(), _data(512), loss_fn=nn.CrossEntropyLoss())
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="one CUDA graph"):
        result = Trainer(max_steps=20, batch_size=64, precision="32", log_every=1, track=False,
                         compile="step-graph").fit(ReadsTheDevice(), _data(512), loss_fn=nn.CrossEntropyLoss())
    assert result.compilation["mode"] is None and "no CUDA graph of the step" in result.compilation["reason"]
    assert result.steps == 20
    _close(result, eager, rtol=1e-3, atol=1e-4)  # nothing of the failed capture reached the weights
    # nor the CUDA generator: a failed capture would leave it in capture mode, where every random
    # op after it raises ("Offset increment outside graph capture")
    dropped = nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5)
    assert 0 < int((dropped == 0).sum()) < 1000
