"""MFU in every result: FLOPs per step from the summary's count, the device's dense peak, tokens/s."""

import re

import pytest
import torch
from torch import nn

from gpunb import Trainer, render
from gpunb.config import TrainConfig
from gpunb.runtime import device as devices
from gpunb.runtime import prepare
from gpunb.runtime.events import FitState
from gpunb.runtime.probes.peak_flops import device_peak_tflops, peak_tflops, precision_kind
from gpunb.runtime.probes.summary import RunSummary, tokens_per_sample
from gpunb.runtime.result import TrainResult


@pytest.mark.parametrize("name, kind, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0),  # the SXM part's name
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H100 NVL", "fp16", 835.0),
    ("NVIDIA H200", "tf32", 495.0),
    ("NVIDIA H200 NVL", "bf16", 835.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "tf32", 156.0),
    ("NVIDIA A10", "bf16", 125.0),
    ("NVIDIA L40S", "bf16", 362.0),
    ("NVIDIA L40", "bf16", 181.0),
    ("NVIDIA L4", "fp32", 30.3),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.0),
    ("NVIDIA GeForce RTX 3090", "fp16", 71.0),
    ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ("Tesla V100-PCIE-32GB", "fp16", 112.0),
    ("Tesla T4", "fp16", 65.0),
    ("Tesla T4", "tf32", 8.1),  # no TF32 tensor cores: fp32 matmuls run at the fp32 rate
])
def test_the_dense_peak_of_known_gpus(name, kind, peak):
    assert peak_tflops(name, kind) == peak


@pytest.mark.parametrize("name, kind", [("NVIDIA A10G", "bf16"), ("NVIDIA GeForce RTX 3090 Ti", "bf16"),
                                        ("Tesla V100-SXM2-16GB", "bf16"), ("CPU", "fp32"),
                                        ("AMD Instinct MI300X", "bf16")])
def test_an_unknown_device_or_a_precision_it_lacks_has_no_peak(name, kind):
    assert peak_tflops(name, kind) is None


def test_the_precision_kind_follows_the_run_and_the_tf32_setting():
    assert [precision_kind(p, tf32=True) for p in ("bf16-mixed", "16-mixed", "32")] == ["bf16", "fp16", "tf32"]
    assert precision_kind("32", tf32=False) == "fp32"


def test_a_cuda_device_is_looked_up_by_its_name_and_the_cpu_has_no_peak(monkeypatch):
    monkeypatch.setattr(devices, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert device_peak_tflops(torch.device("cuda", 0), "bf16-mixed") == 989.0
    assert device_peak_tflops(torch.device("cpu"), "bf16-mixed") is None


def fit_linear(**options):
    inputs, outputs = 12, 5
    model = nn.Linear(inputs, outputs, bias=False)
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(64, inputs, generator=g), torch.randn(64, outputs, generator=g))
    options = {"batch_size": 8, "epochs": 1, "track": False, "accelerator": "cpu", **options}
    return Trainer(**options).fit(model, data, loss_fn=nn.MSELoss())


def test_a_cpu_result_has_flops_per_step_and_achieved_tflops_but_no_mfu():
    result = fit_linear(grad_accum=2)
    # forward 2*in*out per sample, backward the weight's gradient as much again; 8 x 2 samples per step
    assert result.summary.train_flops == 4 * 12 * 5
    assert result.flops_per_step == 4 * 12 * 5 * 8 * 2
    assert result.achieved_tflops == pytest.approx(
        result.flops_per_step * result.steps / (result.wall_time_s - result.validation_s) / 1e12)
    assert result.achieved_tflops > 0
    assert result.peak_tflops is None and result.mfu is None
    assert result.tokens_per_s is None  # float features are not token ids


def test_mfu_is_achieved_over_the_devices_peak(monkeypatch):
    monkeypatch.setattr(prepare, "device_peak_tflops", lambda device, precision: 500.0)
    result = fit_linear()
    assert result.peak_tflops == 500.0
    assert result.mfu == pytest.approx(result.achieved_tflops / 500.0)


def test_nothing_is_claimed_when_flops_were_not_counted():
    result = TrainResult("r", steps=10, wall_time_s=2.0, peak_tflops=989.0,
                         summary=RunSummary("M", 1, 0, 8, "cuda", "bf16-mixed"))
    assert (result.flops_per_step, result.achieved_tflops, result.mfu, result.tokens_per_s) == (None,) * 4


def test_a_resumed_run_counts_only_the_steps_it_took():
    summary = RunSummary("M", 1, 0, 4, "cuda", "bf16-mixed", train_flops=10**9, tokens_per_sample=128)
    result = TrainResult("r", batch_size=4, steps=30, wall_time_s=2.0, validation_s=1.0, peak_tflops=100.0,
                         start_step=20, summary=summary)
    assert result.flops_per_step == 4 * 10**9
    assert result.achieved_tflops == pytest.approx(4 * 10**9 * 10 / 1.0 / 1e12)
    assert result.mfu == pytest.approx(result.achieved_tflops / 100.0)
    assert result.tokens_per_s == pytest.approx(4 * 128 * 10 / 1.0)


@pytest.mark.parametrize("batch, tokens", [
    (torch.zeros(4, 16, dtype=torch.long), 16),
    ((torch.zeros(4, 16, dtype=torch.int32), torch.zeros(4, 16, dtype=torch.long)), 16),
    ({"input_ids": torch.zeros(4, 7, dtype=torch.long), "labels": torch.zeros(4, 7, dtype=torch.long)}, 7),
    ((torch.zeros(4, 16), torch.zeros(4, dtype=torch.long)), None),  # float features
    (torch.zeros(4, dtype=torch.long), None),  # one id per sample: not a sequence
    ({"pixel_values": torch.zeros(4, 3, 8, 8)}, None),
])
def test_tokens_per_sample_is_read_from_the_first_batchs_shape(batch, tokens):
    assert tokens_per_sample(batch) == tokens


class TinyLM(nn.Module):
    def __init__(self, vocab=32, width=8):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, ids):  # (B, T) -> (B, T, vocab)
        return self.head(self.embed(ids))


def test_token_id_batches_give_tokens_per_s():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (32, 6), generator=g)

    def loss_fn(logits, targets):
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    result = Trainer(batch_size=8, epochs=1, track=False, accelerator="cpu").fit(
        TinyLM(), (ids, ids), loss_fn=loss_fn)
    assert result.summary.tokens_per_sample == 6
    train_s = result.wall_time_s - result.validation_s
    assert result.tokens_per_s == pytest.approx(8 * 6 * result.steps / train_s)


# --------------------------------------------------------------------------- where it is shown
def gpu_result():
    summary = RunSummary("M", 1, 0, 4, "cuda", "bf16-mixed", train_flops=10**12, tokens_per_sample=100)
    return TrainResult("r", device="cuda:0", precision="bf16-mixed", batch_size=4, steps=10, samples=40,
                       wall_time_s=2.0, validation_s=1.0, peak_tflops=989.0, summary=summary)


def test_the_html_summary_shows_mfu_and_tokens_but_the_text_repr_stays_free_of_timings():
    result = gpu_result()
    rows = dict(render.summary_rows(result))
    assert rows["compute"] == "40 TFLOPS, MFU 4.0% of 989, 4 T FLOPs per step"
    assert rows["tokens"] == "4,000/s"
    assert "MFU 4.0%" in result._repr_html_()
    assert "TFLOPS" not in repr(result) and "MFU" not in repr(result)


def test_a_cpu_result_shows_achieved_flops_without_mfu():
    rows = dict(render.summary_rows(fit_linear()))
    assert re.match(r"[\d.]+ [KMGT]?FLOPS, ", rows["compute"]), rows["compute"]
    assert "MFU" not in rows["compute"] and "tokens" not in rows


def test_the_live_progress_line_shows_mfu_from_the_last_intervals_step_time():
    state = FitState(config=TrainConfig(batch_size=4, grad_accum=2), model=None, optimizer=None,
                     device=torch.device("cpu"), world_size=2)
    state.summary, state.peak_tflops = {"train_flops": 10**12}, 800.0
    state.latest["step_time_ms"] = 100.0  # 16 samples x 1 TFLOP in 0.1 s
    assert render.live_compute_text(state) == "160 TFLOPS, MFU 20.0% of 800"
    assert "160 TFLOPS, MFU 20.0% of 800" in render.progress_line(state)
    state.peak_tflops = None
    assert render.live_compute_text(state) == "160 TFLOPS"
    state.summary = {"train_flops": None}
    assert render.live_compute_text(state) is None and "TFLOPS" not in render.progress_line(state)


def test_the_registry_keeps_the_runs_compute_figures(monkeypatch):
    from gpunb.runs.registry import Registry

    monkeypatch.setattr(prepare, "device_peak_tflops", lambda device, precision: 500.0)
    result = fit_linear(track=True)
    (run,) = Registry().list_runs()
    assert run["latest"]["mfu"] == pytest.approx(result.mfu)
    assert run["latest"]["achieved_tflops"] == pytest.approx(result.achieved_tflops)
    assert "tokens_per_s" not in run["latest"]


def test_a_continued_fit_counts_only_its_own_steps():
    model = nn.Linear(12, 5, bias=False)
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(64, 12, generator=g), torch.randn(64, 5, generator=g))
    first = Trainer(batch_size=8, epochs=1, track=False, accelerator="cpu").fit(model, data, loss_fn=nn.MSELoss())
    second = Trainer(batch_size=8, epochs=1, track=False, accelerator="cpu").fit(
        model, data, loss_fn=nn.MSELoss(), continue_from=first)
    assert (first.start_step, second.start_step, second.steps) == (0, 8, 16)
    train_s = second.wall_time_s - second.validation_s
    assert second.achieved_tflops == pytest.approx(second.flops_per_step * 8 / train_s / 1e12)
