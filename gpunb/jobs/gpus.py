"""Each node's GPU samples in the job folder: its first task writes them, the kernel tails them.

    gpus-<node>.jsonl   one line per log interval (and one at the fit's end), appended whole:
                        {"t", "event": "gpu_samples", "node", "host", "attempt", "samples", "energy_j"}

`samples` are the node's telemetry samples since the line before (utilisation, memory, power,
temperature, the energy counter, per GPU: telemetry/nvml.py's fields); `energy_j` is the
energy of the node's GPUs since this attempt began (a requeued job starts a new attempt, so
the kernel adds the attempts up). Each line is written by opening, appending and closing
the file: a reader on another machine of a shared file system sees it whole once it opens
the file (NFS's close-to-open consistency).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from gpunb.jobs.events import EventsReader, append

FILE_PATTERN = "gpus-*.jsonl"
DISCOVER_EVERY_S = 1.0  # the folder is listed for new nodes' files at most this often


def gpus_path(folder, node: int) -> Path:
    return Path(folder) / f"gpus-{node}.jsonl"


class NodeGpuWriter:
    """The callback of a node's first task: its GPUs' samples into gpus-<node>.jsonl each log."""

    def __init__(self, path, *, node: int, host: str, cuda_indices):
        self.path, self.node, self.host = os.fspath(path), node, host
        self.cuda_indices = list(cuda_indices)
        self.sampler = None
        self.attempt = None

    def on_fit_start(self, state) -> None:
        try:
            from gpunb.telemetry.node import NodeSampler
        except ImportError:  # nvidia-ml-py missing: a job without GPU samples
            return
        self.attempt = time.time()
        self.sampler = NodeSampler(self.cuda_indices).start()  # returns at once: NVML starts on its threads

    def on_log(self, state, row) -> None:
        self._write()

    def on_fit_end(self, state) -> None:
        self._end()

    def on_exception(self, state, error) -> None:
        self._end()

    def _end(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()  # the energy's end point
            self._write(final=True)
            self.sampler = None

    def _write(self, final: bool = False) -> None:
        if self.sampler is None:
            return
        samples, energy = self.sampler.new_samples(), self.sampler.energy_j
        if samples or (final and energy is not None):
            append(self.path, "gpu_samples", node=self.node, host=self.host, attempt=self.attempt,
                   samples=samples, energy_j=energy)


class NodeGpuReader:
    """The kernel's side: new samples of every node's file, and the energy of all nodes."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.readers: dict[Path, EventsReader] = {}
        self.energy: dict[tuple, float] = {}  # (node, attempt) -> the newest energy of its GPUs
        self._listed = 0.0

    def read(self) -> list[dict]:
        """The samples written since the last call, each with its node's number and host."""
        now = time.monotonic()
        if now - self._listed >= DISCOVER_EVERY_S:
            self._listed = now
            for path in sorted(self.folder.glob(FILE_PATTERN)):
                self.readers.setdefault(path, EventsReader(path))
        samples = []
        for reader in self.readers.values():
            for line in reader.read():
                if line.get("energy_j") is not None:
                    self.energy[(line["node"], line["attempt"])] = line["energy_j"]
                samples += [{"node": line["node"], "host": line["host"], **s} for s in line["samples"]]
        return samples

    def read_all(self) -> list[dict]:
        """As read(), listing the folder now (at the job's end: the last lines of every node)."""
        self._listed = 0.0
        return self.read()

    @property
    def energy_by_node(self) -> dict[int, float]:
        """Each node's GPU energy, its attempts added up."""
        by_node: dict[int, float] = {}
        for (node, _attempt), joules in self.energy.items():
            by_node[node] = by_node.get(node, 0.0) + joules
        return by_node

    @property
    def energy_j(self) -> float | None:
        """The energy of every node's GPUs; None when no node reported one."""
        return sum(self.energy_by_node.values()) if self.energy else None
