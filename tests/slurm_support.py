"""The Slurm cluster the tests run against: slurmctld, two slurmd "nodes" (n1, n2), slurmdbd
and MariaDB on this machine, started by `.ci/slurm/start` and stopped by `.ci/slurm/stop`.

`.ci/run` starts one before the suite and exports `GPUNB_TEST_SLURM` (its state directory);
outside CI the `slurm_cluster` fixture starts one itself when Slurm is installed and it runs
as root, and stops it at the end of the session. Where neither can be, the Slurm tests skip
and say why. The fixture sets SLURM_CONF in this process, so `sbatch`, submitit and kernels
started afterwards find the cluster:

    def test_cancel(slurm_cluster, tmp_path):
        job = slurm_cluster.executor(tmp_path, nodes=2).submit(time.sleep, 300)
        slurm_cluster.wait_for_state(job.job_id, "RUNNING")
        slurm_cluster.run(["scancel", job.job_id])
        slurm_cluster.wait_for_state(job.job_id, "CANCELLED")

The tests' directory is not on a job's sys.path: a function or class defined at the top of a
test module reaches a job only once that module is registered with
`cloudpickle.register_pickle_by_value`, as tests/test_slurm_cluster.py does.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / ".ci" / "slurm"

# submitit counts a preemption signal as a timeout when it comes within min(0.8 T, T - 10 min)
# of the job's start (T = timeout_min): over 10 minutes, a requeue test is a preemption.
DEFAULT_TIMEOUT_MIN = 30


@dataclass(frozen=True)
class SlurmCluster:
    """A running local cluster: `env` holds SLURM_CONF (already set in this process)."""

    state_dir: Path
    env: dict[str, str]
    partition: str
    nodes: tuple[str, ...] = ("n1", "n2")

    def run(self, cmd: str | list[str], timeout: float = 60, check: bool = True) -> str:
        """Runs a Slurm command (`"squeue -h"` or a list) against this cluster; its stdout.

        It runs in a scratch directory of the cluster's: an `sbatch` without `--output` or
        `--chdir` leaves its slurm-<id>.out there, not in the checkout.
        """
        args = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
        scratch = self.state_dir / "scratch"
        scratch.mkdir(exist_ok=True)
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False,
                              cwd=scratch, env={**os.environ, **self.env})
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def executor(self, folder: str | os.PathLike, **parameters):
        """A `submitit.AutoExecutor` for this cluster, its jobs run in `folder`.

        Defaults: this cluster's partition, one task on one node, one CPU, a 30-minute limit;
        `parameters` go to `update_parameters` (`nodes=2`, `tasks_per_node=2`, `slurm_...`).
        """
        import submitit

        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        executor.update_parameters(
            slurm_partition=self.partition, timeout_min=DEFAULT_TIMEOUT_MIN, nodes=1,
            tasks_per_node=1, cpus_per_task=1,
            # A job's working directory is its folder, not the checkout pytest runs in.
            slurm_additional_parameters={"chdir": str(folder)})
        executor.update_parameters(**parameters)
        return executor

    def state(self, job_id: str) -> str:
        """The job's state in Slurm's accounting (`sacct`), e.g. RUNNING, COMPLETED, CANCELLED."""
        lines = self.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", str(job_id)]).split()
        return lines[0].split()[0] if lines else "UNKNOWN"

    def wait_for_state(self, job_id: str, *states: str, timeout: float = 60) -> str:
        """Polls sacct until the job is in one of `states`; its state, or AssertionError."""
        deadline = time.monotonic() + timeout
        while (state := self.state(job_id)) not in states:
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} is {state} after {timeout} s, not {' or '.join(states)}")
            time.sleep(0.2)
        return state


def start(state_dir: Path, install: bool = False) -> dict[str, str]:
    """Starts a cluster in `state_dir` (`.ci/slurm/start`); the environment it prints.

    Raises RuntimeError with the script's own message when it cannot start.
    """
    args = [str(SCRIPTS / "start"), *([] if install else ["--no-install"]), str(state_dir)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr.strip() or f"{args[0]} failed ({done.returncode})")
    return parse_env(done.stdout)


def stop(state_dir: Path) -> None:
    """Stops the cluster in `state_dir`; RuntimeError if anything of it had to be killed."""
    done = subprocess.run([str(SCRIPTS / "stop"), str(state_dir)], capture_output=True, text=True,
                          timeout=120, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr.strip())


def parse_env(text: str) -> dict[str, str]:
    """`export NAME=value` lines (what start prints, and its etc/env) as a dict."""
    env = {}
    for line in text.splitlines():
        name, sep, value = line.removeprefix("export ").partition("=")
        if sep:
            env[name.strip()] = value.strip()
    return env


def cluster_from(env: dict[str, str]) -> SlurmCluster:
    return SlurmCluster(state_dir=Path(env["GPUNB_TEST_SLURM"]), env=env,
                        partition=env["GPUNB_TEST_SLURM_PARTITION"])


@contextlib.contextmanager
def session_cluster() -> Iterator[SlurmCluster]:
    """The cluster `.ci/run` started, or one started (and stopped) here; skips if neither."""
    if reason := os.environ.get("GPUNB_TEST_SLURM_SKIP"):
        pytest.skip(f"no Slurm cluster: {reason}")
    with pytest.MonkeyPatch.context() as patch:
        if state_dir := os.environ.get("GPUNB_TEST_SLURM"):
            env = parse_env((Path(state_dir) / "etc" / "env").read_text())
            for name, value in env.items():
                patch.setenv(name, value)
            yield cluster_from(env)
            return
        if os.geteuid() != 0:
            pytest.skip("no Slurm cluster: GPUNB_TEST_SLURM is not set, and starting one "
                        "(.ci/slurm/start) needs root")
        # A short path: munged's and MariaDB's sockets live in it (at most 107 bytes).
        state_dir = Path(tempfile.mkdtemp(prefix="gpunb-slurm-"))
        try:
            env = start(state_dir)
        except RuntimeError as error:
            shutil.rmtree(state_dir, ignore_errors=True)
            pytest.skip(f"no Slurm cluster: {error}")
        try:
            for name, value in env.items():
                patch.setenv(name, value)
            yield cluster_from(env)
        finally:
            stop(state_dir)
            shutil.rmtree(state_dir, ignore_errors=True)
