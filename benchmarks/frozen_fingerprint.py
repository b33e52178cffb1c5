"""What the frozen base's fingerprint costs: the digest of every value, on the weights' device.

A LoRA run computes it once (at its first checkpoint, or at resume, where it is checked):
two polynomial hashes of every 16-bit word of every frozen tensor, in int64 on the device
(runtime/trainable.py). Here: bf16 tensors of growing size, the best of three timings each
after a warm-up, and the time per value extrapolated to an 8B base (8e9 bf16 values).

    python benchmarks/frozen_fingerprint.py                 # CPU; --device cuda on a GPU
"""

from __future__ import annotations

import argparse
import time

import torch

from gpunb.runtime.trainable import fingerprint

BASE_8B = 8e9  # bf16 values in an 8B base


def timed(tensor, device) -> float:
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fingerprint({"w": tensor})  # ends with the digests on the host: the device is done
        best = min(best, time.perf_counter() - started)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default="1e6,1e7,1e8", help="values per tensor, comma-separated")
    args = parser.parse_args()
    device = torch.device(args.device)
    fingerprint({"w": torch.ones(8, device=device)})  # warm-up: the power tables, the kernels
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| bf16 values | seconds | ns per value | an 8B base at that rate |\n|---|---|---|---|")
    for size in (int(float(s)) for s in args.sizes.split(",")):
        tensor = torch.randn(size // 4096, 4096, device=device).to(torch.bfloat16)
        seconds = timed(tensor, device)
        print(f"| {tensor.numel():,} | {seconds:.3f} | {1e9 * seconds / tensor.numel():.2f} | "
              f"{BASE_8B * seconds / tensor.numel():.1f} s |")
        del tensor


if __name__ == "__main__":
    main()
