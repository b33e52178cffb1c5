"""How long a GPU run waits for its data when the batches are augmented on the GPU.

ResNet-18 (BasicBlock, torchvision's layout) on 64 px uint8 images held on the GPU
(synthetic: 20,000 images, 100 classes), gpunb's RandomCrop / RandomFlip / Normalize,
bf16, batch 256. Variants, interleaved round by round in one process:

- ahead:          gpunb as it ships: the batch is gathered and transformed ahead, on the
                  prefetcher's side stream, in a thread of its own (the transforms take
                  their generator);
- same-thread:    the same, launched from the loop's thread one batch ahead (as gpunb
                  does for transforms that draw from the global RNG);
- inline:         the transforms on the step's stream as the loop asks for each batch
                  (the benchmark removes the feed's prefetcher);
- host:           as shipped, with the images in host memory (`gpu_resident=False`): each
                  batch's rows gathered straight into pinned memory, then copied and
                  transformed on the side stream, in the thread;
- plain:          a hand-written loop doing the same transforms inline.

For each: gpunb's data wait (TrainResult.data_wait_s) as a share of the loop's wall
time, and the step time (wall time over steps, after a warm-up fit). All eager
(`compile=False`): the data path is measured, not the compiler. Goal: <= 5% of the wall
time waiting for data.

Then, for each variant, one more fit under torch.profiler: the GPU's busy time a step (the
sum of its kernels' and copies' times, over all streams) beside the step time. A step whose
GPU is busy for a small share of it is host-bound: the data wait is then the host's time
issuing the batch's gather and transforms, which a side stream alone cannot hide, and a
thread of its own can. Beside it, the CUDA runtime calls that wait for the device, or may.

    python benchmarks/data_wait.py                       # on a CUDA machine
    python benchmarks/data_wait.py --steps 50 --rounds 1  # a quick check
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from unittest import mock

import torch
from torch import nn

MEAN, STD = [0.485 * 255, 0.456 * 255, 0.406 * 255], [0.229 * 255, 0.224 * 255, 0.225 * 255]


class BasicBlock(nn.Module):
    def __init__(self, inputs, outputs, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                          nn.BatchNorm2d(outputs))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, classes=100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        widths, layers, inputs = (64, 128, 256, 512), [], 64
        for i, width in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers += [BasicBlock(inputs, width, stride), BasicBlock(width, width, 1)]
            inputs = width
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(512, classes)

    def forward(self, x):
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def transforms():
    from gpunb.runtime.feed.transforms import Normalize, RandomCrop, RandomFlip

    return [RandomCrop(4), RandomFlip(), Normalize(MEAN, STD)]


def images(n, classes, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, 256, (n, 3, 64, 64), dtype=torch.uint8, device=device, generator=g)
    return x, torch.randint(0, classes, (n,), device=device, generator=g)


# CUDA runtime calls that wait for the device (or may), counted under the profiler
WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaStreamWaitEvent")


def gpu_busy_share(run, data, steps, batch, variant) -> tuple[float, float, str]:
    """(GPU busy ms a step, step ms, the runtime calls that may wait) of one fit under
    torch.profiler: the busy time is the sum of the device's kernel and copy times
    (overlapping streams would count twice)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, step_ms = run(data, steps, batch, variant)
    busy_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    calls = {}
    for event in prof.key_averages():
        if event.key.startswith(WAITING_CALLS):
            calls[event.key] = (event.count, event.cpu_time_total / 1000)
    waits = ", ".join(f"{key} {count}x {ms:.1f} ms" for key, (count, ms) in sorted(calls.items()))
    return busy_us / 1000 / steps, step_ms, waits


def gpunb_fit(data, steps, batch, variant):
    """(data-wait share, step time in ms) of one gpunb fit of `steps` steps."""
    from gpunb import Trainer
    from gpunb.runtime import loop
    from gpunb.runtime.feed import feeds
    from gpunb.runtime.feed.prefetch import CudaPrefetcher

    def inline_feed(*args, **kwargs):
        feed = feeds.build_feed(*args, **kwargs)
        feed.prefetch = None  # resident tensors: gathered and transformed on the step's stream
        return feed

    model = ResNet18().to(data[0].device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    patch = contextlib.nullcontext()
    if variant == "inline":
        patch = mock.patch.object(loop, "build_feed", inline_feed)
    elif variant == "same-thread":
        patch = mock.patch.object(CudaPrefetcher, "in_thread", CudaPrefetcher.__call__)
    if variant == "host":
        data = _on_host(data)
    with patch:
        # log_every: a metric read (a host sync) every 50 steps, as a run of 5,000 steps has; "auto"
        # would read every other step of a 200-step fit, and the plain loop reads none
        result = Trainer(max_steps=steps, batch_size=batch, precision="bf16-mixed", compile=False, track=False,
                         log_every=50, gpu_resident=variant != "host",
                         transforms=transforms()).fit(
            model, data, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
    return result.data_wait_s / result.wall_time_s, 1000 * result.wall_time_s / result.steps


_HOST_COPIES = {}


def _on_host(data):
    """The images and labels in host memory, copied once."""
    if id(data) not in _HOST_COPIES:
        _HOST_COPIES[id(data)] = tuple(t.cpu() for t in data)
    return _HOST_COPIES[id(data)]


def plain_fit(data, steps, batch, _variant):
    """A hand-written bf16 loop, transforms inline: (0, step time in ms); it measures no data wait."""
    from gpunb.runtime.feed.augmenter import apply_transforms

    x, y = data
    device = x.device
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = ResNet18().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    augment, loss_fn = transforms(), nn.CrossEntropyLoss()
    synchronize()
    start = time.perf_counter()
    step = 0
    while step < steps:
        order = torch.randperm(len(y), device=y.device)
        for begin in range(0, len(y), batch):
            index = order[begin:begin + batch]
            inputs, target = apply_transforms((x[index], y[index]), augment)
            with torch.autocast(device.type, torch.bfloat16):
                loss = loss_fn(model(inputs), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == steps:
                break
    synchronize()
    return 0.0, 1000 * (time.perf_counter() - start) / steps


VARIANTS = {"ahead": gpunb_fit, "same-thread": gpunb_fit, "inline": gpunb_fit, "host": gpunb_fit,
            "plain": plain_fit}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per measured fit")
    parser.add_argument("--warmup", type=int, default=30, help="steps of the warm-up fit of each variant")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=30, help="steps of each variant's profiled fit")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/data_wait.py needs a CUDA GPU: none is visible here, nothing measured.")
        return 0
    torch.backends.cudnn.benchmark = True
    data = images(args.images, 100, torch.device("cuda"))
    for name, run in VARIANTS.items():  # cuDNN's algorithm search and first-use costs, once each
        run(data, args.warmup, args.batch, name)
    measured = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, run in VARIANTS.items():
            measured[name].append(run(data, args.steps, args.batch, name))
    print(f"{torch.cuda.get_device_name()}: ResNet-18, {args.images} uint8 images 64 px on the GPU, "
          f"batch {args.batch}, bf16, RandomCrop/RandomFlip/Normalize; medians of {args.rounds} rounds "
          f"of {args.steps} steps")
    print(f"{'variant':<16}{'data wait':>12}{'step ms':>10}{'vs ahead':>10}")
    ahead_ms = statistics.median(ms for _, ms in measured["ahead"])
    for name, rows in measured.items():
        share = statistics.median(s for s, _ in rows)
        ms = statistics.median(ms for _, ms in rows)
        wait = "n/a" if name == "plain" else f"{100 * share:.1f}%"
        print(f"{name:<16}{wait:>12}{ms:>10.2f}{ms / ahead_ms:>10.3f}")
    share = statistics.median(s for s, _ in measured["ahead"])
    print(f"goal: data wait <= 5% of wall time: {'met' if share <= 0.05 else 'not met'} ({100 * share:.1f}%)")
    print(f"under torch.profiler, {args.profile_steps} steps each (its own overhead included):")
    print(f"{'variant':<16}{'GPU busy ms':>12}{'step ms':>10}{'busy share':>12}  runtime calls that may wait")
    for name, run in VARIANTS.items():
        busy_ms, step_ms, waits = gpu_busy_share(run, data, args.profile_steps, args.batch, name)
        print(f"{name:<16}{busy_ms:>12.2f}{step_ms:>10.2f}{100 * busy_ms / step_ms:>11.0f}%  {waits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
