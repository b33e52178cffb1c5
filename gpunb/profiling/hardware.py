"""What the profiled device can do: the one place the advice asks about hardware.

Tests replace `device_caps` to give a CPU run the abilities of a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceCaps:
    gpu: bool = False  # a CUDA device (GPU-only advice is given only then)
    name: str = "CPU"
    capability: tuple[int, int] | None = None  # CUDA compute capability
    bf16: bool = False  # native bf16 matmuls (Ampere and newer)
    fp16: bool = False  # fp16 tensor cores (Volta and newer)
    tf32_enabled: bool = False  # fp32 matmuls may use TF32 right now
    total_memory: int | None = None  # bytes


def device_caps(device) -> DeviceCaps:
    """The abilities of `device` (a torch.device); a CPU or MPS device has none of them."""
    if getattr(device, "type", None) != "cuda":
        return DeviceCaps(name="Apple MPS" if getattr(device, "type", None) == "mps" else "CPU")
    import torch

    from gpunb.runtime.device import cuda_bf16_supported, cuda_capability, device_name

    capability = tuple(cuda_capability(device))
    return DeviceCaps(gpu=True, name=device_name(device), capability=capability,
                      bf16=cuda_bf16_supported(device), fp16=capability >= (7, 0),
                      tf32_enabled=torch.get_float32_matmul_precision() != "highest",
                      total_memory=torch.cuda.get_device_properties(device).total_memory)
