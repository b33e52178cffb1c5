"""Which device to train on, what it can do, and seeding.

Capability queries live in small functions so tests can mock a GPU's abilities.
Nothing here runs at import time.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from gpunb.errors import GpunbError


def select_device(accelerator: str = "auto", local_rank: int = 0) -> torch.device:
    """The device for this process: CUDA (NVIDIA or ROCm) > Apple MPS > CPU under "auto"."""
    if accelerator == "auto":
        if torch.cuda.is_available():
            accelerator = "cuda"
        elif mps_available():
            accelerator = "mps"
        else:
            accelerator = "cpu"
    if accelerator == "cuda":
        if not torch.cuda.is_available():
            raise GpunbError("accelerator='cuda' was asked for, but PyTorch sees no CUDA GPU.",
                             "use `accelerator='auto'` (falls back to CPU), or install a CUDA "
                             "build of torch and check `nvidia-smi`.")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if accelerator == "mps":
        if not mps_available():
            raise GpunbError("accelerator='mps' was asked for, but MPS is not available.",
                             "use `accelerator='auto'` or `accelerator='cpu'`.")
        return torch.device("mps")
    return torch.device("cpu")


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is torch running out of memory: CUDA's OutOfMemoryError, or a failed host
    allocation, which torch raises as a plain RuntimeError from its CPU allocator."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error)


def mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend and backend.is_available())


def cuda_bf16_supported(device: torch.device) -> bool:
    """True when the GPU runs bf16 natively (NVIDIA Ampere and newer, AMD MI200 and newer)."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    return "CPU"


def seed_everything(seed: int | None, deterministic: bool) -> dict:
    """Seed python, numpy and torch; return the global settings to restore afterwards."""
    saved = {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    if seed is not None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # seeds every CUDA device too, lazily
    if deterministic:
        # cuBLAS needs a fixed workspace to be reproducible; set before the first matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    return saved


def restore_globals(saved: dict) -> None:
    torch.use_deterministic_algorithms(saved["deterministic"])
    torch.backends.cudnn.benchmark = saved["cudnn_benchmark"]
    if saved["cublas_config"] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved["cublas_config"]


def rng_state(device: torch.device) -> dict:
    """Every RNG a run draws from, as tensors, so `torch.load(weights_only=True)` can read it."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(py_state, dtype=torch.int64),
        "python_meta": [py_version, py_gauss],
        "numpy": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_meta": [np_kind, int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def python_rng_state(state: dict) -> tuple:
    """`random.setstate`'s argument, from the tensors a checkpoint keeps it as."""
    version, gauss = state["python_meta"]
    return version, tuple(state["python"].tolist()), gauss


def numpy_rng_state(state: dict) -> tuple:
    """`np.random.set_state`'s argument, from the tensors a checkpoint keeps it as."""
    kind, pos, has_gauss, np_gauss = state["numpy_meta"]
    return kind, state["numpy"].numpy().astype(np.uint32), pos, has_gauss, np_gauss


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(python_rng_state(state))
    np.random.set_state(numpy_rng_state(state))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
