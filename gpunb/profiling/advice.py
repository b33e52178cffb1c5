"""Advice: rules that fire on evidence in a ProfileResult, each with what it saw and a
rough estimate of the step time the change could save.

A rule is a function (result, signals, caps) -> Advice | None. GPU-only rules return
None unless `caps.gpu`; the caps come from hardware.device_caps, so tests can give a
CPU trace the abilities of a GPU. The thresholds are deliberately coarse: a rule
should fire only when the profile leaves little doubt.
"""

from __future__ import annotations

from gpunb.profiling.analysis import TINY_OP_US
from gpunb.profiling.hardware import DeviceCaps
from gpunb.profiling.report import Advice, ProfileResult

DATA_SHARE = 0.10  # data wait + copy above this share of the step: feed faster
MATMUL_SHARE = 0.10  # fp32 matrix products above this share: lower precision pays
TF32_SHARE = 0.05
LIGHT_OP_SHARE = 0.50  # step time outside ops of >= 20 µs (data loading aside): dispatch-bound
IDLE_HOST_SHARE = 0.25  # GPU idle waiting on the host this long: launch-bound
SHORT_KERNEL_US = 20.0  # mean kernel time below this: kernels about as long as their launch
LOW_MEMORY = 0.40  # peak reserved below this share of the GPU: room for a larger batch
LOW_BUSY = 0.50  # GPU running kernels less than this share of the step: it could take more work
FUSIBLE_SHARE = 0.15  # elementwise/copy/cast/norm kernels above this share: compile would fuse them
FUSION_SAVES = 0.5  # share of those kernels' time fusion is assumed to save (see `compile_fusion`)


def advise(result: ProfileResult, caps: DeviceCaps) -> list[Advice]:
    """Every rule that fires, the largest estimated gain first."""
    signals = result.signals
    fired = [rule(result, signals, caps) for rule in RULES]
    return sorted((a for a in fired if a is not None), key=lambda a: -a.est_gain)


def data_wait(result, s, caps) -> Advice | None:
    share = s["phase_share"].get("data_wait", 0.0) + s["phase_share"].get("h2d", 0.0)
    if share <= DATA_SHARE:
        return None
    fix = ("use more DataLoader workers (`--num-workers 4`, `num_workers=4`), make `__getitem__` cheaper, "
           "or precompute the samples into tensors")
    if caps.gpu:
        fix += (", pin host memory, or keep a tensor dataset on the GPU (`gpu_resident=True`) "
                "so no batch waits on the host")
    return Advice("data_wait", f"The loop waits for data: {fix}.",
                  f"waiting for the next batch or copying it takes {100 * share:.0f}% of each step "
                  f"({result.step_ms * share:.3g} ms of {result.step_ms:.3g} ms)", share)


def precision(result, s, caps) -> Advice | None:
    share = s["fp32_matmul_share"]
    if not caps.gpu or not (caps.bf16 or caps.fp16) or share <= MATMUL_SHARE:
        return None
    flag, kind = ("bf16-mixed", "bf16") if caps.bf16 else ("16-mixed", "fp16")
    return Advice("precision", f"Run matrix products in low precision: `--precision {flag}` "
                  f"(`precision='{flag}'`); {caps.name} has {kind} tensor cores.",
                  f"{s['fp32_matmul_calls']} fp32 matrix products take {100 * share:.0f}% of the time, "
                  f"e.g. {s['fp32_matmul_example']}", share * 0.5)


def tf32(result, s, caps) -> Advice | None:
    share = s["fp32_matmul_share"]
    ampere = caps.capability is not None and caps.capability >= (8, 0)
    if not caps.gpu or not ampere or caps.tf32_enabled or share <= TF32_SHARE:
        return None
    return Advice("tf32", "Let fp32 matrix products use TF32 tensor cores: "
                  "`torch.set_float32_matmul_precision('high')` (gpunb's Trainer does this itself).",
                  f"TF32 is off on an Ampere-or-newer GPU ({caps.name}) and fp32 matrix products take "
                  f"{100 * share:.0f}% of the time", share * 0.5)


def launch_bound(result, s, caps) -> Advice | None:
    if s["device"]:
        return _cuda_graphs(result, s, caps)
    share = s["light_op_share"]
    if share < LIGHT_OP_SHARE or s["top_ops_per_step"] < 50 or s["median_top_op_us"] >= TINY_OP_US:
        return None
    return Advice("launch_bound", "Many tiny ops: per-op launch and dispatch overhead dominates. Fuse them "
                  "with `--compile` (`compile=True`), or do more work per op with a larger batch.",
                  f"{s['top_ops_per_step']:.0f} ops per step, median {s['median_top_op_us']:.3g} µs; "
                  f"{100 * share:.0f}% of the step goes to such small ops and the Python around them",
                  share * 0.5)


def _cuda_graphs(result, s, caps) -> Advice | None:
    """The GPU waits while the host launches many short kernels: replaying the step as one
    CUDA graph removes the launches. At best the step shrinks to the GPU's busy time, so
    the gain is the share of the step the GPU sat idle waiting on the host."""
    idle = s["idle_host_share"]
    short = s["tiny_kernel_fraction"] >= 0.5 or s["mean_kernel_us"] < SHORT_KERNEL_US
    if idle < IDLE_HOST_SHARE or not short or s["cuda_graphs"]:
        return None
    return Advice("launch_bound", "The GPU waits for the host to launch many short kernels: capture the whole "
                  "step (forward, backward, optimizer) as one CUDA graph with `--compile step-graph` "
                  "(`compile=\"step-graph\"`), which replays all of its kernels with one launch; where the step "
                  "cannot be captured whole (gradient accumulation, fp16's loss scaler, several processes), "
                  "`--compile reduce-overhead` graphs the model's forward and backward (by hand "
                  "`torch.compile(model, mode=\"reduce-overhead\")`). Or do more work per kernel with a larger "
                  "batch. The default `compile=\"auto\"` does this by itself.",
                  f"{s['kernels_per_step']:.0f} kernels per step, median {s['median_kernel_us']:.3g} µs, "
                  f"mean {s['mean_kernel_us']:.3g} µs; the GPU sits idle waiting on the host "
                  f"{100 * idle:.0f}% of the time", idle)


def compile_fusion(result, s, caps) -> Advice | None:
    """Eager PyTorch runs each pointwise op, cast and normalisation as a kernel of its own
    that reads and writes its whole tensor; torch.compile fuses chains of them into one.
    The estimate assumes half the time of those kernels is saved (the fused kernel still
    reads the inputs and writes the outputs once): conservative for long chains."""
    share = s["fusible_share"]
    if not caps.gpu or not s["device"] or s["compiled"] or share < FUSIBLE_SHARE:
        return None
    return Advice("compile", "Eager mode runs every elementwise op, cast and normalisation as a kernel of "
                  "its own: compile the model (`--compile`, `compile=True`) so that they fuse.",
                  f"{s['fusible_kernels_per_step']:.0f} elementwise/copy/cast/norm kernels per step take "
                  f"{100 * share:.0f}% of the time; no compiled code in the trace; the gain assumes fusion "
                  f"saves {100 * FUSION_SAVES:.0f}% of their time", share * FUSION_SAVES)


def small_batch(result, s, caps) -> Advice | None:
    """Memory to spare and a GPU mostly idle while the host runs the step (not while it
    waits for data: a larger batch would not help there): a larger batch does more work per
    launch. The estimate is for doubling it with the added kernel time not hidden at all:
    a step of T becomes T + busy*T for twice the samples, so the time per sample falls by
    (1 - busy) / 2."""
    memory = result.memory
    if not caps.gpu or memory is None or memory.device != "cuda" or not caps.total_memory:
        return None
    used = (memory.peak_reserved or memory.peak_allocated) / caps.total_memory
    busy = s["busy_share"] / max(1.0 - s["idle_data_share"], 1e-9)  # of the time not waiting for data
    if used >= LOW_MEMORY or busy >= LOW_BUSY:
        return None
    batch = s.get("batch_size")
    now = f"`batch_size={batch}`" if batch else "the batch"
    return Advice("small_batch", f"The batch is too small for this GPU: raise {now} (double it and scale "
                  "the learning rate with it), or let gpunb find the fastest one with `batch_size=\"auto\"` "
                  "(`--batch-size auto`).",
                  (f"batch of {batch}; " if batch else "") + f"peak memory {100 * used:.0f}% of "
                  f"{caps.total_memory / 2**30:.0f} GiB; outside data waits the GPU runs kernels "
                  f"{100 * busy:.0f}% of the time", (1 - busy) / 2)


def host_sync(result, s, caps) -> Advice | None:
    if not caps.gpu or s["syncs"] < s["steps"]:
        return None
    per_step = s["syncs"] / s["steps"]
    sites = ", ".join(f"{op} in {phase} ({n}x)" for (op, phase), n in s["sync_sites"][:3])
    return Advice("host_sync", "The step waits for the GPU: move `.item()`, `.cpu()`, `print(tensor)` "
                  "and Python `if` on tensors out of the step, or do them every N steps.",
                  f"{per_step:.3g} host-device sync{'' if per_step == 1 else 's'} per step: {sites}",
                  max(s["idle_host_share"] * 0.5, 0.02))


def unfused_optimizer(result, s, caps) -> Advice | None:
    """A per-parameter optimizer (torch's default on a CPU, or `foreach=False`): a fused one
    updates every parameter in one pass (on a GPU, foreach does in a few kernels)."""
    if s["optimizer_fused"] or s["optimizer_ops_per_step"] < 10:
        return None
    how = "`fused=True` (or `foreach=True`)" if caps.gpu else "`fused=True`"
    return Advice("unfused_optimizer", f"The optimizer updates one parameter at a time: create it with {how}, "
                  "e.g. `torch.optim.AdamW(params, fused=True)` (gpunb's default AdamW is fused already).",
                  f"{s['optimizer_ops_per_step']:.0f} ops per optimizer step, none of them _foreach_/_fused_; "
                  f"the optimizer takes {100 * s['optimizer_share']:.0f}% of the step",
                  s["optimizer_share"] * 0.5)


RULES = (data_wait, precision, tf32, launch_bound, compile_fusion, small_batch, host_sync, unfused_optimizer)
