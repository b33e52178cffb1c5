"""The dense peak TFLOPS of known GPUs, per precision: the denominator of MFU.

Numbers are NVIDIA's datasheet figures for dense math (the datasheets print the
2:4-sparse figure, twice these, with an asterisk), tensor cores for bf16/fp16/tf32:
- H100 SXM / H200 (SXM): bf16 989, tf32 495, fp32 67 (H100 and H200 Tensor Core GPU datasheets)
- H100 PCIe: bf16 756, tf32 378, fp32 51
- H100 NVL / H200 NVL: bf16 835, tf32 418, fp32 60
- A100 (SXM4 and PCIe, 40 and 80 GB): bf16 312, tf32 156, fp32 19.5
- L40S: bf16 362, tf32 183, fp32 91.6; L40: bf16 181, tf32 90.5, fp32 90.5
- L4: bf16 121, tf32 60, fp32 30.3; A10: bf16 125, tf32 62.5, fp32 31.2
- GeForce RTX 4090: fp16/bf16 with fp32 accumulate (what PyTorch uses) 165, tf32 82.6, fp32 82.6
  (Ada GPU architecture whitepaper); RTX 3090: 71, tf32 35.6, fp32 35.6 (Ampere GA102 whitepaper)
- V100 SXM2: fp16 125, fp32 15.7; V100 PCIe: 112, 14; V100S: 130, 16.4 (no bf16, no tf32)
- T4: fp16 65, fp32 8.1 (no bf16, no tf32)
"""

from __future__ import annotations

import re

# (pattern on torch.cuda.get_device_name, {precision kind: dense peak TFLOPS}); the first match wins,
# so the more specific names come first ("H100 NVL" before "H100", "A100" is not "A10").
_HOPPER = {"bf16": 989.0, "fp16": 989.0, "tf32": 495.0, "fp32": 67.0}
_HOPPER_NVL = {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}
_TABLE = [
    (r"H100.*PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (r"H[12]00.*NVL", _HOPPER_NVL),
    (r"H100|H200", _HOPPER),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    (r"L40\b", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"RTX 4090(?! ?D)", {"bf16": 165.0, "fp16": 165.0, "tf32": 82.6, "fp32": 82.6}),
    (r"RTX 3090(?! ?Ti)", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    (r"V100S", {"fp16": 130.0, "fp32": 16.4}),
    (r"V100.*PCI", {"fp16": 112.0, "fp32": 14.0}),
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
]


def precision_kind(precision: str, tf32: bool) -> str:
    """The math a run's matmuls use: "bf16", "fp16", "tf32" (fp32 with TF32 matmuls allowed) or "fp32"."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    return "tf32" if tf32 else "fp32"


def peak_tflops(device_name: str, kind: str) -> float | None:
    """The dense peak of `device_name` for `kind` (see precision_kind); None for a device not in the
    table (any CPU) or a precision it has no tensor cores for (tf32 then falls back to fp32)."""
    for pattern, peaks in _TABLE:
        if re.search(pattern, device_name):
            return peaks.get(kind, peaks.get("fp32") if kind == "tf32" else None)
    return None


def device_peak_tflops(device, precision: str) -> float | None:
    """The dense peak of a torch.device for a run's precision name ("bf16-mixed", "16-mixed", "32");
    None off CUDA. Reads the device's name and torch's fp32 matmul setting, nothing more."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    from gpunb.runtime.device import device_name

    tf32 = torch.get_float32_matmul_precision() != "highest"
    return peak_tflops(device_name(device), precision_kind(precision, tf32))
