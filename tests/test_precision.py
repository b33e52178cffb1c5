"""Precision policy per device capability, fp16 loss scaling, and its checkpointed state."""

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

from gpunb import TrainConfig, Trainer
from gpunb.runtime import device as devices
from gpunb.runtime.context import LocalContext
from gpunb.runtime.loop import run
from gpunb.runtime.setup import setup
from gpunb.runtime.state.checkpoint_files import load_checkpoint
from gpunb.runtime.step.precision import Precision, resolve_precision

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
    from gpunb.runtime.state.checkpoint_files import list_checkpoints

    return list_checkpoints(directory)[-1]


class RecordingScaler(torch.amp.GradScaler):
    """A strategy's own loss scaler (as FSDP's ShardedGradScaler): notes each one built and its steps."""

    built = []

    def __init__(self, device):
        super().__init__(device)
        self.steps = 0
        RecordingScaler.built.append(self)

    def step(self, optimizer, *args, **kwargs):
        self.steps += 1
        return super().step(optimizer, *args, **kwargs)


class ScalingContext(LocalContext):
    grad_scaler = RecordingScaler


def test_the_precision_is_built_with_the_scaler_the_context_hands_over():
    cpu = torch.device("cpu")
    assert isinstance(Precision("16-mixed", cpu, scaler_type=RecordingScaler).scaler, RecordingScaler)
    assert Precision("bf16-mixed", cpu, scaler_type=RecordingScaler).scaler is None
    assert type(Precision("16-mixed", cpu).scaler) is torch.amp.GradScaler
    model = mlp()
    ready = setup(TrainConfig(accelerator="cpu", precision="16-mixed"), ScalingContext(), model,
                  classification_data(n=32))
    assert isinstance(ready.precision.scaler, RecordingScaler) and ready.precision.name == "16-mixed"
    assert ready.val is None and ready.precision_reason == "asked for"
    assert ready.optimizer.param_groups[0]["params"][0] is model[0].weight  # the default optimizer, built


def test_a_run_steps_with_the_scaler_built_at_set_up_and_never_swaps_it():
    RecordingScaler.built.clear()
    x, y = classification_data(n=64)
    config = TrainConfig(epochs=1, batch_size=16, precision="16-mixed", accelerator="cpu", track=False)
    result = run(config, ScalingContext(), mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    assert result.steps == 4
    assert [scaler.steps for scaler in RecordingScaler.built] == [4]  # one scaler, every step through it


def test_fsdp_hands_its_sharded_scaler_to_the_precision_and_ddp_none():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from gpunb.distributed.context import ProcessGroupRank

    rank = object.__new__(ProcessGroupRank)  # no process group needed to ask which scaler
    rank.strategy = "fsdp"
    assert rank.grad_scaler is ShardedGradScaler
    rank.strategy = "ddp"
    assert rank.grad_scaler is None
    assert LocalContext.grad_scaler is None


def test_nothing_replaces_a_precisions_scaler_after_it_is_built():
    import pathlib
    import re

    import gpunb

    root = pathlib.Path(gpunb.__file__).parent
    assigned = [str(path.relative_to(root)) for path in root.rglob("*.py")
                if re.search(r"\.scaler\s*=[^=]", path.read_text())]
    assert assigned == ["runtime/step/precision.py"]
