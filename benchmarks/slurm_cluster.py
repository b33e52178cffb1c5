"""What the tests' local Slurm cluster (.ci/slurm) costs: starting and stopping it, and the
round trips of the jobs the Slurm tests submit through submitit.

    start             `.ci/slurm/start` into a new directory, Slurm installed (its phases below)
    stop              `.ci/slurm/stop` with the cluster idle
    1 task            submit -> result of a one-task job (`pow(2, 10)`)
    2 nodes           submit -> results of a 2-node job, one task on each
    requeue           `scontrol requeue` of a running job -> it runs again (-> its result)
    preempt           submitit's preemption (SIGTERM, then USR2) of a Checkpointable -> its
                      result, the requeued job having run again

Needs root and Debian's slurm-wlm, slurmdbd, munge and mariadb-server (`.ci/slurm/start`
installs them; what the install took is noted in benchmarks/RESULTS.md).

    python benchmarks/slurm_cluster.py            # 3 rounds, each on a fresh cluster
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import slurm_support
from slurm_jobs import Preemptible, sleep_then_say_how_often_started


def timed(function, *args):
    begin = time.perf_counter()
    value = function(*args)
    return time.perf_counter() - begin, value


def one_round(folder: Path) -> dict[str, float]:
    state_dir = Path(tempfile.mkdtemp(prefix="gpunb-slurm-"))
    begin = time.perf_counter()
    done = subprocess.run([str(slurm_support.SCRIPTS / "start"), "--no-install", str(state_dir)],
                          capture_output=True, text=True, check=True)
    times = {"start": time.perf_counter() - begin}
    for phase, seconds in re.findall(r"([\w-]+) ([\d.]+) s", done.stderr.split("(")[1].split(")")[0]):
        times[f"  {phase}"] = float(seconds)
    cluster = slurm_support.cluster_from(slurm_support.parse_env(done.stdout))
    os.environ.update(cluster.env)  # submitit's sbatch and sacct find the cluster by SLURM_CONF
    try:
        executor = cluster.executor(folder)
        times["1 task"], _ = timed(lambda: executor.submit(pow, 2, 10).result())
        two = cluster.executor(folder, nodes=2, tasks_per_node=1)
        times["2 nodes"], _ = timed(lambda: two.submit(pow, 2, 10).results())

        job = executor.submit(sleep_then_say_how_often_started, str(folder / f"starts-{time.time()}"), 300)
        cluster.wait_for_state(job.job_id, "RUNNING")
        begin = time.perf_counter()
        cluster.run(["scontrol", "requeue", job.job_id])
        cluster.wait_for_state(job.job_id, "REQUEUED", "PENDING")  # sacct said RUNNING a moment longer
        cluster.wait_for_state(job.job_id, "RUNNING")
        times["requeue -> running"] = time.perf_counter() - begin
        assert job.result() == 2
        times["requeue -> result"] = time.perf_counter() - begin

        marker = folder / f"started-{time.time()}"
        job = executor.submit(Preemptible(str(marker)))
        while not marker.exists():
            time.sleep(0.1)
        begin = time.perf_counter()
        job._interrupt()
        assert job.result() == "resumed"
        times["preempt -> result"] = time.perf_counter() - begin
    finally:
        begin = time.perf_counter()
        slurm_support.stop(state_dir)
        times["stop"] = time.perf_counter() - begin
        shutil.rmtree(state_dir, ignore_errors=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory() as folder:
        results = [one_round(Path(folder) / str(n)) for n in range(rounds)]
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"{rounds} rounds, load {load}; median (min-max) seconds")
    for name in results[0]:
        values = [r[name] for r in results]
        print(f"{name:22} {statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
