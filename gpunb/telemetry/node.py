"""Every GPU a job was given on this node, sampled together: what a job's node reports (jobs/gpus.py).

One GpuSampler per GPU (CUDA's numbering, so CUDA_VISIBLE_DEVICES, set by Slurm or the local
executor, says which GPUs are the job's); `new_samples()` hands over each sample once.
"""

from __future__ import annotations

from gpunb.telemetry.sampler import MIN_INTERVAL_S, GpuSampler


class NodeSampler:
    def __init__(self, cuda_indices, interval: float = MIN_INTERVAL_S):
        self.samplers = [GpuSampler.of_cuda_device(index, interval=interval) for index in cuda_indices]
        self._taken = [0.0] * len(self.samplers)  # per GPU: the monotonic time of the newest sample handed over

    def start(self) -> NodeSampler:
        for sampler in self.samplers:
            sampler.start()
        return self

    def stop(self) -> None:
        for sampler in self.samplers:
            sampler.stop()

    def new_samples(self) -> list[dict]:
        """The samples taken since the last call, GPU by GPU, oldest first (without the process's clock)."""
        found = []
        for position, sampler in enumerate(self.samplers):
            fresh = [s for s in sampler.samples() if s["monotonic"] > self._taken[position]]
            if fresh:
                self._taken[position] = fresh[-1]["monotonic"]
            found += [{key: value for key, value in s.items() if key != "monotonic"} for s in fresh]
        return found

    @property
    def energy_j(self) -> float | None:
        """The energy of this node's GPUs since start(); None when none of them reports one."""
        known = [sampler.energy_j for sampler in self.samplers if sampler.energy_j is not None]
        return sum(known) if known else None
