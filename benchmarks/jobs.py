"""A run as a job: how long until its first step, how far the dashboard lags, what the events file costs.

    python benchmarks/jobs.py                 # in-kernel and --detach; Slurm too where `sinfo` answers
    python benchmarks/jobs.py --rounds 5

start       the time from the fit call to the job's first optimizer step (the step's event line's
            timestamp), for an in-kernel fit, a detached job (submitit's local executor) and a
            local Slurm job; beside it the bare cost of a new process importing torch and gpunb
            (`python -c "import torch, gpunb.runtime.loop"`), which any job pays. Goal: a job's start
            within 3 s beyond that.
lag         for every log row of a detached run: the time the kernel's callback got it minus the
            time the job wrote it (the line's timestamp; same machine, same clock). Goal: <= 2 s.
events      the per-step cost of the events file in the job: the same small fit in one process
            with and without rank 0's relay writing it (RelayWriter over an EventsChannel) (log_every=10, so it writes a log line every
            10 steps and a progress line at most every 0.25 s), median step time, and the callback's
            own time per step measured directly. Goal: <= 1 %.

The model is small (an MLP on 64 features, batch 64) so that start-up, not training, dominates.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

from gpunb import Trainer


def data(n=2048):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, generator=g)
    return x, (x @ torch.randn(64, 10, generator=g)).argmax(1)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


class FirstStep:
    def __init__(self):
        self.at = None

    def on_step_end(self, state):
        if self.at is None:
            self.at = time.time()


class Arrivals:
    """step -> when the kernel's callback got the log row."""

    def __init__(self):
        self.rows = {}

    def on_log(self, state, row):
        self.rows[row["step"]] = time.time()


def events_of(folder):
    with open(os.path.join(folder, "events.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def import_cost() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, gpunb.runtime.loop"], check=True)
    return time.perf_counter() - start


def start_times(cluster: str | None, **extra) -> tuple[float, dict]:
    """Seconds from the call to the first step, and (for a job) the arrivals and the folder."""
    settings = dict(accelerator="cpu", batch_size=64, max_steps=200, log_every=10, name=f"bench-{cluster}",
                    resubmit=True, **extra)
    first, arrivals = FirstStep(), Arrivals()
    start = time.time()
    if cluster is None:
        Trainer(**settings, track=False).fit(model(), data(), loss_fn=nn.CrossEntropyLoss(), callbacks=[first])
        return first.at - start, {}
    result = Trainer(**settings, cluster=cluster).fit(model(), data(), loss_fn=nn.CrossEntropyLoss(),
                                                      callbacks=[arrivals])
    lines = events_of(result.job["folder"])
    step_at = next(line["t"] for line in lines if line["event"] in ("on_step_end", "on_log"))
    written = {line["args"][0]["step"]: line["t"] for line in lines if line["event"] == "on_log"}
    lags = [arrivals.rows[step] - t for step, t in written.items() if step in arrivals.rows]
    return step_at - start, {"lags": lags}


def events_cost(steps=600) -> tuple[float, float, float]:
    """(median step ms without, with the events file, the callback's own µs per step)."""
    class StepClock:
        def __init__(self):
            self.times, self.last = [], None

        def on_step_end(self, state):
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now

    medians = {False: [], True: []}
    folder = tempfile.mkdtemp(prefix="gpunb-bench-events-")
    try:
        for _ in range(3):
            for with_events in (False, True):
                clock = StepClock()
                callbacks = [clock] + ([events_writer(os.path.join(folder, "events.jsonl"))] if with_events else [])
                Trainer(accelerator="cpu", batch_size=64, max_steps=steps, log_every=10, track=False).fit(
                    model(), data(), loss_fn=nn.CrossEntropyLoss(), callbacks=callbacks)
                medians[with_events].append(statistics.median(clock.times[50:]))
        own = _callback_cost(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 1e3 * statistics.median(medians[False]), 1e3 * statistics.median(medians[True]), own


def events_writer(path):
    """Rank 0's relay over the job's events file, as a job's entry builds it."""
    from gpunb.distributed.relay import RelayWriter
    from gpunb.jobs.events import EventsChannel

    return RelayWriter(EventsChannel(path))


def _callback_cost(folder, steps=20_000) -> float:
    """The events file writer's time per step on its own: on_step_end every step, on_log every 10."""
    from gpunb.config import TrainConfig
    from gpunb.runtime.events import FitState

    state = FitState(config=TrainConfig(batch_size=64, precision="32"), model=None, optimizer=None,
                     device=torch.device("cpu"), total_steps=steps)
    writer = events_writer(os.path.join(folder, "cost.jsonl"))
    writer.on_fit_start(state)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        state.step = step
        if step % 10 == 0:
            row = {"step": step, "epoch": 0, "loss": 1.0 / step, "lr": 1e-3, "samples_per_s": 1e4}
            state.history.append(row)
            writer.on_log(state, row)
        writer.on_step_end(state)
    elapsed = time.perf_counter() - start
    writer.on_fit_end(state)
    return 1e6 * elapsed / steps


def slurm_answers() -> bool:
    return shutil.which("sinfo") is not None and subprocess.run(["sinfo"], capture_output=True).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--partition", help="Slurm partition (default: the cluster's default)")
    args = parser.parse_args()
    os.environ.setdefault("GPUNB_HOME", tempfile.mkdtemp(prefix="gpunb-bench-"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}")
    clusters = [None, "local"] + (["slurm"] if slurm_answers() else [])
    found = {cluster: [] for cluster in clusters}
    lags = []
    imports = []
    for _ in range(args.rounds):
        imports.append(import_cost())
        for cluster in clusters:
            extra = {"slurm": {"time": "30", **({"partition": args.partition} if args.partition else {})}} \
                if cluster == "slurm" else {}
            seconds, more = start_times(cluster, **extra)
            found[cluster].append(seconds)
            lags += more.get("lags", []) if cluster == "local" else []
    print(f"new process, import torch + gpunb: median {statistics.median(imports):.2f} s  ({_list(imports)})")
    for cluster, seconds in found.items():
        label = {None: "in the kernel", "local": "--detach (local job)", "slurm": "--cluster slurm (local)"}[cluster]
        print(f"call -> first step, {label}: median {statistics.median(seconds):.2f} s  ({_list(seconds)})")
    lags.sort()
    print(f"dashboard lag behind the job's log rows (--detach, {len(lags)} rows): median "
          f"{statistics.median(lags):.3f} s, 95th percentile {lags[int(0.95 * (len(lags) - 1))]:.3f} s, "
          f"max {lags[-1]:.3f} s")
    without, with_events, own = events_cost()
    print(f"events file per step: median step {without:.3f} ms without, {with_events:.3f} ms with "
          f"({100 * (with_events / without - 1):+.1f} %); the callback's own time {own:.2f} us a step "
          f"({100 * own / 1e3 / without:.2f} % of a step)")


def _list(values) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":
    main()
