"""A sweep's trials as jobs on this machine's GPUs, packed by gpunb's own memory estimate.

Several small trials share a GPU while the sum of their estimates fits it; a trial whose
estimate fits no GPU, or is unknown, gets one GPU alone (its own memory plan then takes
measures there, as a single run's would); a trial of N GPUs gets N whole GPUs. A trial that
finds no room waits for a running one to end. On a machine without GPUs every trial runs
as processes of its own, `parallel` at a time, and CUDA_VISIBLE_DEVICES is left alone.

The devices are read once, when the first trial is placed (NVML: no CUDA context in the
kernel), and the trials placed since are booked against that reading: a trial just started
has not allocated its memory yet, so reading the free memory again would count it as free.
Trials already running when the sweep began (a re-run that follows them) are in that reading.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpunb.errors import GpunbError
from gpunb.runtime.memory.plan import SAFETY

# What each trial's process holds on its GPU beside its tensors: the CUDA context, the kernels
# torch loads and cuBLAS/cuDNN workspaces (several hundred MiB on current GPUs), which the
# summary's estimate does not count. Booked once per trial on each of its devices.
CONTEXT_BYTES = 768 * 2**20


@dataclass(frozen=True)
class Device:
    index: int  # as the kernel's CUDA numbers it (said in messages)
    name: str  # what a trial's CUDA_VISIBLE_DEVICES names it by: its UUID where NVML gives one
    total: int  # bytes
    free: int  # bytes free when the sweep began (other processes' memory already taken)

    @property
    def usable(self) -> int:
        """The share trials may fill: the memory plan's own (SAFETY leaves room for the caching
        allocator's fragmentation and kernels' workspaces)."""
        return int(SAFETY * self.free)


@dataclass(frozen=True)
class Need:
    bytes: int | None  # the trial's estimate on each device; None: a whole device
    gpus: int = 1  # devices it trains on (over 1: that many whole devices; 0: none, a CPU trial)
    why: str = ""  # where the figure comes from, for messages


@dataclass(frozen=True)
class Slot:
    """Where a trial was placed: its devices and what it books on each."""

    devices: tuple = ()  # Device
    bytes: int | None = 0  # booked on each device; None: the devices whole

    @property
    def visible(self) -> str | None:
        """CUDA_VISIBLE_DEVICES for the trial's job; None: left as it is (no GPU)."""
        return ",".join(d.name for d in self.devices) if self.devices else None


class Packer:
    """Books trials onto devices: `need(arguments)` says what a trial of `config` needs, `place(need)`
    gives its Slot or None (no room yet), `release(slot)` when it ends. `devices`: given (tests,
    benchmarks) or read on first use."""

    def __init__(self, config=None, devices=None):
        self.config = config
        self._devices = None if devices is None else list(devices)
        self._booked: dict[int, list] = {}  # device index -> what each trial there books (None: whole)

    @property
    def devices(self) -> list[Device]:
        if self._devices is None:
            self._devices = read_devices()
        return self._devices

    def need(self, arguments: dict, trial: int) -> Need:
        """What trial number `trial` needs; one message, before it is submitted, when no placement
        could ever take it (more GPUs than there are; too large for any GPU, even alone with every
        memory measure)."""
        from gpunb.runtime.memory.planning import DoesNotFit

        try:
            need = trial_need(self.config, arguments, self.devices)
        except DoesNotFit as error:
            from gpunb.render import format_bytes

            largest = max(d.free for d in self.devices)
            raise GpunbError(f"Trial {trial} cannot fit on any GPU of this machine, even alone (the "
                             f"largest has {format_bytes(largest)} free): {error.what}",
                             "train it smaller: narrow the search space's largest values (width, "
                             "layers), or LoRA adapters; or give each trial several GPUs to shard over "
                             "(`--devices N --strategy fsdp`), or run the trials on a cluster with larger "
                             "GPUs (`--cluster slurm`). A smaller batch does not help: the memory plan "
                             "already cuts it into micro-batches.") from error
        if need.gpus > len(self.devices):
            raise GpunbError(f"Trial {trial} trains on {need.gpus} GPUs, and this machine has "
                             f"{len(self.devices)}.",
                             f"ask for at most {len(self.devices)} (`--devices {len(self.devices)}`), or run "
                             "the sweep's trials on a cluster (`--cluster slurm`).")
        return need

    def place(self, need: Need) -> Slot | None:
        if not self.devices or need.gpus == 0:
            return Slot()
        if need.gpus == 1 and need.bytes is not None:
            cost = need.bytes + CONTEXT_BYTES
            fits = [d for d in self.devices if self._room(d) >= cost]
            if fits:  # the most room left: trials spread over the GPUs before they share one
                device = max(fits, key=self._room)
                self._booked.setdefault(device.index, []).append(cost)
                return Slot((device,), cost)
            if any(d.usable >= cost for d in self.devices):
                return None  # it fits a device once trials there end
        return self._whole(need.gpus)

    def release(self, slot: Slot | None) -> None:
        """The trial of `slot` ended (None: a trial the packer did not place, re-attached)."""
        for device in slot.devices if slot is not None else ():
            self._booked[device.index].remove(slot.bytes)

    def _room(self, device: Device) -> int:
        booked = self._booked.get(device.index, [])
        return -1 if None in booked else device.usable - sum(booked)

    def _whole(self, gpus: int) -> Slot | None:
        """`gpus` devices no trial uses, the largest first (a trial alone on one for want of room
        takes the one with the most)."""
        empty = sorted((d for d in self.devices if not self._booked.get(d.index)), key=lambda d: -d.free)
        if len(empty) < gpus:
            return None
        chosen = tuple(sorted(empty[:gpus], key=lambda d: d.index))
        for device in chosen:
            self._booked.setdefault(device.index, []).append(None)
        return Slot(chosen, None)


def trial_need(config, arguments: dict, devices: list[Device]) -> Need:
    """What one trial needs of `devices`, from gpunb's own estimate: the weights, gradients,
    optimizer state and activations `Trainer.summary()` reports, measured by a dry run in this
    process on the CPU. It is the cheapest figure that is the trial's own: one forward and
    backward of MEASURED_SAMPLES samples, undone, scaled to the batch (an analytic count alone
    misses the activations, a small model's largest part; a meta-tensor run cannot measure them).
    On the CPU the activations are fp32 where a GPU may run bf16: the figure errs high, which
    packs fewer trials, never too many. Its memory plan, planned against the largest GPU, says
    before any work when a trial cannot fit even alone. `memory_budget`, when set, is the figure
    instead: each trial's own plan keeps within it."""
    gpus = _gpus_of(config, len(devices))
    if not devices or gpus == 0:
        return Need(0, 0, "no GPU")
    if gpus > 1:
        return Need(None, gpus, f"{gpus} GPUs")
    if config.memory_budget is not None:
        return Need(config.memory_budget, 1, "memory_budget")
    if config.batch_size == "auto":
        return Need(None, 1, 'batch_size="auto" fills its GPU')
    if not any(d.free for d in devices):
        return Need(None, 1, "the GPUs' memory is unknown (no NVML)")
    # planned against the largest GPU less the trial's own CUDA context: what it would have there alone
    summary = _summary_on_cpu(config, arguments, max(1, max(d.free for d in devices) - CONTEXT_BYTES))
    if summary.activations_bytes is None:  # a custom step, say: not run ahead of time
        return Need(None, 1, f"activations {summary.activations_note}")
    return Need(summary.estimated_bytes, 1, "its summary's estimate")


def _gpus_of(config, visible: int) -> int:
    """The GPUs one trial's job trains on, as the local backend gives them."""
    if config.accelerator in ("cpu", "mps"):
        return 0
    count = config.gpus_per_node or (visible if config.devices == "all" else config.devices)
    return min(count, visible) if config.backend == "gloo" else count  # gloo's processes share GPUs


def _summary_on_cpu(config, arguments: dict, budget: int):
    """Trainer.summary's dry run on the CPU (the kernel's RNGs, the model's weights and gradients
    left as they were; nothing recorded, no checkpoint read); its memory plan against `budget`
    raises when nothing fits."""
    import warnings

    from gpunb.runtime.context import LocalContext
    from gpunb.runtime.loop import dry_run

    precision = "bf16-mixed" if config.precision == "16-mixed" else config.precision  # same bytes, on a CPU
    on_cpu = config.replace(accelerator="cpu", devices=1, precision=precision, resume=None, memory_budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trial's own fit says what it has to say
        return dry_run(on_cpu, LocalContext(), arguments["model"], arguments["train_data"],
                       arguments.get("val_data"), optimizer=arguments.get("optimizer"),
                       loss_fn=arguments.get("loss_fn"), step=arguments.get("step"),
                       metrics=arguments.get("metrics"))


def read_devices() -> list[Device]:
    """The GPUs this process may use (its CUDA_VISIBLE_DEVICES), in CUDA's numbering, with their
    memory from NVML, which makes no CUDA context here (a kernel holding one would keep its memory
    from the trials). Without NVML, torch's count with unknown memory: one trial per GPU."""
    import os

    try:
        from gpunb.telemetry.nvml import ensure_nvml
        from gpunb.telemetry.visible import handle_of, inventory, visible_devices
    except ImportError:  # nvidia-ml-py missing
        return _counted_devices()
    if ensure_nvml() is not None:
        return _counted_devices()
    import pynvml

    devices = []
    for index, device in enumerate(visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), inventory())):
        handle = handle_of(device)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        devices.append(Device(index, uuid or str(index), int(memory.total), int(memory.free)))
    return devices


def _counted_devices() -> list[Device]:
    """torch's count of visible GPUs, each named as this process's CUDA_VISIBLE_DEVICES names it."""
    import torch

    from gpunb.jobs.backends.local import named_visible

    named = named_visible() or []
    return [Device(index, named[index] if index < len(named) else str(index), 0, 0)
            for index in range(torch.cuda.device_count())]
