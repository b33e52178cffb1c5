"""How much slower a training step runs under %gpuprofile's profiler.

    python benchmarks/profile_overhead.py [--steps 30] [--repeats 5] [--threads N]

For a small and a medium MLP, on the CPU and on CUDA when there is one: the wall
time of a plain training step, the mean step time that gpunb.profiling.profile
reports for the same step (record_shapes and profile_memory on, as %gpuprofile runs),
and their ratio (best of interleaved repeats, so that load from other processes
cancels out). The profiler adds a fixed cost per op, so the ratio is highest for
small, dispatch-bound steps.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from gpunb.profiling import profile


def make_step(width: int, depth: int, batch: int, device: torch.device):
    torch.manual_seed(0)
    layers = [nn.Linear(width, width) if i % 2 == 0 else nn.ReLU() for i in range(2 * depth)]
    model = nn.Sequential(*layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(batch, width, device=device)

    def step():
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def plain_step_ms(step, device: torch.device, steps: int) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps * 1000


def compare(step, device: torch.device, steps: int, repeats: int) -> tuple[float, float]:
    """Best plain and best profiled step time over interleaved repeats (noise only adds time)."""
    for _ in range(3):
        step()
    plain, profiled = [], []
    for _ in range(repeats):
        plain.append(plain_step_ms(step, device, steps))
        profiled.append(profile(step, steps=steps, warmup=3, device=device).step_ms)
    return min(plain), min(profiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    models = {"small MLP (3x256, batch 64)": (256, 3, 64), "medium MLP (4x512, batch 128)": (512, 4, 128)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    print(f"{'device':<6} {'model':<32} {'plain ms':>9} {'profiled ms':>12} {'ratio':>6}")
    for device in devices:
        for name, (width, depth, batch) in models.items():
            step = make_step(width, depth, batch, device)
            plain, profiled = compare(step, device, args.steps, args.repeats)
            print(f"{device.type:<6} {name:<32} {plain:>9.3f} {profiled:>12.3f} {profiled / plain:>6.2f}")


if __name__ == "__main__":
    main()
