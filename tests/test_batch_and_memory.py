"""OOM recovery and batch_size='auto'."""

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

from gpunb import Trainer
from gpunb.render import summary_rows
from gpunb.runtime.probes import batch_size as auto


class OOMAbove(nn.Module):
    """Raises the CUDA OOM error for batches larger than `limit` (as a GPU would)."""

    def __init__(self, limit, seed=0):
        super().__init__()
        self.net = mlp(seed=seed)
        self.limit = limit
        self.ooms = 0

    def forward(self, x):
        if x.shape[0] > self.limit:
            self.ooms += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.net(x)


def run(model, **overrides):
    x, y = classification_data(n=256)
    options = dict(epochs=2, batch_size=32, track=False, log_every=4)
    options.update(overrides)
    return Trainer(**options).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss())


def test_oom_halves_the_micro_batch_and_matches_a_run_started_small():
    recovered = OOMAbove(limit=8)
    result = run(recovered)
    assert result.oom_recoveries == 2 and result.micro_batch_size == 8
    assert result.batch_size == 32 and result.effective_batch_size == 32
    assert result.steps == 16 and result.samples == 512

    small = OOMAbove(limit=8)
    reference = run(small, batch_size=8, grad_accum=4)
    assert reference.oom_recoveries == 0
    for a, b in zip(recovered.parameters(), small.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [h["loss"] for h in result.history] == pytest.approx(
        [h["loss"] for h in reference.history], rel=1e-5)


def test_oom_with_accumulation_replays_the_whole_step():
    recovered = OOMAbove(limit=8)
    run(recovered, batch_size=16, grad_accum=2)
    small = OOMAbove(limit=8)
    run(small, batch_size=8, grad_accum=4)
    for a, b in zip(recovered.parameters(), small.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_oom_at_one_sample_names_the_fix():
    from gpunb.errors import GpunbError

    with pytest.raises(GpunbError, match="micro-batch of 1") as error:
        run(OOMAbove(limit=0))
    assert "activation_checkpointing" in str(error.value)


def test_auto_batch_size_leaves_model_optimizer_and_rng_exactly_as_before():
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = classification_data(n=4096)
    # Give the optimizer some state first: probing must not change it either.
    nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
    optimizer.step()
    optimizer.zero_grad()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = {k: {f: t.clone() for f, t in v.items()} for k, v in optimizer.state_dict()["state"].items()}
    rng = torch.get_rng_state()

    from gpunb.runtime.step.objective import Objective
    from gpunb.runtime.step.precision import Precision

    config = __import__("gpunb").TrainConfig(batch_size="auto")
    chosen, reason, probes = auto.find_batch_size(model, optimizer, Objective(nn.CrossEntropyLoss()),
                                                  Precision("32", torch.device("cpu")), (x, y),
                                                  torch.device("cpu"), config)
    assert chosen in {p["batch_size"] for p in probes}
    assert reason.startswith("auto: ")
    assert config == __import__("gpunb").TrainConfig(batch_size="auto")  # the config is only read
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    after = optimizer.state_dict()["state"]
    for k, fields in opt_state.items():
        for f, t in fields.items():
            assert torch.equal(torch.as_tensor(after[k][f]), t), (k, f)
    assert torch.equal(torch.get_rng_state(), rng)


def test_auto_batch_size_respects_fake_gpu_memory_limits(monkeypatch):
    """With OOM above 64 samples, the probe stops there and picks a size that fit."""
    model = OOMAbove(limit=64)
    result = run(model, batch_size="auto", epochs=1)
    probes = result.batch_probe
    assert max(p["batch_size"] for p in probes) <= 64
    assert result.batch_size in {p["batch_size"] for p in probes}
    assert result.oom_recoveries == 0


def test_auto_batch_size_on_cpu_is_reproducible_and_says_how_it_chose():
    """The README's first example: the same seed picks the same size and trains to the same result."""
    from gpunb.demo import digits_data

    train, val = digits_data()

    def readme_run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        return Trainer(epochs=2, batch_size="auto", track=False).fit(model, train, val,
                                                                     loss_fn=nn.CrossEntropyLoss())

    first, second = readme_run(), readme_run()
    assert first.batch_size == second.batch_size
    assert first.final_metrics == second.final_metrics
    assert first.batch_size_reason.startswith("auto: ") and "MFLOP per sample" in first.batch_size_reason
    assert ("batch size", first.batch_size_reason) in summary_rows(first)
    # The choice follows the FLOPs: the tiny MLP is capped at an eighth of an epoch,
    # the digits CNN (about 200x the work per sample) stops far below it.
    from gpunb.demo import digits_cnn

    torch.manual_seed(0)
    cnn = Trainer(epochs=1, max_steps=1, batch_size="auto", track=False).fit(
        digits_cnn(), train, loss_fn=nn.CrossEntropyLoss())
    assert first.batch_size == 128  # 1437 samples // 8 steps -> 179 -> largest power of two
    assert cnn.batch_size < first.batch_size
    assert cnn.batch_size * 7.9e6 * 0.5 < auto.CPU_STEP_FLOPS <= cnn.batch_size * 8.1e6


def test_auto_batch_size_on_a_gpu_takes_the_smallest_size_near_the_best_throughput():
    """Timing noise between neighbours must not flip the choice: 5% slack goes to the smaller size."""
    measured = {8: 1000.0, 16: 1900.0, 32: 3000.0, 64: 3100.0, 128: 2900.0}

    class FakeProbe:
        records = []

        def time(self, size):
            self.records.append({"batch_size": size, "samples_per_s": measured[size], "peak_fraction": 0.1})
            return self.records[-1]

    size, reason = auto._by_throughput(FakeProbe(), cap=128)
    assert size == 32  # 3000 is within 5% of the best, 3100 at 64
    assert reason == "auto: fastest of 8-128 measured (3,000 samples/s)"


def test_the_probe_steps_with_fits_stepper_and_an_oom_means_does_not_fit():
    from gpunb import TrainConfig
    from gpunb.runtime.step.objective import Objective
    from gpunb.runtime.step.precision import Precision

    model = OOMAbove(limit=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = classification_data(n=64)
    probe = auto.StepProbe(model, optimizer, Objective(nn.CrossEntropyLoss()), Precision("fp32", torch.device("cpu")),
                        (x, y), torch.device("cpu"), TrainConfig(grad_accum=4))
    assert probe.stepper.config.grad_accum == 1  # one batch is one step while probing
    assert probe.fits(8) and not probe.fits(16)  # not split into pieces that would fit
    assert probe.stepper.splits == 1 and probe.stepper.pending == [] and probe.stepper.step_loss is None
    assert all(p.grad is None for p in model.parameters())


# Under AdamW a gradient scaled by a constant gives nearly the same update, so the checks
# below train with plain SGD (and SGD with momentum), where a wrongly weighted micro-batch
# moves the weights by a different amount, and compare every step's loss, not only the end.

class OOMOnce(nn.Module):
    """Raises the CUDA OOM error once, at its `at`-th forward call (counting from 1)."""

    def __init__(self, at, seed=0):
        super().__init__()
        self.net = mlp(seed=seed)
        self.at, self.calls = at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.net(x)


def sgd_run(model, momentum, n=256, **overrides):
    x, y = classification_data(n=n)
    options = dict(epochs=2, batch_size=32, track=False, log_every=1)
    options.update(overrides)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=momentum)
    return Trainer(**options).fit(model, (x, y), optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())


def assert_same_run(a_model, a_result, b_model, b_result):
    """Every logged step's loss and the final weights agree to float rounding."""
    assert [h["step"] for h in a_result.history] == [h["step"] for h in b_result.history]
    assert [h["loss"] for h in a_result.history] == pytest.approx(
        [h["loss"] for h in b_result.history], rel=1e-5, abs=1e-6)
    for a, b in zip(a_model.parameters(), b_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_oom_under_sgd_trains_as_the_smaller_micro_batch_from_the_start(momentum):
    recovered = OOMAbove(limit=8)
    result = sgd_run(recovered, momentum, batch_size=16, grad_accum=2)
    assert result.oom_recoveries == 1 and result.micro_batch_size == 8
    small = OOMAbove(limit=8)
    reference = sgd_run(small, momentum, batch_size=8, grad_accum=4)
    assert reference.oom_recoveries == 0 and reference.steps == result.steps == 16
    assert_same_run(recovered, result, small, reference)


@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_an_uneven_split_weights_each_piece_by_its_samples(momentum, grad_accum):
    """7 samples split into 4 + 3: the loaded batch's loss and gradient are the mean over its 7
    samples, as without the split (an equal weight per piece would give the 3 samples more pull)."""
    recovered = OOMAbove(limit=4)
    result = sgd_run(recovered, momentum, n=63, batch_size=7, grad_accum=grad_accum)
    assert result.oom_recoveries == 1 and result.micro_batch_size == 4
    unsplit = OOMAbove(limit=7)
    reference = sgd_run(unsplit, momentum, n=63, batch_size=7, grad_accum=grad_accum)
    assert reference.oom_recoveries == 0 and reference.steps == result.steps == 18 // grad_accum
    assert_same_run(recovered, result, unsplit, reference)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_oom_mid_step_with_accumulation_replays_the_step_as_if_none_happened(momentum):
    """An OOM at the 2nd loaded batch of step 3 (grad_accum=3, 10 samples a batch, an epoch's
    last batch of 6 and a short last group): the step's first batch is replayed in pieces of
    5 and the run goes on in them, each weighted by its share of the step."""
    recovered = OOMOnce(at=8)
    result = sgd_run(recovered, momentum, n=76, batch_size=10, grad_accum=3)
    assert result.oom_recoveries == 1 and result.micro_batch_size == 5
    plain = OOMOnce(at=0)
    reference = sgd_run(plain, momentum, n=76, batch_size=10, grad_accum=3)
    assert reference.oom_recoveries == 0 and reference.steps == result.steps == 6
    assert_same_run(recovered, result, plain, reference)
