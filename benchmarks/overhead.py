"""gpunb vs a hand-written PyTorch loop doing the same work: step time and peak memory.

Both train the same seeded model on the same data with the same optimizer and
precision. Runs are interleaved (gpunb, plain, gpunb, plain, ...) so that drift in
machine speed hits both alike; each reports the median step time after warm-up.

    python benchmarks/overhead.py            # CPU cases (+ the GPU case when CUDA is there)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time

import torch
from torch import nn

from gpunb import Trainer


class LSTMParity(nn.Module):
    """Lightning's parity model: LSTM(10, 20) + Linear, batch 30, sequence 16."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(10, 20, batch_first=True)
        self.head = nn.Linear(20, 2)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class TinyGPT(nn.Module):
    """GPT-2-small-like: 12 layers, 768 wide, 12 heads, vocab 50,304, context 1,024."""

    def __init__(self, vocab=50304, width=768, layers=12, heads=12, context=1024):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def cases(device):
    g = torch.Generator().manual_seed(0)
    yield ("mlp", lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)),
           (torch.randn(8192, 64, generator=g), torch.randint(0, 10, (8192,), generator=g)),
           128, nn.CrossEntropyLoss(), "32")
    yield ("lstm-parity", LSTMParity,
           (torch.randn(3000, 16, 10, generator=g), torch.randint(0, 2, (3000,), generator=g)),
           30, nn.CrossEntropyLoss(), "32")
    if device.type == "cuda":
        tokens = torch.randint(0, 50304, (256, 1025), generator=g)
        yield ("gpt2-small-bf16", TinyGPT, (tokens[:, :-1], tokens[:, 1:]), 8,
               lambda logits, target: nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()),
               "bf16-mixed")


def plain_loop(make_model, data, batch_size, loss_fn, precision, device, steps):
    """What a careful user writes by hand: data on the device, shuffled once per epoch,
    fused/foreach AdamW, autocast, and the loss read at the same interval as gpunb's."""
    torch.manual_seed(0)
    model = make_model().to(device)
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **fast)
    x, y = (t.to(device) for t in data)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    times, order, position = [], None, len(x)
    for step in range(steps):
        begin = time.perf_counter()
        if position + batch_size > len(x):  # a new epoch: reshuffle (sampling without replacement)
            order, position = torch.randperm(len(x), device=device), 0
        index = order[position:position + batch_size]
        position += batch_size
        xb, yb = x[index], y[index]  # held through backward, as in any hand-written loop
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0:
            loss.item()  # the same sync cadence as gpunb's log interval
        _sync(device)
        times.append(time.perf_counter() - begin)
    return times


class StepTimer:
    """Per-step wall time through the runtime's own events (no extra syncs when on CPU)."""

    def __init__(self, device):
        self.device, self.times, self.last = device, [], None

    def on_fit_start(self, state):
        self.last = time.perf_counter()

    def on_step_end(self, state):
        _sync(self.device)
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now


def gpunb_loop(make_model, data, batch_size, loss_fn, precision, device, steps):
    torch.manual_seed(0)
    timer = StepTimer(device)
    Trainer(max_steps=steps, epochs=10**6, batch_size=batch_size, precision=precision, log_every=50,
            track=False, accelerator=device.type).fit(make_model(), data, loss_fn=loss_fn,
                                                      callbacks=[timer])
    return timer.times


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


def _case(name, device):
    return next(c[1:] for c in cases(device) if c[0] == name)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


LOOPS = {"plain": plain_loop, "gpunb": gpunb_loop}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'case':<18}{'plain ms':>10}{'gpunb ms':>10}{'time ratio':>12}{'memory ratio':>14}")
    for case, make_model, data, batch_size, loss_fn, precision in cases(device):
        steps = args.steps if device.type == "cpu" or "gpt" not in case else 60
        medians = {"plain": [], "gpunb": []}
        for _ in range(args.rounds):  # interleaved rounds
            for label, loop in (("gpunb", gpunb_loop), ("plain", plain_loop)):
                times = loop(make_model, data, batch_size, loss_fn, precision, device, steps)
                medians[label].append(statistics.median(times[args.warmup:]))
        plain, ours = statistics.median(medians["plain"]), statistics.median(medians["gpunb"])
        mem = {label: peak_memory(case, label, device) for label in LOOPS}
        print(f"{case:<18}{1000 * plain:>10.3f}{1000 * ours:>10.3f}{ours / plain:>12.3f}"
              f"{mem['gpunb'] / mem['plain']:>14.3f}")


if __name__ == "__main__":
    main()
