"""The advice that names the biggest lever on a GPU (compile, CUDA graphs, a larger
batch), the h2d phase and the NVML reading, from hand-written GPU traces."""

import json
from types import SimpleNamespace

import pytest
import torch
from test_profiling import A100, GiB, FakeTrace, data_bound_gpu_trace, launch_bound_gpu_trace

from gpunb.profiling import analysis, api, capture, trace
from gpunb.profiling.advice import advise
from gpunb.profiling.hardware import DeviceCaps
from gpunb.profiling.report import DeviceTime


def eager_gpu_trace(elementwise_us=300.0, gemm_us=600.0, names=("vectorized_elementwise_kernel",),
                    reserved=60 * GiB) -> FakeTrace:
    """4 steps of 1000 µs, the GPU busy 90%: long matmul kernels and a few long elementwise ones."""
    t = FakeTrace()
    for i in range(4):
        s = 1000.0 * i
        t.step(i, s, 1000)
        t.range("gpunb/forward", s, 500)
        t.range("gpunb/backward", s + 500, 500)
        t.kernel("sm90_xmma_gemm_bf16", launch=s, start=s + 10, dur=gemm_us)
        share = elementwise_us / len(names)
        for k, name in enumerate(names):
            t.kernel(name, launch=s + 20 + k, start=s + 10 + gemm_us + k * share, dur=share)
        t.memory(s + 5, 2**20, allocated=reserved // 2, reserved=reserved)
    return t


def result_of(t: FakeTrace, caps=A100, batch_size=None):
    result = analysis.analyse(trace.load({"traceEvents": t.events}), kind="training", device="cuda:0",
                              device_total=caps.total_memory, batch_size=batch_size)
    result.advice = advise(result, caps)
    return result


def advice(result, rule):
    return next(a for a in result.advice if a.rule == rule)


# --- compile: elementwise/copy/cast kernels that torch.compile would fuse -------------


def test_eager_elementwise_time_advises_compile_with_half_of_it_as_the_gain():
    result = result_of(eager_gpu_trace(names=("vectorized_elementwise_kernel", "direct_copy_kernel_cuda")))
    assert result.rules == ["compile"]  # busy GPU, memory used: nothing else fires
    tip = advice(result, "compile")
    assert tip.est_gain == pytest.approx(0.30 * 0.5)
    assert "`compile=True`" in tip.message
    assert "2 elementwise/copy/cast/norm kernels per step take 30% of the time" in tip.evidence


@pytest.mark.parametrize("name", ["at::native::elementwise_kernel<128, 4>", "layer_norm_kernel",
                                  "cunn_SoftMaxForward", "unrolled_elementwise_kernel<to_copy>"])
def test_each_kind_of_fusible_kernel_counts(name):
    assert result_of(eager_gpu_trace(names=(name,))).signals["fusible_share"] == pytest.approx(0.30)


def test_compile_stays_quiet_below_its_threshold():
    result = result_of(eager_gpu_trace(elementwise_us=100.0, gemm_us=800.0))
    assert result.signals["fusible_share"] == pytest.approx(0.10)
    assert "compile" not in result.rules


def test_a_compiled_model_is_not_told_to_compile():
    inductor = result_of(eager_gpu_trace(names=("triton_poi_fused__to_copy_add_0",)))
    assert inductor.signals["compiled"] and "compile" not in inductor.rules
    t = eager_gpu_trace()
    t.range("Torch-Compiled Region: 0/0", 0, 900)
    assert "compile" not in result_of(t).rules


def test_compile_advice_is_for_gpus_only():
    assert "compile" not in result_of(eager_gpu_trace(), caps=DeviceCaps()).rules


# --- launch-bound: the GPU idles while the host launches -> CUDA graphs ----------------


def test_launch_bound_gpu_is_told_cuda_graphs_with_the_idle_share_as_gain():
    result = launch_bound_gpu_trace().result()
    tip = advice(result, "launch_bound")
    assert result.rules[0] == "launch_bound"
    assert tip.est_gain == pytest.approx(result.signals["idle_host_share"]) == pytest.approx(0.70)
    assert 'torch.compile(model, mode="reduce-overhead")' in tip.message
    assert "median 3 µs, mean 3 µs; the GPU sits idle waiting on the host 70%" in tip.evidence


def test_a_step_already_replayed_as_a_cuda_graph_is_not_told_again():
    t = launch_bound_gpu_trace()
    for i in range(4):
        t.runtime("cudaGraphLaunch_v10000", 1000.0 * i + 1, 3)
    assert "launch_bound" not in t.result().rules


def test_long_kernels_with_an_idle_gpu_are_not_launch_bound():
    t = FakeTrace()
    for i in range(4):
        s = 1000.0 * i
        t.step(i, s, 1000)
        t.kernel("sm90_xmma_gemm_bf16", launch=s, start=s + 500, dur=400)  # idle 60%, one long kernel
    result = result_of(t)
    assert result.signals["idle_host_share"] == pytest.approx(0.60)
    assert "launch_bound" not in result.rules


# --- a batch too small for the GPU ----------------------------------------------------


def test_a_small_batch_on_an_idle_gpu_with_free_memory_is_named():
    result = result_of(launch_bound_gpu_trace(), batch_size=32)  # 1 of 80 GiB, GPU busy 30%
    tip = advice(result, "small_batch")
    assert tip.est_gain == pytest.approx((1 - 0.30) / 2)
    assert "raise `batch_size=32`" in tip.message and 'batch_size="auto"' in tip.message
    assert tip.evidence == ("batch of 32; peak memory 1% of 80 GiB; outside data waits the GPU runs "
                            "kernels 30% of the time")


def test_no_batch_advice_when_memory_is_used_or_the_gpu_is_busy():
    full = launch_bound_gpu_trace()
    for i in range(4):
        full.memory(1000.0 * i + 6, 2**20, allocated=40 * GiB, reserved=40 * GiB)
    assert "small_batch" not in result_of(full).rules
    busy = result_of(eager_gpu_trace(reserved=GiB))  # 1 GiB used, but the GPU runs kernels 90%
    assert "small_batch" not in busy.rules


def test_a_gpu_waiting_for_data_is_not_told_to_raise_the_batch():
    result = result_of(data_bound_gpu_trace(), batch_size=32)  # busy 33%, but 60% of it waits for data
    assert result.rules == ["data_wait"]


# --- the h2d phase ----------------------------------------------------------------------


def test_host_to_device_copies_are_the_h2d_phase_wherever_they_were_launched():
    t = FakeTrace()
    for i in range(4):
        s = 1000.0 * i
        t.step(i, s, 1000)
        t.range("gpunb/data_wait", s, 300)
        t.range("gpunb/forward", s + 300, 700)
        # the prefetcher's copy of the next batch, launched from another thread mid-forward
        t.correlation += 1
        t._x("cuda_runtime", "cudaMemcpyAsync", s + 400, 2, tid=3, correlation=t.correlation)
        t._x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", s + 50, 200, tid=8, correlation=t.correlation)
        t.kernel("fwd_kernel", launch=s + 310, start=s + 320, dur=600)
        # a copy that starts 20 µs before fwd_kernel and then runs beside it
        t._x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", s + 300, 100, tid=8)
    result = result_of(t)
    phases = {p.name: round(p.pct, 6) for p in result.phases}
    # the first copy holds 200 of the 300 µs wait; of the second only the 20 µs before the kernel count
    assert phases == {"data_wait": 10, "h2d": 22, "forward": 68, "backward": 0, "optimizer": 0, "other": 0}
    assert round(result.device_time.idle_data_pct, 6) == 32  # the GPU idles while a copy runs


# --- NVML utilisation: unknown on a short capture, never 0% ------------------------------


def test_nvml_samples_count_only_a_full_sample_period_after_recording_began():
    samples = [{"time": 10.2, "utilization_gpu": 0.0}, {"time": 10.7, "utilization_gpu": 0.0}]
    assert capture._mean_utilisation(samples, since=10.0) is None  # a 0.1 s capture: no reading
    samples.append({"time": 11.5, "utilization_gpu": 90.0})
    assert capture._mean_utilisation(samples, since=10.0) == 90.0
    # taken after the last step, while the trace was written (the GPU idle): not the steps' reading
    samples.append({"time": 12.5, "utilization_gpu": 0.0})
    assert capture._mean_utilisation(samples, since=10.0, until=12.0) == 90.0
    assert capture._mean_utilisation(samples[:2] + samples[3:], since=10.0, until=12.0) is None


def test_nvml_reads_n_a_when_sampled_but_too_short_and_nothing_without_nvml():
    sampled = DeviceTime(busy_pct=50.0, idle_host_pct=50.0, idle_data_pct=0.0, nvml_read=True)
    result = result_of(launch_bound_gpu_trace())
    result.device_time = sampled
    assert "NVML utilisation n/a (capture shorter than NVML's 1 s sample period)" in repr(result)
    assert "NVML utilisation 0" not in repr(result)
    result.device_time = DeviceTime(busy_pct=50.0, idle_host_pct=50.0, idle_data_pct=0.0)
    assert "NVML" not in repr(result)


def test_summarise_passes_the_nvml_state_and_batch_size_on(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": launch_bound_gpu_trace().events}))
    recorder = SimpleNamespace(stop=lambda: None, cleanup=lambda: None, trace_path=str(path), done=True,
                               caps=A100, device=torch.device("cuda", 0), nvml_util=None, nvml_read=True,
                               batch_size=16, steps=3, save=None, calls=4, warmup=0)
    result = api.summarise(recorder, kind="training")
    assert result.device_time.nvml_read and result.device_time.nvml_util_pct is None
    assert "NVML utilisation n/a" in repr(result)
    assert "batch of 16" in advice(result, "small_batch").evidence
