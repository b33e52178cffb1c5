"""Which NVML device a CUDA device is: CUDA_VISIBLE_DEVICES read as CUDA reads it, and MIG instances.

A device is named by its NVML index (an int) or, for a MIG instance, by (GPU index, MIG
index). CUDA_VISIBLE_DEVICES holds indices, GPU UUIDs (`GPU-...`, or any unique prefix of
one), MIG UUIDs (`MIG-...`) or `MIG-GPU-<uuid>/<GPU instance>/<compute instance>`, as
nvitop parses it: the list stops at the first entry that names no device or mixes
indices with UUIDs, a repeated entry hides every device, and at most one MIG instance is
visible (the first one named, else the first of the first GPU in MIG mode, whose
non-MIG neighbours CUDA then hides).

Call these after ensure_nvml() succeeded.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import pynvml

DeviceId = int | tuple[int, int]


@dataclass
class Mig:
    index: int  # its place among its GPU's MIG devices
    uuid: str = ""
    gpu_instance: int | None = None
    compute_instance: int | None = None


@dataclass
class Gpu:
    index: int
    uuid: str = ""
    mig_enabled: bool = False
    migs: list[Mig] = field(default_factory=list)


def label(device: DeviceId) -> int | str:
    """How a device is shown: its NVML index, or "GPU:MIG" (nvitop's "0:1") for a MIG instance."""
    return f"{device[0]}:{device[1]}" if isinstance(device, tuple) else device


def handle_of(device: DeviceId):
    if isinstance(device, tuple):
        return pynvml.nvmlDeviceGetMigDeviceHandleByIndex(pynvml.nvmlDeviceGetHandleByIndex(device[0]), device[1])
    return pynvml.nvmlDeviceGetHandleByIndex(device)


def mig_handles(handle) -> list[tuple[int, object]]:
    """(MIG index, handle) of each MIG instance of a GPU; [] when MIG is off or unsupported."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        if current != pynvml.NVML_DEVICE_MIG_ENABLE:
            return []
        slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except pynvml.NVMLError:
        return []
    found = []
    for index in range(slots):
        try:
            found.append((index, pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)))
        except pynvml.NVMLError:
            continue  # an empty slot
    return found


def inventory() -> list[Gpu]:
    """Every GPU NVML sees, with its MIG instances."""
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError:
            gpus.append(Gpu(index))
            continue
        gpu = Gpu(index, _read(pynvml.nvmlDeviceGetUUID, handle, ""))
        try:
            gpu.mig_enabled = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        except pynvml.NVMLError:
            pass
        gpu.migs = [Mig(m, _read(pynvml.nvmlDeviceGetUUID, mig, ""),
                        _read(pynvml.nvmlDeviceGetGpuInstanceId, mig, None),
                        _read(pynvml.nvmlDeviceGetComputeInstanceId, mig, None))
                    for m, mig in mig_handles(handle)]
        gpus.append(gpu)
    return gpus


def visible_devices(value: str | None, gpus: list[Gpu]) -> list[DeviceId]:
    """The devices CUDA numbers 0, 1, ... under CUDA_VISIBLE_DEVICES=`value` (None: unset)."""
    entries = [str(gpu.index) for gpu in gpus] if value is None else [_strip(e) for e in value.split(",")]
    devices: list[DeviceId] = []
    seen: set[str] = set()
    by_index: bool | None = None
    for entry in entries:
        if entry in seen:
            return []  # CUDA makes no device visible when one is named twice
        if by_index is None:
            by_index = entry.isdigit()
        if entry.isdigit() != by_index:
            break
        device = _by_index(int(entry), gpus) if by_index else _by_uuid(entry, gpus)
        if device is None:
            break  # CUDA ignores this entry and every one after it
        devices.append(device)
        seen.add(entry)
    migs = [d for d in devices if isinstance(d, tuple)]
    if migs:
        return migs[:1]
    shown: list[DeviceId] = []
    for index in devices:
        gpu = gpus[index]
        if gpu.mig_enabled:
            if gpu.migs:
                return [(index, gpu.migs[0].index)]
            continue  # MIG mode without instances: nothing CUDA can use
        shown.append(index)
    return shown


def cuda_to_nvml(cuda_index: int, uuid: str | None = None) -> DeviceId:
    """The NVML device of CUDA device `cuda_index` (its UUID, when known, settles it)."""
    gpus = inventory()
    if uuid:
        for candidate in (uuid, re.sub(r"^GPU-", "MIG-", uuid)):  # torch spells a MIG UUID GPU-...
            device = _exact(candidate, gpus)
            if device is not None:
                return device
    visible = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
    return visible[cuda_index] if cuda_index < len(visible) else cuda_index


def _strip(entry: str) -> str:
    """As CUDA reads an entry: blanks trimmed, and an index cut after its digits ("1abc" is 1)."""
    entry = entry.strip()
    digits = re.match(r"[+-]?\d+", entry)
    return str(int(digits.group())) if digits and int(digits.group()) >= 0 else entry


def _by_index(index: int, gpus: list[Gpu]) -> DeviceId | None:
    return index if 0 <= index < len(gpus) else None


def _by_uuid(entry: str, gpus: list[Gpu]) -> DeviceId | None:
    """A GPU or MIG instance by UUID, or by a prefix that matches exactly one."""
    nested = re.fullmatch(r"MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)", entry)
    if nested:
        gpu = _unique([g for g in gpus if g.uuid.lower().startswith(nested.group(1).lower())])
        if gpu is None:
            return None
        gi, ci = int(nested.group(2)), int(nested.group(3))
        mig = _unique([m for m in gpu.migs if (m.gpu_instance, m.compute_instance) == (gi, ci)])
        return None if mig is None else (gpu.index, mig.index)
    entry = entry.lower()
    if entry.startswith("mig-"):
        found = [(g.index, m.index) for g in gpus for m in g.migs if m.uuid.lower().startswith(entry)]
    elif entry.startswith("gpu-"):
        found = [g.index for g in gpus if g.uuid.lower().startswith(entry)]
    else:
        return None
    return _unique(found)


def _exact(uuid: str, gpus: list[Gpu]) -> DeviceId | None:
    for gpu in gpus:
        if gpu.uuid == uuid:
            return gpu.index
        for mig in gpu.migs:
            if mig.uuid == uuid:
                return (gpu.index, mig.index)
    return None


def _unique(found: list):
    return found[0] if len(found) == 1 else None


def _read(getter, handle, default):
    try:
        value = getter(handle)
    except pynvml.NVMLError:
        return default
    return value.decode() if isinstance(value, bytes) else value
