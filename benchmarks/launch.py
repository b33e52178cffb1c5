"""Multi-process training: time to the first step, and DDP step time against plain torch.

    python benchmarks/launch.py                       # 2 CPU processes over gloo
    python benchmarks/launch.py --accelerator cuda    # 2 GPUs over NCCL

1. From the call to the first optimizer step, as the calling process sees it: gpunb in
   one process; gpunb with 2 processes; and a raw torch.multiprocessing launch (fork) of
   a function doing what a rank must do anyway: join a process group through a TCPStore,
   wrap the model in DDP, take one step, tell the parent over a queue. gpunb's extra is
   the difference (goal: at most 1 s).
2. DDP step time, gpunb against a hand-written torch DDP loop with the same model, data,
   optimizer and per-device batch: the median over interleaved runs of each run's median
   per-step time (timed per log interval of 25 steps, each loop reading its loss once per
   interval), after warm-up (goal: at most 1.05x).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gpunb import Trainer

EVERY = 25  # steps per timed interval (gpunb's log_every; the raw loop's loss read)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def make_data(n=16384):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)


def threads_per_rank(count):
    return max(1, len(os.sched_getaffinity(0)) // count)


# ------------------------------------------------------------------ 1. time to the first step


class FirstStep:
    """Records when this process hears of the first optimizer step."""

    def __init__(self, start):
        self.start, self.seconds = start, None

    def on_step_end(self, state):
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.start


def gpunb_first_step(data, batch, devices, accelerator):
    start = time.perf_counter()
    first = FirstStep(start)
    options = dict(devices=devices, accelerator=accelerator) if devices > 1 else dict(accelerator=accelerator)
    Trainer(batch_size=batch, max_steps=1, track=False, **options).fit(
        make_model(), data, loss_fn=nn.CrossEntropyLoss(), callbacks=[first])
    return first.seconds


def _join_as_rank(rank, port, world, accelerator):
    """What every hand-written DDP rank does first: join the group, wrap the model, make AdamW."""
    torch.set_num_threads(threads_per_rank(world))
    backend = "nccl" if accelerator == "cuda" else "gloo"
    device = torch.device("cuda", rank) if accelerator == "cuda" else torch.device("cpu")
    if accelerator == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    model = nn.parallel.DistributedDataParallel(make_model().to(device),
                                                device_ids=[rank] if accelerator == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # as gpunb's default
    return device, model, optimizer


def _raw_rank(rank, port, world, data, batch, accelerator, queue):
    device, model, optimizer = _join_as_rank(rank, port, world, accelerator)
    x, y = (t[rank::world][:batch].to(device) for t in data)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        queue.put("first step")
        queue.close()
        queue.join_thread()
    os._exit(0)  # as gpunb's ranks leave: no process-group teardown


def raw_first_step(data, batch, devices, accelerator):
    start = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    queue = mp.get_context("fork").Queue()
    gc.freeze()  # see gpunb/distributed/launch.py: forked processes must not collect our garbage
    processes = mp.start_processes(_raw_rank, args=(store.port, devices, data, batch, accelerator, queue),
                                   nprocs=devices, join=False, start_method="fork")
    gc.unfreeze()
    queue.get()
    seconds = time.perf_counter() - start
    while not processes.join():
        pass
    return seconds


# ------------------------------------------------------------------ 2. DDP step time


def gpunb_step_times(data, batch, devices, accelerator, steps):
    result = Trainer(batch_size=batch, max_steps=steps, epochs=10**6, log_every=EVERY, track=False,
                     devices=devices, accelerator=accelerator).fit(make_model(), data,
                                                                   loss_fn=nn.CrossEntropyLoss())
    return [row["step_time_ms"] / 1000 for row in result.history]


def _raw_loop(rank, port, world, data, batch, accelerator, steps, queue):
    """A careful hand-written DDP loop: tensors on the device, a per-epoch shuffle split by rank
    (DistributedSampler's order), fused AdamW, the loss read once per interval."""
    device, model, optimizer = _join_as_rank(rank, port, world, accelerator)
    x, y = (t.to(device) for t in data)
    per_rank = len(x) // world
    times, epoch, position, shard = [], 0, per_rank, None
    begin = time.perf_counter()
    for step in range(steps):
        if position + batch > per_rank:
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch)).to(device)
            shard, position, epoch = order[rank::world], 0, epoch + 1
        index = shard[position:position + batch]
        position += batch
        loss = nn.functional.cross_entropy(model(x[index]), y[index])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % EVERY == 0:
            loss.item()
            now = time.perf_counter()
            times.append((now - begin) / EVERY)
            begin = now
    if rank == 0:
        queue.put(times)
        queue.close()
        queue.join_thread()
    os._exit(0)


def raw_step_times(data, batch, devices, accelerator, steps):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    queue = mp.get_context("fork").Queue()
    gc.freeze()
    processes = mp.start_processes(_raw_loop, args=(store.port, devices, data, batch, accelerator, steps, queue),
                                   nprocs=devices, join=False, start_method="fork")
    gc.unfreeze()
    times = queue.get()
    while not processes.join():
        pass
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128, help="per device")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup-intervals", type=int, default=2)
    args = parser.parse_args()
    data = make_data()
    where = (f"{args.devices} x {torch.cuda.get_device_name(0)}" if args.accelerator == "cuda"
             else f"{args.devices} CPU processes x {threads_per_rank(args.devices)} thread(s)")
    print(f"torch {torch.__version__}; {where}; MLP 256-1024-1024-10, batch {args.batch} per device")

    # Warm imports and caches once (a notebook pays these on its first cell, whatever it runs).
    gpunb_first_step(data, args.batch, args.devices, args.accelerator)
    raw_first_step(data, args.batch, args.devices, args.accelerator)
    first = {"gpunb, 1 process": [], f"gpunb, {args.devices} processes": [], "raw torch.multiprocessing": []}
    for _ in range(args.rounds):
        first["gpunb, 1 process"].append(gpunb_first_step(data, args.batch, 1, args.accelerator))
        first[f"gpunb, {args.devices} processes"].append(
            gpunb_first_step(data, args.batch, args.devices, args.accelerator))
        first["raw torch.multiprocessing"].append(raw_first_step(data, args.batch, args.devices, args.accelerator))
    print(f"\ncall -> first optimizer step (median of {args.rounds}):")
    medians = {label: statistics.median(values) for label, values in first.items()}
    for label, value in medians.items():
        print(f"  {label:<28}{1000 * value:8.0f} ms")
    extra = medians[f"gpunb, {args.devices} processes"] - medians["raw torch.multiprocessing"]
    print(f"  gpunb's extra over raw      {1000 * extra:8.0f} ms   (goal <= 1000 ms)")

    steps = {"gpunb": [], "hand-written": []}
    for _ in range(args.rounds):  # interleaved, so drift in machine speed hits both alike
        for label, run in (("gpunb", gpunb_step_times), ("hand-written", raw_step_times)):
            times = run(data, args.batch, args.devices, args.accelerator, args.steps)
            steps[label].append(statistics.median(times[args.warmup_intervals:]))
    ours, theirs = statistics.median(steps["gpunb"]), statistics.median(steps["hand-written"])
    print(f"\nDDP step time, {args.devices} processes (median of {args.rounds} runs of {args.steps} steps):")
    print(f"  hand-written torch DDP      {1000 * theirs:8.2f} ms")
    print(f"  gpunb                       {1000 * ours:8.2f} ms")
    print(f"  ratio                       {ours / theirs:8.3f}     (goal <= 1.05)")


if __name__ == "__main__":
    main()
