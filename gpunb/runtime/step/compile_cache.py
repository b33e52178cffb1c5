"""Compile caches that outlive the kernel: one Inductor cache directory in `GPUNB_HOME`, and the
compile artifacts of each step kept by what the compiled code depends on.

Inductor keeps compiled graphs and kernels in `TORCHINDUCTOR_CACHE_DIR` and looks them up by
the graph, its inputs' shapes and torch's version, so a process that compiles into a warm
directory mostly loads (the compile worker and the training process share one: see
compile_beside.py). `torch.compiler.save_cache_artifacts()` gives the same entries as bytes,
which load into another directory, on another machine (a job's node): they are kept here per
key, and a key that has bytes says the step was compiled here before, so a run of the same
cell, in a new kernel or a job, compiles at once from the warm cache instead of beside its
eager steps. The directory is trimmed, oldest first, to CAP_BYTES (`GPUNB_COMPILE_CACHE_MB`
overrides it); `gpunb cache clear` empties it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path

import torch


CAP_BYTES = 4 * 2**30  # the whole directory, artifacts and Inductor's files together
ARTIFACTS = ".artifacts"  # the file suffix of a key's save_cache_artifacts() bytes
ENV = "TORCHINDUCTOR_CACHE_DIR"


def directory() -> Path:
    from gpunb.runs.paths import data_dir  # here: importing gpunb.runs opens the registry's modules

    return data_dir() / "compile-cache"


def inductor_dir() -> str:
    """Where Inductor caches during a run: the user's TORCHINDUCTOR_CACHE_DIR when set to a
    directory of their own, else gpunb's (torch sets the variable to its default itself, once
    it has compiled: that one counts as not set)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get(ENV)
    if given and os.path.abspath(given) != os.path.abspath(default_cache_dir()):
        return given
    return str(directory() / "inductor")


@contextlib.contextmanager
def inductor_cache(path: str):
    """Inductor caches into `path` inside the block; the variable is as it was after it."""
    before = os.environ.get(ENV)
    os.environ[ENV] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def key_of(model: torch.nn.Module, piece, precision: str, mode, device: torch.device) -> str:
    """What a step's compiled code depends on: the model's structure (its modules and every
    parameter's and buffer's name, shape and dtype), the micro-batch's shapes, the precision,
    the compile mode, torch's version and the device's kind."""
    structure = [repr(model)] + [f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}"
                                 for name, t in (*model.named_parameters(), *model.named_buffers())]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    parts = [*structure, _shapes(piece), precision, repr(mode), torch.__version__, device_name]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _shapes(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={_shapes(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_shapes(v) for v in value) + ")"
    return type(value).__name__


def load(key: str) -> bool:
    """Load the key's artifacts into Inductor's caches; False: this step was not compiled here
    before (or its bytes no longer load: a newer torch, a damaged file)."""
    path = directory() / f"{key}{ARTIFACTS}"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return False
    try:
        loaded = torch.compiler.load_cache_artifacts(data) is not None  # None: torch could not read them
    except Exception:  # noqa: BLE001 - bytes that do not load are a cold cache, not an error
        loaded = False
    if not loaded:
        path.unlink(missing_ok=True)
        return False
    path.touch()  # recently used: the trim keeps it
    return True


def save(key: str, data: bytes | None) -> None:
    """Keep the key's artifacts (written whole, then renamed: a reader never sees half a file),
    then trim the directory to its cap."""
    if not data:
        return
    folder = directory()
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{key}{ARTIFACTS}.partial-{os.getpid()}"
    try:
        partial.write_bytes(data)
        partial.replace(folder / f"{key}{ARTIFACTS}")
    except OSError:  # a full disk: the cache is a saving, never a failure
        partial.unlink(missing_ok=True)
        return
    trim()


def cap_bytes() -> int:
    given = os.environ.get("GPUNB_COMPILE_CACHE_MB")
    return int(float(given) * 2**20) if given else CAP_BYTES


def trim(cap: int | None = None) -> int:
    """Delete the least recently written files until the directory holds at most `cap` bytes;
    returns the bytes deleted."""
    cap = cap_bytes() if cap is None else cap
    files = [(p.stat().st_mtime, p.stat().st_size, p) for p in directory().rglob("*") if p.is_file()]
    total, freed = sum(size for _, size, _ in files), 0
    for _, size, path in sorted(files):
        if total - freed <= cap:
            break
        path.unlink(missing_ok=True)
        freed += size
    return freed


def clear() -> tuple[int, int]:
    """Empty the directory: (files, bytes) deleted."""
    folder = directory()
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
    size = sum(p.stat().st_size for p in files)
    shutil.rmtree(folder, ignore_errors=True)
    return len(files), size
