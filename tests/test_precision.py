"""Precision policy per device capability, fp16 loss scaling, and its checkpointed state."""

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

from gpunb import Trainer
from gpunb.runtime import device as devices
from gpunb.runtime.checkpoint import load_checkpoint
from gpunb.runtime.precision import Precision, resolve_precision

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("bf16,capability,expected", [
    (True, (9, 0), "bf16-mixed"),   # Hopper
    (True, (8, 0), "bf16-mixed"),   # Ampere
    (False, (7, 0), "16-mixed"),    # Volta: fp16 + GradScaler
    (False, (6, 1), "16-mixed"),    # Pascal
])
def test_auto_precision_follows_the_gpu(monkeypatch, bf16, capability, expected):
    monkeypatch.setattr(devices, "cuda_bf16_supported", lambda device: bf16)
    monkeypatch.setattr(devices, "cuda_capability", lambda device: capability)
    name, reason = resolve_precision("auto", CUDA)
    assert name == expected
    assert ("fp16 with loss scaling" in reason) == (expected == "16-mixed")


def test_auto_is_fp32_on_cpu_and_mps_and_explicit_choices_win():
    assert resolve_precision("auto", torch.device("cpu"))[0] == "32"
    assert resolve_precision("auto", torch.device("mps"))[0] == "32"
    assert resolve_precision("bf16-mixed", torch.device("cpu")) == ("bf16-mixed", "asked for")


def test_only_fp16_gets_a_scaler():
    cpu = torch.device("cpu")
    assert Precision("16-mixed", cpu).scaler is not None
    assert Precision("bf16-mixed", cpu).scaler is None
    assert Precision("32", cpu).scaler is None


def test_bf16_on_cpu_trains_to_fp32_accuracy():
    x, y = classification_data(n=512)
    accuracy = {}
    for precision in ("32", "bf16-mixed"):
        result = Trainer(epochs=10, batch_size=32, lr=1e-2, precision=precision, track=False).fit(
            mlp(), (x[:400], y[:400]), (x[400:], y[400:]), loss_fn=nn.CrossEntropyLoss())
        assert result.precision == precision
        accuracy[precision] = result.final_metrics["val_acc"]
    assert accuracy["bf16-mixed"] == pytest.approx(accuracy["32"], abs=0.03)


def test_fp16_skipped_steps_are_counted_and_scaler_state_checkpointed(tmp_path):
    model = mlp()
    calls = {"n": 0}

    def poison(grad):  # inf gradients on the 3rd backward: the scaler must skip that step
        calls["n"] += 1
        return grad * float("inf") if calls["n"] == 3 else grad

    model[0].weight.register_hook(poison)
    x, y = classification_data(n=128)
    result = Trainer(epochs=1, batch_size=16, precision="16-mixed", track=False,
                     checkpoint_dir=tmp_path).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss())
    assert result.skipped_steps == 1
    scaler = load_checkpoint(result_checkpoint(tmp_path))["precision"]
    assert scaler["skipped"] == 1
    assert scaler["scaler"]["scale"] == pytest.approx(2.0**16 * 0.5)  # halved once by the skip

    resumed_model = mlp()
    resumed = Trainer(epochs=2, batch_size=16, precision="16-mixed", track=False, checkpoint_dir=tmp_path,
                      resume="last").fit(resumed_model, (x, y), loss_fn=nn.CrossEntropyLoss())
    assert resumed.skipped_steps == 1  # carried over from the checkpoint


def result_checkpoint(directory):
    from gpunb.runtime.checkpoint import list_checkpoints

    return list_checkpoints(directory)[-1]
