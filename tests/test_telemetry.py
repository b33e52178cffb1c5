"""gpunb.telemetry: NVML mocked at the pynvml function boundary, and the real no-GPU path."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from gpunb.runtime.events import FitState
from gpunb.telemetry import (
    EnergyMeter,
    GpuSampler,
    TelemetryCallback,
    nvml,
    sampler,
    snapshot,
)
from gpunb.telemetry.text import status_text

MB = 1024 * 1024


def _real_nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.fixture(autouse=True)
def fresh_nvml_state(monkeypatch):
    """Forget the process-wide NVML init outcome, so each test sees its own (fake or real) NVML."""
    monkeypatch.setattr(nvml, "_initialised", False)
    monkeypatch.setattr(nvml, "_init_error", None)


def _not_supported(*args):
    raise pynvml.NVMLError_NotSupported()


class FakeNvml:
    """Two fake GPUs behind the pynvml functions gpunb calls.

    PCIe throughput is not supported (NVMLError_NotSupported) on every GPU; GPU 1 also
    fails its temperature read with a generic NVMLError. `energy_supported=False`
    makes the total-energy counter unsupported too. Each energy read advances the
    counter by 50 J, so the energy over n samples is 50 * (n - 1).
    """

    def __init__(self, monkeypatch, count: int = 2, energy_supported: bool = True, migs=None):
        self.count = count
        self.migs = migs or {}  # GPU index -> [(GPU instance id, compute instance id), ...]: MIG mode on
        self.energy_supported = energy_supported
        self.inits = 0
        self.shutdowns = 0
        self.energy_mj = {0: 1_000_000, 1: 5_000_000}
        self.lock = threading.Lock()
        handle = SimpleNamespace
        fake = {
            "nvmlInit": self.init,
            "nvmlShutdown": self.shutdown,
            "nvmlSystemGetDriverVersion": lambda: "550.54.15",
            "nvmlDeviceGetCount": lambda: self.count,
            "nvmlDeviceGetHandleByIndex": lambda i: handle(i=i),
            "nvmlDeviceGetHandleByUUID": self.handle_by_uuid,
            "nvmlDeviceGetIndex": lambda h: h.i,
            "nvmlDeviceGetName": self.name,
            "nvmlDeviceGetUUID": lambda h: f"MIG-0000000{h.i}-{h.m}bbb" if hasattr(h, "m") else f"GPU-0000000{h.i}-aaaa",
            "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=97, memory=41),
            "nvmlDeviceGetMemoryInfo": lambda h: (SimpleNamespace(used=256 * MB, total=10240 * MB, free=0)
                                                  if hasattr(h, "m") else
                                                  SimpleNamespace(used=1024 * MB, total=81920 * MB, free=0)),
            "nvmlDeviceGetMigMode": lambda h: (1, 1) if h.i in self.migs else _not_supported(),
            "nvmlDeviceGetMaxMigDeviceCount": lambda h: 7,
            "nvmlDeviceGetMigDeviceHandleByIndex": self.mig_handle,
            "nvmlDeviceGetGpuInstanceId": lambda h: self.migs[h.i][h.m][0],
            "nvmlDeviceGetComputeInstanceId": lambda h: self.migs[h.i][h.m][1],
            "nvmlDeviceGetPowerUsage": lambda h: 350_500,  # mW
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700_000,
            "nvmlDeviceGetTemperature": self.temperature,
            "nvmlDeviceGetClockInfo": lambda h, kind: {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}[kind],
            "nvmlDeviceGetPcieThroughput": _not_supported,
            "nvmlDeviceGetTotalEnergyConsumption": self.energy,
            "nvmlDeviceGetComputeRunningProcesses": lambda h: [
                SimpleNamespace(pid=4242, usedGpuMemory=512 * MB), SimpleNamespace(pid=4343, usedGpuMemory=None)],
        }
        for name, function in fake.items():
            monkeypatch.setattr(pynvml, name, function)

    def init(self):
        with self.lock:
            self.inits += 1

    def shutdown(self):
        with self.lock:
            self.shutdowns += 1

    def name(self, handle):
        if hasattr(handle, "m"):
            return "NVIDIA A100 MIG 1g.10gb"
        return b"NVIDIA H100 80GB HBM3" if handle.i == 0 else "NVIDIA A10"

    def mig_handle(self, handle, index):
        if index >= len(self.migs.get(handle.i, ())):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return SimpleNamespace(i=handle.i, m=index)

    def handle_by_uuid(self, uuid):
        if uuid == "GPU-00000001-aaaa":
            return SimpleNamespace(i=1)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def temperature(self, handle, sensor):
        if handle.i == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return 61

    def energy(self, handle):
        if not self.energy_supported:
            _not_supported()
        with self.lock:
            self.energy_mj[handle.i] += 50_000
            return self.energy_mj[handle.i]


# ---------------------------------------------------------------------- snapshot
@pytest.mark.skipif(_real_nvml_works(), reason="this machine has an NVIDIA driver")
def test_snapshot_without_a_driver_reports_why_and_host_stats():
    snap = snapshot()
    assert snap["nvidia"] is False
    assert snap["reason"] == nvml.NO_DRIVER_REASON
    assert snap["gpus"] == []
    assert "driver" not in snap
    host = snap["host"]
    assert set(host) == {"cpu_percent", "cpu_count", "ram_used_mb", "ram_total_mb", "ram_percent"}
    assert host["cpu_count"] >= 1 and 0 < host["ram_used_mb"] < host["ram_total_mb"]
    json.dumps(snap, allow_nan=False)


def test_snapshot_with_mocked_gpus_leaves_out_unsupported_fields(monkeypatch):
    FakeNvml(monkeypatch)
    snap = snapshot()
    json.dumps(snap, allow_nan=False)
    assert list(snap) == ["time", "nvidia", "driver", "host", "gpus"]
    assert snap["nvidia"] is True and snap["driver"] == "550.54.15"
    first, second = snap["gpus"]
    assert first == {
        "index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-00000000-aaaa",
        "utilization_gpu": 97.0, "utilization_memory": 41.0,
        "memory_used_mb": 1024.0, "memory_total_mb": 81920.0,
        "power_w": 350.5, "power_limit_w": 700.0, "temperature_c": 61.0,
        "clock_sm_mhz": 1980.0, "clock_mem_mhz": 2619.0, "energy_j": 1050.0,
        "processes": [{"pid": 4242, "used_memory_mb": 512.0}, {"pid": 4343, "used_memory_mb": None}],
    }  # no pcie_* keys: NotSupported
    assert second["name"] == "NVIDIA A10" and "temperature_c" not in second  # generic NVMLError
    assert second["power_w"] == 350.5


def test_nvml_is_initialised_once_per_process(monkeypatch):
    fake = FakeNvml(monkeypatch)
    snapshot()
    snapshot()
    assert fake.inits == 1


def test_snapshot_with_a_driver_but_no_devices(monkeypatch):
    FakeNvml(monkeypatch, count=0)
    snap = snapshot()
    assert snap["nvidia"] is False and snap["reason"] == nvml.NO_DEVICE_REASON and snap["gpus"] == []


def test_import_touches_neither_nvml_nor_the_registry(tmp_path):
    code = ("import pynvml, sys\n"
            "def boom(): raise SystemExit('nvmlInit called at import')\n"
            "pynvml.nvmlInit = boom\n"
            "import gpunb.telemetry, gpunb.runs\n")
    repo = str(Path(__file__).resolve().parents[1])
    env = {"GPUNB_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "PYTHONPATH": repo}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=str(tmp_path), timeout=60)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "home").exists()


def test_cuda_index_maps_to_nvml_index(monkeypatch):
    FakeNvml(monkeypatch, count=4)
    assert nvml.nvml_index_for_cuda_device(0, "GPU-00000001-aaaa") == 1  # the UUID wins
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert nvml.nvml_index_for_cuda_device(0, "GPU-unknown") == 3
    assert nvml.nvml_index_for_cuda_device(1) == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml.nvml_index_for_cuda_device(2) == 2


@pytest.mark.parametrize("value, expected", [
    (None, [0, 1, 2, 3]),  # unset: every GPU
    ("3,1", [3, 1]),
    (" 2 , 0", [2, 0]),
    ("2abc", [2]),  # CUDA reads the digits of an entry
    ("GPU-00000002-aaaa", [2]),
    ("GPU-00000002", [2]),  # a unique UUID prefix
    ("gpu-00000003", [3]),
    ("GPU-0000000", []),  # a prefix of several GPUs names none
    ("0,5,1", [0]),  # the list ends at the first entry that names no device
    ("1,GPU-00000002-aaaa", [1]),  # indices and UUIDs do not mix
    ("1,1", []),  # a repeated entry hides every device
    ("", []),
    ("-1", []),
])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(monkeypatch, value, expected):
    from gpunb.telemetry.visible import inventory, visible_devices

    FakeNvml(monkeypatch, count=4)
    assert visible_devices(value, inventory()) == expected


@pytest.mark.parametrize("value, expected", [
    ("MIG-00000001-1bbb", [(1, 1)]),
    ("MIG-00000001-0", [(1, 0)]),  # a MIG UUID prefix
    ("MIG-GPU-00000001-aaaa/2/0", [(1, 1)]),  # GPU UUID / GPU instance / compute instance
    ("MIG-GPU-00000001/1/0", [(1, 0)]),  # ... with an abbreviated GPU UUID
    ("MIG-GPU-00000001-aaaa/9/0", []),
    ("MIG-00000001-1bbb,MIG-00000001-0bbb", [(1, 1)]),  # one MIG instance at most
    ("0,1", [(1, 0)]),  # a GPU in MIG mode shows its first instance and hides the others
    ("0", [0]),
    (None, [(1, 0)]),
])
def test_mig_instances_in_cuda_visible_devices(monkeypatch, value, expected):
    from gpunb.telemetry.visible import inventory, visible_devices

    FakeNvml(monkeypatch, migs={1: [(1, 0), (2, 0)]})
    assert visible_devices(value, inventory()) == expected


def test_a_cuda_device_maps_to_its_mig_instance(monkeypatch):
    FakeNvml(monkeypatch, migs={1: [(1, 0), (2, 0)]})
    # torch spells a MIG instance's UUID "GPU-...": it still finds the instance
    assert nvml.nvml_index_for_cuda_device(0, "GPU-00000001-1bbb") == (1, 1)
    assert nvml.nvml_index_for_cuda_device(0, "MIG-00000001-0bbb") == (1, 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-GPU-00000001-aaaa/2/0")
    assert nvml.nvml_index_for_cuda_device(0) == (1, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000000")
    assert nvml.nvml_index_for_cuda_device(0) == 0


def test_snapshot_and_status_list_mig_instances_as_devices_with_their_memory(monkeypatch):
    FakeNvml(monkeypatch, migs={1: [(1, 0), (2, 0)]})
    snap = snapshot()
    json.dumps(snap, allow_nan=False)
    assert [gpu["index"] for gpu in snap["gpus"]] == [0, 1, "1:0", "1:1"]
    mig = snap["gpus"][3]
    assert mig == {"index": "1:1", "name": "NVIDIA A100 MIG 1g.10gb", "uuid": "MIG-00000001-1bbb",
                   "parent_index": 1, "memory_used_mb": 256.0, "memory_total_mb": 10240.0,
                   "processes": [{"pid": 4242, "used_memory_mb": 512.0}, {"pid": 4343, "used_memory_mb": None}]}
    text = status_text(snap)
    assert "2 GPUs, 2 MIG instances" in text and "GPU 1:1   NVIDIA A100 MIG 1g.10gb   mem 0.2/10.0 GiB" in text
    from gpunb.notebook.status import Status

    page = Status(snap)._repr_html_()
    assert re.search(r">1:1</td><td[^>]*>NVIDIA A100 MIG 1g.10gb</td><td[^>]*>n/a</td><td[^>]*>0.2 / 10.0 GiB<", page)


def test_the_sampler_reads_a_mig_instance(monkeypatch):
    FakeNvml(monkeypatch, migs={1: [(1, 0)]})
    gpu = GpuSampler((1, 0), interval=0.5).start()
    _wait_until(lambda: gpu.latest is not None)
    gpu.stop()
    assert gpu.error is None
    sample = gpu.samples()[-1]
    assert sample["index"] == "1:0" and sample["memory_total_mb"] == 10240.0


# ---------------------------------------------------------------------- energy
def _samples(powers, counters=None, dt=0.5):
    counters = counters or [None] * len(powers)
    return [{"monotonic": i * dt, **({"power_w": p} if p is not None else {}),
             **({"energy_j": c} if c is not None else {})} for i, (p, c) in enumerate(zip(powers, counters))]


def _meter(samples) -> EnergyMeter:
    meter = EnergyMeter()
    for sample in samples:
        meter.add(sample)
    return meter


def test_energy_from_the_counter_ignores_power():
    assert _meter(_samples([100, 999, 100], [5000.0, 5010.0, 5042.5])).joules == pytest.approx(42.5)


def test_energy_from_integrated_power_without_a_counter():
    # trapezoid: 0.5 s * (100+200)/2 + 0.5 s * (200+200)/2 = 75 + 100
    assert _meter(_samples([100, 200, 200])).joules == pytest.approx(175.0)


def test_energy_falls_back_to_power_when_the_counter_resets_or_goes_missing():
    assert _meter(_samples([100, 100, 100], [900.0, 950.0, 3.0])).joules == pytest.approx(100.0)
    assert _meter(_samples([100, 100, 100], [900.0, 950.0, None])).joules == pytest.approx(100.0)


def test_energy_is_unknown_without_two_readings():
    assert _meter(_samples([100], [5.0])).joules is None
    assert _meter(_samples([None, None])).joules is None


# ---------------------------------------------------------------------- sampler
def _wait_until(condition, limit_s: float = 10.0) -> None:
    """Poll `condition` (a sampler thread's progress); fails the test after `limit_s`."""
    waited = threading.Event()
    for _ in range(int(limit_s / 0.005)):
        if condition():
            return
        waited.wait(0.005)
    raise AssertionError("the sampler thread made no progress")


class _CountingNvml(FakeNvml):
    """FakeNvml that counts every pynvml call by name."""

    def __init__(self, monkeypatch, **options):
        super().__init__(monkeypatch, **options)
        self.calls: collections.Counter = collections.Counter()
        for name in [n for n in vars(pynvml) if n.startswith("nvml")]:
            function = getattr(pynvml, name)
            if callable(function):
                monkeypatch.setattr(pynvml, name, self._counted(name, function))

    def _counted(self, name, function):
        def call(*args):
            with self.lock:
                self.calls[name] += 1
            return function(*args)

        return call


def test_sampler_keeps_a_ring_buffer_and_uses_the_process_nvml_session(monkeypatch):
    fake = FakeNvml(monkeypatch)
    monkeypatch.setattr(sampler, "MIN_INTERVAL_S", 0.01)
    gpu = GpuSampler(1, interval=0.01, history=3).start()
    _wait_until(lambda: fake.energy_mj[1] >= 5_000_000 + 6 * 50_000)  # at least 6 samples
    gpu.stop()
    assert not gpu.running and gpu.error is None
    samples = gpu.samples()
    assert len(samples) == 3
    assert samples[-1]["name"] == "NVIDIA A10" and samples[-1]["index"] == 1
    assert "processes" not in samples[-1] and "pcie_tx_kbps" not in samples[-1]  # the cheap set only
    assert gpu.energy_j == pytest.approx((fake.energy_mj[1] - 5_050_000) / 1000)  # first sample to stop()'s read
    GpuSampler(1).start().stop()
    assert fake.inits == 1 and fake.shutdowns == 0  # one process-wide session, kept


def test_sampler_start_returns_before_the_first_sample(monkeypatch):
    FakeNvml(monkeypatch)
    release, entered = threading.Event(), threading.Event()
    handle_of_gpu = pynvml.nvmlDeviceGetHandleByIndex

    def blocked_handle(index):  # the thread's first NVML device call waits for the test
        entered.set()
        release.wait(10)
        return handle_of_gpu(index)

    waited_on: list = []

    class RecordingEvent(threading.Event):
        def wait(self, timeout=None):
            waited_on.append(threading.current_thread())
            return super().wait(timeout)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", blocked_handle)
    monkeypatch.setattr(sampler, "threading", SimpleNamespace(Event=RecordingEvent, Lock=threading.Lock,
                                                              Thread=threading.Thread))
    gpu = GpuSampler(0).start()
    assert threading.current_thread() not in waited_on  # start() waited on nothing
    assert gpu.latest is None and gpu.running
    assert entered.wait(10)
    release.set()
    _wait_until(lambda: gpu.latest is not None)
    gpu.stop()
    assert not gpu.running and gpu.latest["utilization_gpu"] == 97.0


def test_sampler_stop_wakes_the_thread_and_reads_only_the_energy_counter(monkeypatch):
    fake = _CountingNvml(monkeypatch)
    gpu = GpuSampler(0, interval=3600).start()  # after its first sample the thread waits an hour
    _wait_until(lambda: gpu.latest is not None)
    before = collections.Counter(fake.calls)
    gpu.stop()
    assert not gpu.running  # woken, not waited for
    assert fake.calls - before == collections.Counter({"nvmlDeviceGetTotalEnergyConsumption": 1})
    assert gpu.energy_j == pytest.approx(50.0)  # the first sample's read to stop()'s
    assert len(gpu.samples()) == 1


def test_sampler_stop_without_an_energy_counter_makes_no_nvml_call(monkeypatch):
    fake = _CountingNvml(monkeypatch, energy_supported=False)
    gpu = GpuSampler(0, interval=3600).start()
    _wait_until(lambda: gpu.latest is not None)
    before = collections.Counter(fake.calls)
    gpu.stop()
    assert not gpu.running and fake.calls == before
    assert gpu.energy_j is None  # one power reading integrates to nothing


def test_sampler_without_nvml_says_why(monkeypatch, caplog):
    def no_driver():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    gpu = GpuSampler(0).start()
    _wait_until(lambda: not gpu.running)
    gpu.stop()
    assert gpu.error == nvml.NO_DRIVER_REASON and gpu.energy_j is None
    assert nvml.NO_DRIVER_REASON in caplog.text


def test_stop_does_not_wait_for_a_slow_nvml_start(monkeypatch):
    # A run shorter than nvmlInit (up to a second on some drivers) ends without waiting for it.
    FakeNvml(monkeypatch)
    entered, release = threading.Event(), threading.Event()

    def slow_init():
        entered.set()
        release.wait(10)

    monkeypatch.setattr(pynvml, "nvmlInit", slow_init)
    gpu = GpuSampler.of_cuda_device(0).start()
    assert entered.wait(10)
    begin = time.perf_counter()
    gpu.stop()
    assert time.perf_counter() - begin < 0.5 and gpu.running  # the thread is still in nvmlInit
    release.set()
    _wait_until(lambda: not gpu.running)  # it ends by itself...
    assert gpu.samples() == [] and gpu.energy_j is None and gpu.error is None  # ...having sampled nothing


def test_sampler_never_exceeds_two_hertz(monkeypatch):
    assert GpuSampler(0, interval=0.01).interval == 0.5


def test_sampler_reports_an_nvml_failure_instead_of_raising(monkeypatch):
    FakeNvml(monkeypatch)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", _not_supported)
    gpu = GpuSampler(7).start()
    _wait_until(lambda: not gpu.running)
    gpu.stop()
    assert "GPU 7" in gpu.error and gpu.samples() == [] and gpu.energy_j is None


# ---------------------------------------------------------------------- callback
def _state(device: str) -> FitState:
    import torch

    return FitState(config=None, model=None, optimizer=None, device=torch.device(device),
                    result=SimpleNamespace(energy_j=None))


@pytest.mark.parametrize("energy_supported", [True, False])
def test_callback_publishes_samples_and_sets_energy(monkeypatch, energy_supported):
    fake = FakeNvml(monkeypatch, energy_supported=energy_supported)
    monkeypatch.setattr(sampler, "MIN_INTERVAL_S", 0.01)
    state = _state("cuda:0")
    callback = TelemetryCallback(interval=0.01)
    callback.on_fit_start(state)
    _wait_until(lambda: len(callback.sampler.samples()) >= 2)
    assert state.extras["gpu"]["name"] == "NVIDIA H100 80GB HBM3"
    assert state.extras["gpu"]["utilization_gpu"] == 97.0
    sampler_thread = callback.sampler
    callback.on_fit_end(state)
    assert not sampler_thread.running and callback.sampler is None
    samples = sampler_thread.samples()
    if energy_supported:  # each sample's counter read, then stop()'s: 50 J apart
        assert state.result.energy_j == pytest.approx(50.0 * len(samples))
    else:  # 350.5 W held from the first sample to the last
        elapsed = samples[-1]["monotonic"] - samples[0]["monotonic"]
        assert state.result.energy_j == pytest.approx(350.5 * elapsed)
    assert state.extras["energy_j"] == state.result.energy_j
    assert fake.inits == 1 and fake.shutdowns == 0  # the process-wide session, shared and kept


def test_callback_start_leaves_nvml_to_the_sampler_thread(monkeypatch):
    # nvmlInit and the device lookup can take a second on some drivers: fit's first step
    # must not wait for them, so on_fit_start makes no NVML call on the calling thread.
    fake = _CountingNvml(monkeypatch)
    callers = []
    for name in ("nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByIndex"):
        monkeypatch.setattr(pynvml, name, _recording_caller(getattr(pynvml, name), callers))
    state = _state("cuda:0")
    callback = TelemetryCallback()
    callback.on_fit_start(state)
    assert threading.current_thread() not in callers
    _wait_until(lambda: "gpu" in state.extras)
    callback.on_fit_end(state)
    assert callers and threading.current_thread() not in callers
    assert fake.calls["nvmlInit"] == 1 and state.extras["gpu"]["index"] == 0


def test_callback_starts_no_sampler_once_nvml_failed_in_this_process(monkeypatch):
    def no_driver():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    assert nvml.ensure_nvml() == nvml.NO_DRIVER_REASON
    callback = TelemetryCallback()
    callback.on_fit_start(_state("cuda:0"))
    assert callback.sampler is None


def _recording_caller(function, callers: list):
    def call(*args):
        callers.append(threading.current_thread())
        return function(*args)

    return call


def test_callback_stops_its_sampler_on_exception(monkeypatch):
    FakeNvml(monkeypatch)
    state = _state("cuda:0")
    callback = TelemetryCallback()
    callback.on_fit_start(state)
    sampler_thread = callback.sampler
    callback.on_exception(state, RuntimeError("boom"))
    assert not sampler_thread.running and state.result.energy_j is None


def test_callback_on_cpu_does_nothing(monkeypatch):
    fake = FakeNvml(monkeypatch)
    state = _state("cpu")
    callback = TelemetryCallback()
    callback.on_fit_start(state)
    callback.on_fit_end(state)
    assert fake.inits == 0 and callback.sampler is None
    assert "gpu" not in state.extras and state.result.energy_j is None


@pytest.mark.skipif(_real_nvml_works(), reason="this machine has an NVIDIA driver")
def test_callback_without_a_driver_does_nothing():
    state = _state("cuda:0")
    callback = TelemetryCallback()
    callback.on_fit_start(state)
    callback.on_fit_end(state)
    assert callback.sampler is None and state.result.energy_j is None and state.extras == {}


def test_callback_has_no_per_step_hook():
    # Its cost per training step is zero by construction: the sampler thread does the work.
    assert not hasattr(TelemetryCallback, "on_step_end")


# ---------------------------------------------------------------------- text
def test_status_text_with_mocked_gpus(monkeypatch):
    FakeNvml(monkeypatch)
    lines = status_text().splitlines()
    assert lines[0] == "NVIDIA driver 550.54.15, 2 GPUs"
    assert lines[1] == ("GPU 0   NVIDIA H100 80GB HBM3   util 97%   mem 1.0/80.0 GiB   350 W / 700 W   61 C   "
                        "pids 4242, 4343")
    assert lines[2] == "GPU 1   NVIDIA A10   util 97%   mem 1.0/80.0 GiB   350 W / 700 W   pids 4242, 4343"
    assert lines[3].startswith("host   CPU ")


def test_status_text_without_a_gpu_says_why():
    snap = {"time": 0.0, "nvidia": False, "reason": nvml.NO_DRIVER_REASON, "gpus": [],
            "host": {"cpu_percent": 12.5, "cpu_count": 2, "ram_used_mb": 2048.0, "ram_total_mb": 8192.0,
                     "ram_percent": 25.0}}
    assert status_text(snap) == nvml.NO_DRIVER_REASON + "\nhost   CPU 12% of 2 cores   RAM 2.0/8.0 GiB (25%)"
