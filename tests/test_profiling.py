"""%gpuprofile and gpunb.profiling: capture -> analysis -> advice.

Real CPU runs with a known bottleneck check that the matching advice fires and no
other; hand-written GPU traces check the GPU paths (busy/idle, kernels, syncs, memory)
with exact numbers on machines without a GPU.
"""

import json
import sys
import time

import pytest
import torch
from IPython.core.error import UsageError
from torch import nn

from gpunb.config import TrainConfig
from gpunb.errors import GpunbError
from gpunb.profiling import ProfilerCallback, analysis, hardware, profile, trace
from gpunb.profiling.advice import advise
from gpunb.profiling.hardware import DeviceCaps

GiB = 2**30
A100 = DeviceCaps(gpu=True, name="Mock A100", capability=(8, 0), bf16=True, fp16=True,
                  tf32_enabled=True, total_memory=80 * GiB)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a busy 2-core CI machine a woken OpenMP worker can take
    milliseconds to be scheduled, which turns tiny ops into slow ones at random."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gpu_caps(monkeypatch):
    """Give this CPU run the abilities of an Ampere GPU (TF32 on unless a test says otherwise)."""

    def use(**changes):
        caps = DeviceCaps(**{**A100.__dict__, **changes})
        monkeypatch.setattr(hardware, "device_caps", lambda device: caps)
        return caps

    use()
    return use


class SlowDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.002)  # a slow decode: the loop waits on data
        return torch.randn(8), torch.tensor(i % 2)


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


@pytest.fixture(scope="module")
def slow_data_profile():
    config = TrainConfig(batch_size=8, num_workers=0, log_every=1000)
    return profile(train=dict(model=tiny_model(), train_data=SlowDataset(), config=config,
                              loss_fn=nn.CrossEntropyLoss()), steps=3, warmup=1)


def matmul_work():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    return lambda: [(a @ b).relu_() for _ in range(4)]


# --- real runs on the CPU ----------------------------------------------------------


def test_slow_dataset_gets_data_advice_only(slow_data_profile):
    result = slow_data_profile
    assert result.kind == "training" and result.steps == 3
    assert result.rules == ["data_wait"]
    data_wait = next(p for p in result.phases if p.name == "data_wait")
    assert data_wait.pct > 50
    assert "waiting for the next batch" in result.advice[0].evidence
    assert result.advice[0].est_gain == pytest.approx(data_wait.pct / 100, abs=0.01)


def test_phase_percentages_add_up_to_100(slow_data_profile):
    phases = slow_data_profile.phases
    assert [p.name for p in phases] == ["data_wait", "h2d", "forward", "backward", "optimizer", "other"]
    assert sum(p.pct for p in phases) == pytest.approx(100, abs=0.5)
    assert sum(p.ms for p in phases) == pytest.approx(slow_data_profile.step_ms, rel=0.01)
    assert all(p.ms >= 0 for p in phases)


@pytest.mark.parametrize("log_every, reads", [("auto", 0), (1, 4)])
def test_a_profiled_run_reads_its_metrics_as_often_as_the_real_run_would(tmp_path, log_every, reads):
    """"auto" reads the metrics about a hundred times a run, which for a profile of a few steps
    would be every step: a host sync per step that the real run has not (and advice to remove
    it). The profile reads them after its steps; an interval the user chose stays."""
    import json

    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    config = TrainConfig(batch_size=8, log_every=log_every)
    profile(train=dict(model=tiny_model(), train_data=(x, (x[:, 0] > 0).long()), loss_fn=nn.CrossEntropyLoss(),
                       config=config), steps=3, warmup=1, save=tmp_path)
    (trace,) = tmp_path.glob("*.json")
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    updates = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("Optimizer.step")]
    # .item() outside the optimizer (whose CPU AdamW reads its step counts): the loop's metric reads
    items = [e for e in events if e["name"] == "aten::item" and not any(a <= e["ts"] <= b for a, b in updates)]
    assert updates and len(items) == reads


def test_tiny_op_loop_is_launch_bound():
    x = torch.zeros(8)

    def tiny_ops():
        for _ in range(300):
            x.add_(1.0)

    result = profile(tiny_ops, steps=3, warmup=1)
    assert result.kind == "callable" and result.phases == []
    assert result.rules == ["launch_bound"]
    assert "--compile" in result.advice[0].message
    assert "300 ops per step" in result.advice[0].evidence


def test_fp32_matmuls_on_a_bf16_gpu_get_precision_advice(gpu_caps):
    result = profile(matmul_work(), steps=2, warmup=1)
    assert result.rules == ["precision"]
    advice = result.advice[0]
    assert "--precision bf16-mixed" in advice.message
    assert "fp32 matrix products" in advice.evidence and "aten::mm([256, 256], [256, 256])" in advice.evidence


def test_an_fp16_only_gpu_is_told_16_mixed(gpu_caps):
    gpu_caps(name="Mock T4", capability=(7, 5), bf16=False, tf32_enabled=False)
    result = profile(matmul_work(), steps=2, warmup=1)
    assert result.rules == ["precision"]  # no TF32 before Ampere
    assert "--precision 16-mixed" in result.advice[0].message and "fp16 tensor cores" in result.advice[0].message


def test_tf32_off_on_ampere_is_reported(gpu_caps):
    gpu_caps(tf32_enabled=False)
    result = profile(matmul_work(), steps=2, warmup=1)
    assert set(result.rules) == {"precision", "tf32"}


def test_no_gpu_advice_on_cpu():
    result = profile(matmul_work(), steps=2, warmup=1)
    assert result.rules == []
    assert result.device_time is None and result.top_kernels == []


def test_cpu_report_renders_as_text_and_html(tmp_path, slow_data_profile):
    text = repr(slow_data_profile)
    assert text.startswith("gpunb profile: 3 training steps on cpu")
    for part in ("step phases:", "data wait", "top ops by self time:", "memory: peak allocated",
                 "[data_wait]", "evidence:"):
        assert part in text
    page = slow_data_profile._repr_html_()
    for part in ("Step phases", "Top ops (self time)", "Memory", "Advice", "data_wait"):
        assert part in page
    for resource in ("<script", "<link", "src=", "@import"):
        assert resource not in page  # nothing fetched from a CDN or the network


def test_save_writes_a_trace_and_reports_its_path(tmp_path):
    result = profile(lambda: torch.randn(64, 64).sum(), steps=2, warmup=0, save=tmp_path / "traces")
    written = list((tmp_path / "traces").glob("*.pt.trace.json"))
    assert [str(p.resolve()) for p in written] == [result.trace_path]
    assert any(e.get("name") == "ProfilerStep#0" for e in json.loads(written[0].read_text())["traceEvents"])
    assert f"trace: {result.trace_path}" in repr(result)


def test_training_profile_leaves_the_weights_alone():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    result = profile(train=dict(model=model, train_data=(x, y), optimizer=optimizer,
                                loss_fn=nn.CrossEntropyLoss(), config=dict(batch_size=16)), steps=2, warmup=0)
    assert result.steps == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert optimizer.state_dict()["state"] == {}


def test_a_per_parameter_optimizer_on_a_cpu_is_told_to_fuse_and_the_default_is_not():
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))

    def profiled(optimizer_of):
        model = tiny_model()
        return profile(train=dict(model=model, train_data=(x, y), optimizer=optimizer_of(model),
                                  loss_fn=nn.CrossEntropyLoss(), config=dict(batch_size=16)), steps=2, warmup=0)

    usual = profiled(lambda model: torch.optim.AdamW(model.parameters()))  # torch's default on a CPU: a loop
    assert "unfused_optimizer" in usual.rules
    advice = next(a for a in usual.advice if a.rule == "unfused_optimizer")
    assert "fused=True" in advice.message and "foreach" not in advice.message and advice.est_gain > 0
    assert "unfused_optimizer" not in profiled(lambda model: None).rules  # gpunb's fused AdamW


def test_profiler_callback_with_the_trainer():
    from gpunb import Trainer

    callback = ProfilerCallback(steps=2, warmup=1)
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    # tracked, as a user's run is: the run recorder's hooks run beside the profiled steps
    fit = Trainer(batch_size=8, epochs=1).fit(tiny_model(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[callback])
    assert fit.steps == 4 and fit.stop_reason == "profiled 2 steps"  # 1 warmup, 1 start-up, 2 profiled
    assert callback.result().steps == 2
    assert callback.result().signals["batch_size"] == 8  # the small-batch advice can name it
    assert callback.result() is callback.result()  # analysed once; the temporary trace is gone


# --- bad input names the fix ---------------------------------------------------------


@pytest.mark.parametrize("call, expected", [
    (lambda: profile(), "Nothing to profile"),
    (lambda: profile(42), "must be a callable"),
    (lambda: profile(print, train={}), "both a callable and train="),
    (lambda: profile(print, steps=0), "steps must be a positive integer"),
    (lambda: profile(print, warmup=-1), "warmup must be an integer >= 0"),
    (lambda: profile(train=dict(model=tiny_model())), "needs at least `model` and `train_data`"),
    (lambda: profile(train=dict(model=tiny_model(), train_data=[1], epochs=3)), "unknown keys: epochs"),
    (lambda: profile(train=[1, 2]), "train= must be a dict"),
    (lambda: profile(train=dict(model="net", train_data=[1])), "must be a torch.nn.Module"),
    (lambda: profile(train=dict(model=tiny_model(), train_data=[1], config=3)), "must be a TrainConfig or a dict"),
    (lambda: profile(print, device="tpu:x"), "Unknown device"),
    (lambda: ProfilerCallback().result(), "has not profiled anything yet"),
])
def test_bad_input_names_the_fix(call, expected):
    with pytest.raises(GpunbError, match=expected) as info:
        call()
    assert "HINT:" in str(info.value)


def test_save_into_a_file_is_refused(tmp_path):
    target = tmp_path / "trace.json"
    target.write_text("{}")
    with pytest.raises(GpunbError, match="is a file"):
        profile(print, save=target)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(GpunbError, match="sees no CUDA GPU"):
        profile(print, device="cuda")


def test_a_run_that_ends_early_reports_the_steps_it_profiled():
    from gpunb import Trainer

    callback = ProfilerCallback(steps=5, warmup=0)
    Trainer(batch_size=16, max_steps=4, track=False).fit(
        tiny_model(), (torch.randn(64, 8), torch.randint(0, 2, (64,))), loss_fn=nn.CrossEntropyLoss(),
        callbacks=[callback])
    result = callback.result()
    assert result.steps == 3  # steps 2..4: the first is the profiler's start-up
    assert "profiled 3 of the 5 steps asked for" in repr(result)


def test_a_run_that_ends_during_warmup_says_so():
    from gpunb import Trainer

    callback = ProfilerCallback(steps=2, warmup=5)
    Trainer(batch_size=32, epochs=1, track=False).fit(tiny_model(), (torch.randn(64, 8), torch.randint(0, 2, (64,))),
                                                      loss_fn=nn.CrossEntropyLoss(), callbacks=[callback])
    with pytest.raises(GpunbError, match="No step was profiled"):
        callback.result()


# --- GPU paths, from hand-written traces ------------------------------------------------


class FakeTrace:
    """A chrome trace as torch.profiler writes it on a GPU, built event by event (µs)."""

    def __init__(self):
        self.events, self.correlation = [], 0

    def _x(self, cat, name, start, dur, tid=1, **args):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": start,
                            "dur": dur, "args": args})

    def step(self, i, start, dur):
        self._x("user_annotation", f"ProfilerStep#{i}", start, dur)

    def range(self, name, start, dur):
        self._x("user_annotation", name, start, dur)

    def op(self, name, start, dur, types=(), dims=(), ext=None):
        self._x("cpu_op", name, start, dur, **{"Input type": list(types), "Input Dims": list(dims),
                                               "External id": ext})

    def kernel(self, name, launch, start, dur, ext=None):
        self.correlation += 1
        self._x("cuda_runtime", "cudaLaunchKernel", launch, 2, correlation=self.correlation, **{"External id": ext})
        self._x("kernel", name, start, dur, tid=7, correlation=self.correlation, stream=7,
                **{"External id": ext})

    def runtime(self, name, start, dur):
        self._x("cuda_runtime", name, start, dur)

    def memory(self, ts, size, allocated, reserved):
        self.events.append({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1,
                            "ts": ts, "args": {"Bytes": size, "Total Allocated": allocated,
                                               "Total Reserved": reserved, "Device Type": 1}})

    def result(self, caps=A100, kind="training"):
        result = analysis.analyse(trace.load({"traceEvents": self.events}), kind=kind,
                                  device="cuda:0 (Mock A100)", device_total=caps.total_memory)
        result.advice = advise(result, caps)
        return result


def data_bound_gpu_trace() -> FakeTrace:
    """4 steps of 1000 µs: 600 waiting on data, then forward/backward/optimizer kernels."""
    t = FakeTrace()
    for i in range(4):
        s = 1000.0 * i
        t.step(i, s, 1000)
        t.range("gpunb/data_wait", s, 600)
        t.range("gpunb/forward", s + 600, 100)
        t.range("gpunb/backward", s + 700, 150)
        t.range("gpunb/optimizer", s + 850, 100)
        t.kernel("fwd_kernel", launch=s + 610, start=s + 620, dur=100)
        t.kernel("bwd_kernel", launch=s + 710, start=s + 720, dur=150)
        t.kernel("adam_kernel", launch=s + 860, start=s + 870, dur=80)
        t.memory(s + 620, 512 * 2**20, allocated=GiB, reserved=2 * GiB)
    return t


def test_gpu_phases_follow_the_device_and_split_idle_time():
    result = data_bound_gpu_trace().result()
    assert {p.name: round(p.pct, 6) for p in result.phases} == {
        "data_wait": 60, "h2d": 0, "forward": 12, "backward": 15, "optimizer": 8, "other": 5}
    device = result.device_time
    assert (round(device.busy_pct, 6), round(device.idle_data_pct, 6), round(device.idle_host_pct, 6)) == (33, 60, 7)
    assert [(k.name, k.calls, round(k.pct, 6)) for k in result.top_kernels] == [
        ("bwd_kernel", 4, 15), ("fwd_kernel", 4, 10), ("adam_kernel", 4, 8)]
    assert (result.memory.device, result.memory.peak_allocated, result.memory.peak_reserved) == ("cuda", GiB, 2 * GiB)


def test_gpu_data_wait_advice_and_a_stable_report():
    result = data_bound_gpu_trace().result()
    assert result.rules == ["data_wait"]
    assert "gpu_resident=True" in result.advice[0].message
    assert repr(result) == repr(data_bound_gpu_trace().result())  # deterministic
    assert repr(result).splitlines()[:9] == [
        "gpunb profile: 4 training steps on cuda:0 (Mock A100), 1 ms per step",
        "step phases:",
        "  data wait      0.6 ms  60.0%  ############",
        "  h2d copy         0 ms   0.0%  ",
        "  forward       0.12 ms  12.0%  ##",
        "  backward      0.15 ms  15.0%  ###",
        "  optimizer     0.08 ms   8.0%  ##",
        "  other         0.05 ms   5.0%  #",
        "device: busy 33.0%, idle 67.0% (waiting on the host 7.0%, on data 60.0%)",
    ]


def launch_bound_gpu_trace(sync=False, unfused=False, fp32_mm=False, fused_name="aten::_fused_adamw_"):
    """4 steps of 1000 µs of 100 tiny kernels (3 µs, launched every 9 µs)."""
    t = FakeTrace()
    for i in range(4):
        s = 1000.0 * i
        t.step(i, s, 1000)
        for k in range(100):
            t.kernel("tiny_elementwise", launch=s + 9 * k, start=s + 9 * k + 5, dur=3)
        t.range("Optimizer.step#AdamW.step", s + 920, 60)
        if unfused:
            for k in range(20):
                t.op("aten::add_", s + 921 + 2 * k, 1)
        else:
            t.op(fused_name, s + 921, 40)
        if sync:
            t.op("aten::item", s + 985, 10)
            t.op("aten::_local_scalar_dense", s + 986, 8)
            t.runtime("cudaStreamSynchronize", s + 987, 5)
        if fp32_mm:
            t.op("aten::mm", s + 900, 10, types=["float", "float"], dims=[[512, 512], [512, 512]], ext=100 + i)
            t.kernel("sgemm", launch=s + 901, start=s + 902, dur=15, ext=100 + i)
        t.memory(s + 5, 2**20, allocated=GiB, reserved=GiB)
    return t


def test_tiny_kernels_with_an_idle_gpu_are_launch_bound():
    result = launch_bound_gpu_trace().result(kind="callable")
    assert result.rules[0] == "launch_bound"
    # 1 of 80 GiB used, GPU mostly idle; the tiny kernels are elementwise ones
    assert set(result.rules) == {"launch_bound", "small_batch", "compile"}
    assert "100 kernels per step, median 3 µs" in result.advice[0].evidence
    assert 'compile="step-graph"' in result.advice[0].message
    assert 'mode="reduce-overhead"' in result.advice[0].message  # the fallback


def test_host_syncs_inside_the_step_are_reported():
    result = launch_bound_gpu_trace(sync=True).result(kind="callable")
    advice = next(a for a in result.advice if a.rule == "host_sync")
    assert "1 host-device sync per step: aten::item in other (4x)" in advice.evidence


def test_the_profilers_own_final_sync_is_not_the_users():
    t = launch_bound_gpu_trace()
    t.range("gpunb.profiler_sync", 3990, 9)
    t.runtime("cudaDeviceSynchronize", 3991, 8)
    assert t.result().signals["syncs"] == 0


def test_unfused_optimizer_is_reported_and_fused_is_not():
    assert "unfused_optimizer" in launch_bound_gpu_trace(unfused=True).result().rules
    assert "unfused_optimizer" not in launch_bound_gpu_trace(unfused=False).result().rules
    assert "unfused_optimizer" not in launch_bound_gpu_trace(fused_name="aten::_foreach_add_").result().rules


def test_fp32_matmul_share_comes_from_its_kernels_on_a_gpu():
    result = launch_bound_gpu_trace(fp32_mm=True).result()
    assert result.signals["fp32_matmul_calls"] == 4
    assert result.signals["fp32_matmul_share"] == pytest.approx(15 / 1000)  # under the 10% threshold
    assert "precision" not in result.rules


def test_gpu_only_rules_stay_quiet_for_a_cpu():
    cpu = DeviceCaps()
    result = launch_bound_gpu_trace(sync=True, unfused=True).result(caps=cpu)
    assert not {"host_sync", "small_batch", "compile", "precision", "tf32"} & set(result.rules)


def test_nvml_utilisation_is_optional(monkeypatch):
    from gpunb.profiling import capture

    samples = [{"time": 10.0, "utilization_gpu": 5.0}, {"time": 20.0, "utilization_gpu": 60.0},
               {"time": 21.0, "utilization_gpu": 80.0}, {"time": 22.0}]
    assert capture._mean_utilisation(samples, since=15.0) == 70.0  # samples of the recorded steps only
    assert capture._mean_utilisation(samples[:1], since=15.0) is None
    monkeypatch.setitem(sys.modules, "gpunb.telemetry.nvml", None)  # telemetry missing: no reading, no error
    assert capture._start_nvml_sampler(torch.device("cuda", 0)) is None
    result = data_bound_gpu_trace().result()
    result.device_time.nvml_util_pct = 55.0
    assert "; NVML utilisation 55.0%" in repr(result)


# --- the magic ------------------------------------------------------------------------


@pytest.fixture
def ip():
    from IPython.testing.globalipapp import get_ipython

    from gpunb.notebook.profile_magic import register

    shell = get_ipython()
    register(shell)
    return shell


@pytest.fixture
def last_train(monkeypatch):
    """Set (or clear) what the last %%gputrain cell left behind."""
    from gpunb.notebook import session

    def set_last(value):
        monkeypatch.setattr(session, "LAST_TRAIN", value)

    set_last(None)
    return set_last


def test_line_magic_runs_the_statement_in_the_user_namespace(ip):
    ip.run_cell("import torch\ncalls = 0\nx = torch.ones(4)")
    result = ip.run_line_magic("gpuprofile", "--steps 3 --warmup 1 calls += 1; y = x  *  2")
    assert ip.user_ns["calls"] == 5 and torch.equal(ip.user_ns["y"], torch.full((4,), 2.0))
    assert result.kind == "callable" and result.steps == 3


def test_cell_magic_profiles_the_cell(ip, tmp_path):
    ip.run_cell("import torch\ncalls = 0")
    result = ip.run_cell_magic("gpuprofile", f'--steps 2 --warmup 0 --save "{tmp_path}/my traces"',
                               "a = torch.randn(32, 32)\ncalls += 1\n")
    assert ip.user_ns["calls"] == 3 and result.steps == 2
    assert result.trace_path.startswith(str(tmp_path / "my traces") + "/")


def test_train_flag_profiles_the_last_gputrain_setup(ip, last_train):
    from gpunb.notebook.session import LastTrain

    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    ip.user_ns.update(net=tiny_model(), data=(x, y), held_out=(x, y), loss=nn.CrossEntropyLoss())
    last_train(LastTrain(TrainConfig(batch_size=16), {"model": "net", "train_data": "data",
                                                      "val_data": "held_out", "loss_fn": "loss"}))
    result = ip.run_line_magic("gpuprofile", "--train 2 --warmup 0")
    assert result.kind == "training" and result.steps == 2


def test_train_flag_says_which_variable_is_gone(ip, last_train):
    from gpunb.notebook.session import LastTrain

    ip.user_ns.update(data=(torch.randn(8, 8), torch.randint(0, 2, (8,))))
    ip.user_ns.pop("gone_model", None)
    last_train(LastTrain(TrainConfig(), {"model": "gone_model", "train_data": "data"}))
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("gpuprofile", "--train 2")
    message = str(info.value)
    assert "`gone_model` is no longer defined" in message and "HINT: run the %%gputrain cell again" in message
    assert "`data`" not in message


def test_train_flag_after_a_real_gputrain_cell(ip, last_train):
    from gpunb.notebook import register_magics

    register_magics(ip)
    ip.run_cell("import torch\nfrom torch import nn\nx, y = torch.randn(64, 8), torch.randint(0, 2, (64,))")
    ip.run_cell_magic("gputrain", "--max-steps 2 --batch-size 16 --quiet --no-track",
                      "model = nn.Linear(8, 2)\ntrain_data = (x, y)\nloss_fn = nn.CrossEntropyLoss()")
    trained = {k: v.clone() for k, v in ip.user_ns["model"].state_dict().items()}
    result = ip.run_line_magic("gpuprofile", "--train 3 --warmup 1")
    assert result.kind == "training" and result.steps == 3
    assert all(torch.equal(trained[k], v) for k, v in ip.user_ns["model"].state_dict().items())


@pytest.mark.parametrize("line, cell, expected", [
    ("", None, "Nothing to profile"),
    ("--steps 2", "   \n", "Nothing to profile"),
    ("--train", None, "run a %%gputrain cell first"),
    ("--train 3 f()", None, "takes no code"),
    ("--train 0", None, "steps must be a positive integer"),
    ("--help", None, "unrecognized arguments: --help"),
    ("--steps 0 f()", None, "steps must be a positive integer"),
    ("--steps many f()", None, "invalid int value"),
    ("--steps 2 f()", "g()", "takes only options on its line"),
])
def test_magic_misuse_names_the_fix(ip, last_train, line, cell, expected):
    with pytest.raises(UsageError) as info:
        if cell is None:
            ip.run_line_magic("gpuprofile", line)
        else:
            ip.run_cell_magic("gpuprofile", line, cell)
    assert expected.lower() in str(info.value).lower()


def test_magic_refuses_a_file_as_save_dir(ip, tmp_path):
    (tmp_path / "trace.json").write_text("{}")
    with pytest.raises(UsageError, match="is a file"):
        ip.run_line_magic("gpuprofile", f"--save {tmp_path / 'trace.json'} x = 1")


def test_magic_help_lists_the_options(ip):
    from gpunb.notebook.profile_magic import ProfileMagics

    doc = ProfileMagics.gpuprofile.__doc__
    for option in ("--steps", "--warmup", "--save DIR", "--train", "%%gputrain"):
        assert option in doc


def test_a_fused_optimizers_tensor_lists_are_counted_not_listed():
    # _fused_adamw_ takes every parameter, gradient and state as tensor lists: its row said
    # the whole nested list of shapes; it says how many tensors each list holds instead.
    t = FakeTrace()
    t.step(0, 0.0, 1000)
    params = [[64, 10], [64], [10, 64], [10]] * 20
    t.op("aten::_fused_adamw_", 10, 500, types=["TensorList"] * 4 + ["Scalar"],
         dims=[params, params, params, params, []])
    t.op("aten::addmm", 600, 300, types=["float"] * 3, dims=[[10], [128, 64], [64, 10]])
    rows = {row.name: row.shapes for row in t.result(kind="statement").top_ops}
    assert rows["aten::_fused_adamw_"] == "80 tensors, 80 tensors, 80 tensors, 80 tensors"
    assert rows["aten::addmm"] == "[10], [128, 64], [64, 10]"
    t.op("aten::cat", 950, 10, types=["float"] * 9, dims=[[1024, 1024, 3]] * 9)
    long = {row.name: row.shapes for row in t.result(kind="statement").top_ops}["aten::cat"]
    assert len(long) == 60 and long.endswith("…")
