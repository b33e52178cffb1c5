"""gpunb vs a hand-written PyTorch loop doing the same work: step time and peak memory.

Both train the same seeded model on the same data with the same optimizer and
precision. Runs are interleaved, in turn forwards and backwards (gpunb, plain, usual,
loader, loader, usual, plain, gpunb, ...), so that drift in machine speed hits all alike;
each run reports its median step time after warm-up, and each ratio is the median of the
rounds' ratios (with the middle half of them, to show the noise).

"time ratio" compares gpunb with a careful hand-written loop doing the same work: the data
on the device, the optimizer implementation gpunb picks (fused AdamW), each batch gathered
with `x[index]` and the gradients dropped with `optimizer.zero_grad()`, as such loops do;
gpunb gathers with `index_select` and drops the gradients without zero_grad's profiler
range, which on small steps more than pays for its own bookkeeping. "vs usual" compares
gpunb with the loop as it is usually written, `torch.optim.AdamW(model.parameters())` with
torch's defaults (a Python loop over the parameters on CPU, foreach on CUDA): what gpunb's
defaults gain a user over their own loop. "vs loader" compares it with that loop fed the
usual way, by a shuffling DataLoader over a TensorDataset of the same tensors.

    python benchmarks/overhead.py            # CPU cases (+ the GPU cases when CUDA is there)
    python benchmarks/overhead.py --steps 40 --rounds 1 --warmup 5 --cases mlp   # a quick check
    python benchmarks/overhead.py --cases lstm-parity-loader --rounds 15   # the registry

`--cases lstm-parity-loader`: the run registry's cost. Lightning's parity LSTM fed by a shuffling
DataLoader (one process, no workers, one thread) to gpunb with the registry on (`track=True`, a
user's default), to gpunb with `track=False`, and to the plain loop; the three interleaved, each
ratio the median of the rounds' ratios, for fits of 100, 300 and 1,000 steps (`--fit-steps`). The
registry's cost is mostly once a fit (its row created, its first rows, its final status), so the
ratio that matters is the whole fit's, from the call to its return; the per-step ratios follow.
Beside the wall-clock ratios, the ratios of the process's CPU time (all its threads: the registry's
writer thread counts), which a shared, loaded machine disturbs less. The registry is a temporary
one ($GPUNB_HOME is pointed at a temporary directory); the load average is printed before and after.
Where the registry's time goes is timed in a few more tracked fits of their own (the timing wrappers
cost about a microsecond a hook call, which the ratios' fits must not carry). Short fits
(`--fit-steps 10 --rounds 201`) measure the cost per fit with the least noise: a 37 ms fit varies
far less, in ms, than a 220 ms one.

On a GPU it adds GPT-2 124M in nanoGPT's shape (bf16, batch 16 x 1,024), with the MFU of both
loops (gpunb's FLOP count of a step over the median step time, against the GPU's dense bf16
peak) beside the MFU gpunb's own result reports, and the digits CNN at batch 64, which is
launch-bound (kernels of a few µs); and a fifth loop, gpunb with compile=False, whose ratio to
the plain loop is gpunb's own per-step cost apart from what compile="auto" gains.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpunb import Trainer
from gpunb.demo import digits_cnn, digits_data
from gpunb.runtime.probes.peak_flops import device_peak_tflops


class LSTMParity(nn.Module):
    """Lightning's parity model: LSTM(10, 20) + Linear, batch 30, sequence 16."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(10, 20, batch_first=True)
        self.head = nn.Linear(20, 2)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one qkv projection, flash attention through SDPA, an output projection."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 124M in nanoGPT's shape: 12 layers, 768 wide, 12 heads, vocab 50,304 (padded to a
    multiple of 64), context 1,024, biases, no dropout, the head's weight tied to the embedding,
    nanoGPT's initialisation (residual projections scaled by 1/sqrt(2 x layers))."""

    def __init__(self, vocab=50304, width=768, layers=12, heads=12, context=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, param in self.named_parameters():
            if name.endswith(("attn.c_proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens):  # (B, T) token ids -> (B, T, vocab) logits
        position = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(position)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def next_token_loss(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


GPU_ONLY = ("gpt2-124m-bf16", "digits-cnn-b64")  # launch-bound or large: only meaningful on a GPU


def cases(device):
    """(name, make_model, data, batch size, loss, precision); the GPU-only ones on CUDA only."""
    g = torch.Generator().manual_seed(0)
    yield ("mlp", lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)),
           (torch.randn(8192, 64, generator=g), torch.randint(0, 10, (8192,), generator=g)),
           128, nn.CrossEntropyLoss(), "32")
    yield ("lstm-parity", LSTMParity,
           (torch.randn(3000, 16, 10, generator=g), torch.randint(0, 2, (3000,), generator=g)),
           30, nn.CrossEntropyLoss(), "32")
    if device.type == "cuda":
        tokens = torch.randint(0, 50304, (256, 1025), generator=g)
        yield ("gpt2-124m-bf16", GPT, (tokens[:, :-1], tokens[:, 1:]), 16, next_token_loss, "bf16-mixed")
        # Launch-bound: ~1 ms of GPU work per step, the data held on the GPU by both loops.
        (x, y), _ = digits_data()
        yield ("digits-cnn-b64", digits_cnn, (x, y), 64, nn.CrossEntropyLoss(), "bf16-mixed")


def plain_loop(make_model, data, batch_size, loss_fn, precision, device, steps, fused=True, loader=False,
               timer=None):
    """What a careful user writes by hand: data on the device, shuffled once per epoch and
    indexed (`x[index]`), fused AdamW, autocast when the precision is mixed (none in fp32), and the loss read at
    the same interval as gpunb's. Timed by the same StepTimer as gpunb's loop.
    `fused=False`: torch's default AdamW, as most hand-written loops create it. `loader=True`:
    fed the usual way, by a shuffling DataLoader over a TensorDataset on the host (pinned on
    CUDA), each batch copied to the device; gpunb, given that TensorDataset, batches its tensors
    by slicing."""
    torch.manual_seed(0)
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused else {}))
    if loader:
        shuffled = DataLoader(TensorDataset(*data), batch_size=batch_size, shuffle=True, drop_last=True,
                              pin_memory=device.type == "cuda")
        batches = iter(shuffled)
    else:
        x, y = (t.to(device) for t in data)
        order, position = None, len(x)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    mixed = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    timer = timer or StepTimer(device)  # the same clock as gpunb's run: from one step's end to the next
    timer.on_fit_start(None)
    for step in range(steps):
        if loader:
            batch = next(batches, None)
            if batch is None:  # a new epoch
                batches = iter(shuffled)
                batch = next(batches)
            xb, yb = (t.to(device, non_blocking=True) for t in batch)
        else:
            if position + batch_size > len(x):  # a new epoch: reshuffle (sampling without replacement)
                order, position = torch.randperm(len(x), device=device), 0
            index = order[position:position + batch_size]
            position += batch_size
            xb, yb = x[index], y[index]  # held through backward, as in any hand-written loop
        with mixed:
            loss = loss_fn(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0:
            loss.item()  # the same sync cadence as gpunb's log interval
        timer.on_step_end(None)
    return timer.times


class StepTimer:
    """Per-step wall time, from one step's end to the next (no extra syncs when on CPU): gpunb
    calls it through the runtime's events, the plain loop at the end of each step, so that
    both pay the same clock and its bookkeeping. `cpu` holds the process's CPU time (all
    threads) at each step's end."""

    def __init__(self, device):
        self.device, self.times, self.cpu, self.last = device, [], [], None

    def on_fit_start(self, state):
        self.last = time.perf_counter()

    def on_step_end(self, state):
        _sync(self.device)
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.cpu.append(time.process_time())
        self.last = now

    def cpu_per_step(self, warmup: int) -> float:
        """Mean CPU seconds per step after `warmup` steps."""
        return (self.cpu[-1] - self.cpu[warmup]) / (len(self.cpu) - 1 - warmup)


def usual_loop(make_model, data, batch_size, loss_fn, precision, device, steps):
    return plain_loop(make_model, data, batch_size, loss_fn, precision, device, steps, fused=False)


def loader_loop(make_model, data, batch_size, loss_fn, precision, device, steps):
    return plain_loop(make_model, data, batch_size, loss_fn, precision, device, steps, fused=False, loader=True)


def gpunb_loop(make_model, data, batch_size, loss_fn, precision, device, steps, compile="auto"):
    torch.manual_seed(0)
    timer = StepTimer(device)
    trainer = Trainer(max_steps=steps, epochs=10**6, batch_size=batch_size, precision=precision, log_every=50,
                      track=False, accelerator=device.type, compile=compile)
    result = trainer.fit(make_model(), data, loss_fn=loss_fn, callbacks=[timer])
    if compile == "auto":
        LAST_RESULT["gpunb"] = result  # for the MFU columns
    return timer.times


def gpunb_eager_loop(make_model, data, batch_size, loss_fn, precision, device, steps):
    """gpunb with compile=False: on a GPU, where compile="auto" may capture the step as a CUDA graph,
    this shows gpunb's own per-step cost apart from what the graph saves."""
    return gpunb_loop(make_model, data, batch_size, loss_fn, precision, device, steps, compile=False)


def peak_memory(case, label, device) -> float:
    """Peak bytes of tensor memory while one loop runs 40 steps: the CUDA allocator's peak, or
    on CPU the peak of the allocator's running total from the profiler's memory events."""
    make_model, data, batch_size, loss_fn, precision = _case(case, device)
    run = lambda: LOOPS[label](make_model, data, batch_size, loss_fn, precision, device, 40)  # noqa: E731
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        return torch.cuda.max_memory_allocated() - base
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = sorted((e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"),
                            key=lambda e: e["ts"])
    totals = [e["args"]["Total Allocated"] for e in events]
    return max(totals) - (totals[0] - events[0]["args"]["Bytes"])


def registry_case(device, fit_steps, rounds, warmup):
    """gpunb tracked, gpunb with track=False and the plain loop, on Lightning's parity LSTM fed
    by a DataLoader, one thread: for each fit length, the registry's cost per fit (the whole call,
    wall and CPU) and per step (wall and CPU), interleaved rounds."""
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(3000, 16, 10, generator=g), torch.randint(0, 2, (3000,), generator=g))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the registry's thread then has the other core, as a GPU run's host has
    try:
        print(f"\nrun registry, lstm-parity fed by a DataLoader, 1 thread, {rounds} rounds, "
              f"load {_load()} at the start")
        _registry_rounds(device, data, 20, 1, warmup)  # not counted: a process's first fits load torch's lazy parts
        for steps in fit_steps:
            measured = _registry_rounds(device, data, steps, rounds, warmup)  # nothing timed inside these fits
            timed_rounds = max(5, rounds // 4)
            with RegistryClock() as clock:  # the hooks' wrappers cost a few us a call: tracked fits of their own
                _registry_rounds(device, data, steps, timed_rounds, warmup, labels=("tracked",))
            _registry_report(measured, steps, timed_rounds, clock)
        print(f"load {_load()} at the end")
    finally:
        torch.set_num_threads(threads)


def _registry_rounds(device, data, steps, rounds, warmup, labels=("tracked", "untracked", "plain")) -> dict:
    """{measure: {label: one value per round}} for the tracked, untracked and plain runs (those of
    `labels`), interleaved."""
    loss_fn = nn.CrossEntropyLoss()

    def gpunb_run(track):
        torch.manual_seed(0)
        timer = StepTimer(device)
        loader = DataLoader(TensorDataset(*data), batch_size=30, shuffle=True, drop_last=True,
                            pin_memory=device.type == "cuda")
        with FitClock(timer):  # the whole call: the Trainer's construction, set-up, steps and end
            Trainer(max_steps=steps, epochs=10**6, log_every=50, track=track, accelerator=device.type,
                    precision="32", compile=False).fit(LSTMParity(), loader, loss_fn=loss_fn, callbacks=[timer])
        return timer

    def plain_run():
        timer = StepTimer(device)
        with FitClock(timer):
            plain_loop(LSTMParity, data, 30, loss_fn, "32", device, steps, loader=True, timer=timer)
        return timer

    runs = {"tracked": lambda: gpunb_run(True), "untracked": lambda: gpunb_run(False), "plain": plain_run}
    runs = {label: run for label, run in runs.items() if label in labels}
    measured = {measure: {label: [] for label in runs} for measure in ("fit", "fit cpu", "step", "step cpu")}
    for round_ in range(rounds):  # every other round backwards, so that drift hits all alike
        for label, run in (list(runs.items()) if round_ % 2 == 0 else reversed(runs.items())):
            timer = run()
            measured["fit"][label].append(timer.fit_s)
            measured["fit cpu"][label].append(timer.fit_cpu_s)
            measured["step"][label].append(statistics.median(timer.times[min(warmup, steps // 2):]))
            measured["step cpu"][label].append(timer.cpu_per_step(min(warmup, steps // 2)))
    return measured


def _registry_report(measured: dict, steps: int, timed_rounds: int, clock) -> None:
    def ratio(values, a, b):
        ratios = [x / y for x, y in zip(values[a], values[b])]
        low, high = _middle_half(ratios)
        return f"{statistics.median(ratios):.3f} ({low:.3f}-{high:.3f})"

    fit, step = measured["fit"], measured["step"]
    print(f"{steps} steps a fit:{'fit ms':>12}{'fit cpu ms':>12}{'step ms':>10}{'step cpu ms':>13}")
    for label in fit:
        print(f"  {label:<16}" + "".join(f"{1000 * statistics.median(measured[m][label]):>{w}.3f}" for m, w in
                                         (("fit", 10), ("fit cpu", 12), ("step", 10), ("step cpu", 13))))
    extra = statistics.median(t - u for t, u in zip(fit["tracked"], fit["untracked"]))
    print(f"  tracked / untracked, whole fits: wall {ratio(fit, 'tracked', 'untracked')}, "
          f"cpu {ratio(measured['fit cpu'], 'tracked', 'untracked')}; {1000 * extra:+.2f} ms a fit")
    for a, b in (("tracked", "untracked"), ("tracked", "plain"), ("untracked", "plain")):
        print(f"  {a} / {b}, per step: wall {ratio(step, a, b)}, cpu {ratio(measured['step cpu'], a, b)}")
    print(f"  timed inside {timed_rounds} more tracked fits, per fit: "
          + ", ".join(f"{name} {1000 * seconds / timed_rounds:.2f} ms" for name, seconds in clock.totals.items())
          + "; medians: " + ", ".join(f"{name} {1000 * seconds:.2f} ms" for name, seconds in clock.medians().items()))


class FitClock:
    """Sets `timer.fit_s` and `timer.fit_cpu_s` to the wall and process CPU time (all threads) of
    the `with` block: one whole fit."""

    def __init__(self, timer):
        self.timer = timer

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        self.timer.fit_s = time.perf_counter() - self.wall
        self.timer.fit_cpu_s = time.process_time() - self.cpu


def _load() -> str:
    return "{:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


class RegistryClock:
    """Times the run recorder's hooks on the training thread (wall) and its writer thread's CPU,
    by wrapping them for the duration of a `with` block."""

    # the hooks a run calls once a fit, and those it calls as it trains
    HOOKS = {"on_fit_start": "fit start and end hooks", "on_fit_end": "fit start and end hooks",
             "on_exception": "fit start and end hooks", "on_step_end": "step and log hooks",
             "on_log": "step and log hooks", "on_validation_end": "step and log hooks",
             "on_epoch_end": "step and log hooks"}

    def __init__(self):
        # the hooks' wall time, and their CPU time on the training thread (which a loaded machine's
        # waits for a core do not inflate)
        self.totals = {"fit start and end hooks": 0.0, "step and log hooks": 0.0, "all hooks (cpu)": 0.0,
                       "writer thread (cpu)": 0.0}
        self.fits: list[dict] = []  # each fit's own hook times: their medians shrug off a loaded machine's stalls

    def __enter__(self):
        from gpunb.runs import recorder, writer

        self.saved = [(recorder.RunRecorder, name, getattr(recorder.RunRecorder, name)) for name in self.HOOKS]
        self.saved.append((writer.RunWriter, "_loop", writer.RunWriter._loop))
        for owner, name, hook in self.saved[:-1]:
            setattr(owner, name, self._timed(hook, self.HOOKS[name]))
        loop = writer.RunWriter._loop

        def timed_loop(writer_self):
            start = time.thread_time()
            try:
                loop(writer_self)
            finally:
                self.totals["writer thread (cpu)"] += time.thread_time() - start

        writer.RunWriter._loop = timed_loop
        return self

    def _timed(self, hook, total):
        def timed(*args):
            if hook.__name__ == "on_fit_start":
                self.fits.append({"fit start and end hooks": 0.0, "step and log hooks": 0.0, "all hooks (cpu)": 0.0})
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return hook(*args)
            finally:
                for name, took in ((total, time.perf_counter() - start), ("all hooks (cpu)", time.thread_time() - cpu)):
                    self.totals[name] += took
                    if self.fits:
                        self.fits[-1][name] += took
        return timed

    def medians(self) -> dict:
        return {name: statistics.median(fit[name] for fit in self.fits) for name in self.fits[0]} if self.fits else {}

    def __exit__(self, *exc):
        for owner, name, hook in self.saved:
            setattr(owner, name, hook)


def _case(name, device):
    return next(c[1:] for c in cases(device) if c[0] == name)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


LOOPS = {"gpunb": gpunb_loop, "plain": plain_loop, "usual": usual_loop, "loader": loader_loop}
LAST_RESULT: dict = {}  # the TrainResult of the latest gpunb run with compile="auto"


def mfu_line(case, device, precision, plain_s, gpunb_s) -> str | None:
    """MFU of both loops from their median step times, and the MFU of gpunb's own result."""
    result = LAST_RESULT.get("gpunb")
    peak = device_peak_tflops(device, precision)
    if result is None or result.flops_per_step is None or not peak:
        return None
    mfu = {label: result.flops_per_step / t / 1e12 / peak for label, t in (("plain", plain_s), ("gpunb", gpunb_s))}
    own = f"{100 * result.mfu:.1f}%" if result.mfu is not None else "n/a"
    achieved = f"{result.achieved_tflops:.1f}" if result.achieved_tflops is not None else "n/a"
    line = (f"  {case}: {result.flops_per_step / 1e12:.3g} TFLOP per step, peak {peak:.0f} TFLOPS; MFU plain "
            f"{100 * mfu['plain']:.1f}%, gpunb {100 * mfu['gpunb']:.1f}% (gpunb's result: "
            f"{achieved} TFLOPS, MFU {own}, warm-up included)")
    if "gpt" in case:
        line += f"; nanoGPT's formula: MFU gpunb {100 * nanogpt_flops(16, 1024) / gpunb_s / 1e12 / peak:.1f}%"
    return line


def _middle_half(values) -> tuple[float, float]:
    """The 25th and 75th percentiles (the only value twice, for one round)."""
    if len(values) < 2:
        return values[0], values[0]
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return quartiles[0], quartiles[2]


def nanogpt_flops(batch, context, layers=12, heads=12, width=768) -> float:
    """FLOPs of one GPT step by nanoGPT's `estimate_mfu`: 6N + 12 L H Q T per token, N without
    the position embedding (the PaLM appendix B count)."""
    with torch.device("meta"):
        model = GPT(layers=layers, width=width, heads=heads, context=context)
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    return (6 * n + 12 * layers * heads * (width // heads) * context) * batch * context


def main():
    parser = argparse.ArgumentParser(description="gpunb vs a hand-written PyTorch loop: step time, peak memory "
                                     "and, on a GPU, MFU.")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (GPT-2: 60)")
    parser.add_argument("--fit-steps", type=int, nargs="+", default=(100, 300, 1000), metavar="STEPS",
                        help="lstm-parity-loader: the fit lengths whose tracked / untracked ratio is measured")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    parser.add_argument("--warmup", type=int, default=30, help="steps left out of each run's median")
    parser.add_argument("--cases", nargs="+", metavar="CASE",
                        choices=("mlp", "lstm-parity", "lstm-parity-loader") + GPU_ONLY,
                        help="run only these: mlp lstm-parity lstm-parity-loader " + " ".join(GPU_ONLY))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpt_steps = max(60, args.warmup + 10)
    if args.warmup >= min(args.steps, gpt_steps) or args.rounds < 1:
        parser.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps}) and --rounds at least 1")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    if device.type != "cuda":
        print(f"skipped: {', '.join(GPU_ONLY)} (they need a CUDA GPU)")
    print(f"{'case':<18}{'plain ms':>10}{'gpunb ms':>10}{'time ratio':>12}{'middle half':>14}"
          f"{'memory ratio':>14}{'usual ms':>10}{'vs usual':>10}{'loader ms':>11}{'vs loader':>11}")
    notes = []
    for case, make_model, data, batch_size, loss_fn, precision in cases(device):
        if args.cases and case not in args.cases:
            continue
        steps = gpt_steps if "gpt" in case else args.steps
        loops = {**LOOPS, "eager": gpunb_eager_loop} if device.type == "cuda" else LOOPS  # auto is eager on a CPU
        medians = {label: [] for label in loops}
        for round_ in range(args.rounds):  # interleaved, every other round backwards
            for label, loop in (list(loops.items()) if round_ % 2 == 0 else reversed(loops.items())):
                times = loop(make_model, data, batch_size, loss_fn, precision, device, steps)
                medians[label].append(statistics.median(times[args.warmup:]))
        plain, ours, usual, loader = (statistics.median(medians[label])
                                      for label in ("plain", "gpunb", "usual", "loader"))
        ratio_to = {label: statistics.median(g / t for g, t in zip(medians["gpunb"], medians[label]))
                    for label in ("usual", "loader")}
        ratios = [g / p for g, p in zip(medians["gpunb"], medians["plain"])]
        low, high = _middle_half(ratios)
        line = mfu_line(case, device, precision, plain, ours) if case in GPU_ONLY else None  # before
        mem = {label: peak_memory(case, label, device) for label in ("plain", "gpunb")}  # runs gpunb again
        print(f"{case:<18}{1000 * plain:>10.3f}{1000 * ours:>10.3f}{statistics.median(ratios):>12.3f}"
              f"{f'{low:.3f}-{high:.3f}':>14}{mem['gpunb'] / mem['plain']:>14.3f}"
              f"{1000 * usual:>10.3f}{ratio_to['usual']:>10.3f}{1000 * loader:>11.3f}{ratio_to['loader']:>11.3f}")
        if line:
            notes.append(line)
        if "eager" in medians:
            eager = [e / p for e, p in zip(medians["eager"], medians["plain"])]
            low, high = _middle_half(eager)
            notes.append(f"  {case}: gpunb with compile=False {1000 * statistics.median(medians['eager']):.3f} ms, "
                         f"time ratio {statistics.median(eager):.3f} ({low:.3f}-{high:.3f})")
    for line in notes:
        print(line)
    if not args.cases or "lstm-parity-loader" in args.cases:
        with tempfile.TemporaryDirectory() as home:  # the tracked runs' registry, not the user's
            previous = os.environ.get("GPUNB_HOME")
            os.environ["GPUNB_HOME"] = home
            try:
                registry_case(device, args.fit_steps, args.rounds, args.warmup)
            finally:
                if previous is None:
                    del os.environ["GPUNB_HOME"]
                else:
                    os.environ["GPUNB_HOME"] = previous


if __name__ == "__main__":
    main()
