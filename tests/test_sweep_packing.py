"""A sweep's trials packed onto this machine's GPUs by their memory estimates (sweeps/packing.py).

The placement is pure bookkeeping over a device list, so it is tested with devices made up
here; the sweep's jobs are tested on the CPU with a made-up device list too: each trial's job
gets CUDA_VISIBLE_DEVICES as the packer chose (harmless where no GPU is), which its own
process reports back. Reading the real devices is the one `cuda` test.
"""

import json
import os
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

import gpunb
from gpunb import Trainer
from gpunb.config import TrainConfig
from gpunb.errors import GpunbError
from gpunb.sweeps import packing
from gpunb.sweeps.packing import CONTEXT_BYTES, Device, Need, Packer, Slot, trial_need

optuna = pytest.importorskip("optuna")  # the [sweep] extra; the test command installs it

GiB = 2**30
# The jobs import nothing from the tests (pytest's sys.path is not theirs): EnvRecorder travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def gpu(index: int, free: float) -> Device:
    return Device(index, f"GPU-fake-{index}", int(free * GiB), int(free * GiB))


def small(gib: float) -> Need:
    """A one-GPU trial that books `gib` GiB with its CUDA context."""
    return Need(int(gib * GiB) - CONTEXT_BYTES)


def test_small_trials_share_a_gpu_while_their_sum_fits_and_a_freed_slot_takes_the_next():
    packer = Packer(devices=[gpu(0, 10)])  # usable: 9 GiB (SAFETY 0.9)
    slots = [packer.place(small(3)) for _ in range(3)]
    assert [s.visible for s in slots] == ["GPU-fake-0"] * 3  # 9 GiB: exactly the sum
    assert packer.place(small(3)) is None  # a fourth waits
    assert packer.place(small(0.5)) is None
    packer.release(slots[1])
    assert packer.place(small(3)).visible == "GPU-fake-0"  # the freed room takes the next trial
    assert packer.place(small(0.5)) is None


def test_trials_spread_over_the_gpus_before_they_share_one():
    packer = Packer(devices=[gpu(0, 10), gpu(1, 10)])
    assert [packer.place(small(2)).visible for _ in range(4)] == ["GPU-fake-0", "GPU-fake-1"] * 2


def test_a_trial_larger_than_a_gpu_runs_alone_on_one_and_a_trial_that_fits_one_gpu_only_goes_there():
    packer = Packer(devices=[gpu(0, 10), gpu(1, 40)])
    packer.place(small(1))  # on GPU 1, the most room
    sixteen = packer.place(small(16))  # fits GPU 1 beside it, not GPU 0
    assert sixteen.devices == (packer.devices[1],) and sixteen.bytes == 16 * GiB
    packer.release(sixteen)
    alone = packer.place(small(100))  # larger than any GPU: one GPU alone, the empty one
    assert alone.visible == "GPU-fake-0" and alone.bytes is None
    assert packer.place(small(0.5)).visible == "GPU-fake-1"  # nothing shares the whole one
    assert packer.place(small(100)) is None  # no empty GPU left: it waits
    packer.release(alone)
    assert packer.place(Need(None)).visible == "GPU-fake-0"  # an unknown estimate: a whole GPU too


def test_a_trial_of_several_gpus_takes_that_many_whole_gpus():
    packer = Packer(devices=[gpu(0, 10), gpu(1, 10), gpu(2, 10)])
    one = packer.place(small(1))
    two = packer.place(Need(None, 2))
    assert one.visible == "GPU-fake-0" and two.visible == "GPU-fake-1,GPU-fake-2"
    assert packer.place(Need(None, 2)) is None and packer.place(small(1)).visible == "GPU-fake-0"
    packer.release(two)
    assert packer.place(Need(None, 2)).visible == "GPU-fake-1,GPU-fake-2"


def test_on_a_machine_without_gpus_every_trial_is_placed_and_cuda_visible_devices_is_left_alone():
    packer = Packer(TrainConfig(), devices=[])
    assert packer.need({}, 0) == Need(0, 0, "no GPU")
    assert all(packer.place(Need(0, 0)) == Slot() for _ in range(8)) and Slot().visible is None


def _arguments(hidden=32, **extra):
    x, y = classification_data()
    model = mlp(hidden=hidden)
    return dict(dict(model=model, train_data=(x, y), val_data=(x[:32], y[:32]), loss_fn=nn.CrossEntropyLoss(),
                     optimizer=torch.optim.AdamW(model.parameters())), **extra)


def test_a_trials_estimate_is_the_summary_of_its_fit_and_the_kernels_rngs_are_left_alone():
    config = TrainConfig(batch_size=32, precision="32", seed=0)
    arguments = _arguments()
    torch.manual_seed(123)
    need = trial_need(config, arguments, [gpu(0, 10)])
    drawn = torch.rand(1)
    torch.manual_seed(123)
    assert torch.equal(drawn, torch.rand(1))  # the dry run neither seeded nor drew
    summary = Trainer(config, accelerator="cpu").summary(
        arguments["model"], arguments["train_data"], arguments["val_data"], loss_fn=arguments["loss_fn"],
        optimizer=arguments["optimizer"])
    assert need == Need(summary.estimated_bytes, 1, "its summary's estimate")
    assert summary.activations_bytes and summary.optimizer_bytes  # every part counted
    assert trial_need(config, _arguments(hidden=256), [gpu(0, 10)]).bytes > need.bytes


@pytest.mark.parametrize("settings, arguments, expected", [
    (dict(memory_budget="3GiB"), {}, Need(3 * GiB, 1, "memory_budget")),
    (dict(batch_size="auto"), {}, Need(None, 1, 'batch_size="auto" fills its GPU')),
    (dict(devices=2), {}, Need(None, 2, "2 GPUs")),
    (dict(gpus_per_node=3), {}, Need(None, 3, "3 GPUs")),
    (dict(accelerator="cpu"), {}, Need(0, 0, "no GPU")),
    (dict(batch_size=32), dict(loss_fn=None, step=lambda model, batch: model(batch[0]).sum()), None),
])
def test_what_a_trial_needs_when_its_estimate_is_set_unknown_or_on_several_gpus(settings, arguments, expected):
    need = trial_need(TrainConfig(**settings), _arguments(**arguments), [gpu(0, 10), gpu(1, 10)])
    if expected is None:  # a custom step is not run ahead of time: no activations, so a whole GPU
        assert need.bytes is None and need.gpus == 1 and "custom step" in need.why
    else:
        assert need == expected


def test_a_trial_that_cannot_fit_even_alone_or_asks_more_gpus_than_there_are_is_one_message():
    # 4 MiB beside a trial's CUDA context: 1M parameters' weights, gradients and AdamW states do not fit
    packer = Packer(TrainConfig(batch_size=32), devices=[Device(0, "GPU-small", 2 * GiB, CONTEXT_BYTES + 2**22)])
    big = nn.Linear(1000, 1000)
    arguments = dict(model=big, train_data=(torch.randn(64, 1000), torch.randn(64, 1000)), loss_fn=nn.MSELoss(),
                     optimizer=torch.optim.AdamW(big.parameters()))
    with pytest.raises(GpunbError, match="Trial 3 cannot fit on any GPU of this machine, even alone") as raised:
        packer.need(arguments, 3)
    assert "HINT: train it smaller" in str(raised.value) and "--cluster slurm" in str(raised.value)
    with pytest.raises(GpunbError, match="Trial 1 trains on 2 GPUs, and this machine has 1") as raised:
        Packer(TrainConfig(devices=2), devices=[gpu(0, 10)]).need({}, 1)
    assert "HINT: ask for at most 1 (`--devices 1`)" in str(raised.value)


class EnvRecorder(nn.CrossEntropyLoss):
    """A loss that records the CUDA_VISIBLE_DEVICES of the process it runs in, and when that process
    computed its first and last loss (the kernel's estimate runs it first, then the trial's job)."""

    def __init__(self, path):
        super().__init__()
        self.path = str(path)

    def forward(self, logits, target):
        import time

        path = Path(self.path)
        before = json.loads(path.read_text()) if path.exists() else {}
        first = before["first"] if before.get("pid") == os.getpid() else time.time()
        path.write_text(json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
                                    "first": first, "last": time.time()}))
        return super().forward(logits, target)


def _recording_build(folder):
    def build(trial):
        x, y = classification_data()
        model = mlp(hidden=gpunb.suggest("hidden", [8, 32]))
        return dict(model=model, train_data=(x[:192], y[:192]), val_data=(x[192:], y[192:]),
                    loss_fn=EnvRecorder(Path(folder) / f"t{trial.number}.json"),
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return build


def _sweep_on(devices, monkeypatch, tmp_path, trials, name):
    """A --parallel 2 sweep whose packer reads `devices`; each trial's placement and what its job saw."""
    monkeypatch.setattr(packing, "read_devices", lambda: list(devices))
    placed = []
    original = Packer.place

    def spy(self, need):
        slot = original(self, need)
        if slot is not None:
            placed.append(slot.visible)
        return slot

    monkeypatch.setattr(Packer, "place", spy)
    sweep = Trainer(epochs=2, batch_size=32, seed=0, track=False, precision="32").sweep(
        _recording_build(tmp_path), trials=trials, parallel=2, sampler="random", seed=1, name=name)
    assert set(sweep.table["state"]) == {"complete"}, sweep.rows
    seen = [json.loads((tmp_path / f"t{n}.json").read_text()) for n in range(trials)]
    return placed, seen


def test_each_trials_job_is_given_the_gpus_the_packer_chose(monkeypatch, tmp_path):
    # room for one trial a GPU (a trial books its CUDA context): two at once, on one GPU each
    placed, seen = _sweep_on([gpu(0, 1), gpu(1, 1)], monkeypatch, tmp_path, 3, "packed2")
    assert placed[:2] == ["GPU-fake-0", "GPU-fake-1"] and placed[2] in ("GPU-fake-0", "GPU-fake-1")
    assert [s["visible"] for s in seen] == placed  # trial k was the k-th placed: its process saw its GPU
    assert len({s["pid"] for s in seen} | {os.getpid()}) == 4  # each trial in a process of its own


def test_a_trial_that_finds_no_gpu_room_waits_for_one_to_end(monkeypatch, tmp_path):
    placed, seen = _sweep_on([gpu(0, 1)], monkeypatch, tmp_path, 2, "packed1")  # --parallel 2, room for 1
    assert placed == ["GPU-fake-0"] * 2 and [s["visible"] for s in seen] == placed
    assert seen[0]["last"] < seen[1]["first"]  # one after the other, though two could run at once


def test_a_trial_too_large_for_every_gpu_stops_the_sweep_before_any_job_is_submitted(monkeypatch, gpunb_home):
    monkeypatch.setattr(packing, "read_devices", lambda: [gpu(0, 0.001)])
    submitted = []
    monkeypatch.setattr(Trainer, "_trial_job", lambda *a, **k: submitted.append(a))
    with pytest.raises(GpunbError, match="Trial 0 cannot fit on any GPU"):
        Trainer(epochs=1, batch_size=32, track=False).sweep(_recording_build(gpunb_home), trials=2, parallel=2,
                                                             sampler="random", seed=0, name="toolarge")
    assert not submitted


def test_without_nvml_each_visible_gpu_is_named_as_the_kernel_sees_it_and_runs_one_trial(monkeypatch):
    from gpunb.telemetry import nvml

    monkeypatch.setattr(nvml, "ensure_nvml", lambda: nvml.NO_DRIVER_REASON)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    devices = packing.read_devices()
    assert [(d.index, d.name, d.free) for d in devices] == [(0, "3", 0), (1, "5", 0)]
    packer = Packer(TrainConfig(batch_size=32), devices=devices)
    need = packer.need(_arguments(), 0)
    assert need.bytes is None and "no NVML" in need.why
    assert [packer.place(need).visible for _ in range(2)] == ["3", "5"] and packer.place(need) is None


@pytest.mark.cuda
def test_the_gpus_are_read_from_nvml_in_cudas_numbering_without_a_cuda_context():
    initialised = torch.cuda.is_initialized()
    devices = packing.read_devices()
    assert torch.cuda.is_initialized() == initialised  # NVML only
    assert len(devices) == torch.cuda.device_count()
    for device in devices:  # CUDA's device i is the one the name points at
        uuid = str(torch.cuda.get_device_properties(device.index).uuid)
        assert device.name.startswith(("GPU-", "MIG-")) and device.name.endswith(uuid)
        assert 0 < device.free <= device.total
    free, total = torch.cuda.mem_get_info(0)
    assert total == pytest.approx(devices[0].total, rel=0.02)


class _FixedNeeds(Packer):
    """A packer whose trials each book 0.5 GiB (no estimate is run)."""

    def need(self, arguments, trial):
        return small(0.5)


class _StoppableJob:
    """A trial's job as the sweep follows it: it runs until it is asked to stop; it presses the
    kernel's interrupt once, at its first poll after the next trial was built."""

    def __init__(self, built):
        self.built, self.stop_asked, self.pressed = built, False, False

    def poll(self):
        import signal
        from types import SimpleNamespace

        if len(self.built) == 2 and not self.pressed:
            self.pressed = True
            os.kill(os.getpid(), signal.SIGINT)
        if self.stop_asked:
            return SimpleNamespace(steps=3, status="stopped", stop_reason="stopped from the notebook")
        return None

    def stop(self, reason):
        self.stop_asked = True


def test_a_trial_still_waiting_for_gpu_room_when_the_sweep_is_stopped_is_recorded_and_never_submitted(tmp_path):
    from gpunb.sweeps.parallel import run_trial_jobs
    from gpunb.sweeps.study import SweepSettings

    built, started = [], []

    def build(trial):
        built.append(trial.number)
        return dict(_arguments(), val_data=([0], [0]))

    def start(arguments, callbacks, trial_name, key, sweep=None, visible=None):
        started.append((trial_name, visible))
        return _StoppableJob(built)

    packer = _FixedNeeds(devices=[gpu(0, 1)])  # room for one trial
    settings = SweepSettings(3, sampler="random", seed=0, monitor="val_loss")
    rows, study, best = run_trial_jobs(build, start, settings, tmp_path, "stopwait", 2, packer=packer)
    assert started == [("stopwait-t0", "GPU-fake-0")] and built == [0, 1]  # trial 1 waited, trial 2 never asked
    assert {r.number: r.state for r in rows} == {0: "stopped", 1: "stopped"}
    assert "before the trial found GPU room" in rows[[r.number for r in rows].index(1)].error
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]  # none left running in the study
    assert best is None
