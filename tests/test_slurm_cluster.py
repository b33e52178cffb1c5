"""The local Slurm cluster of .ci/slurm, through submitit as gpunb's jobs use it: results come
back, two nodes form one job, cancellation and requeue are seen, and stop leaves nothing."""

import shutil
import tempfile
import time
from pathlib import Path

import pytest
import slurm_support
from slurm_jobs import Preemptible, sleep_then_say_how_often_started, where_am_i

pytestmark = pytest.mark.slurm


def running(cluster, job, timeout=60):
    cluster.wait_for_state(job.job_id, "RUNNING", timeout=timeout)
    return job


def wait_for_file(path: Path, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.1)


def test_a_one_task_job_returns_its_result_in_its_folder(slurm_cluster, tmp_path):
    job = slurm_cluster.executor(tmp_path).submit(where_am_i)
    assert job.result() == (0, job.get_info(mode="force")["NodeList"], str(tmp_path))
    # Accounting works; the result comes a moment before the job's end reaches sacct.
    slurm_cluster.wait_for_state(job.job_id, "COMPLETED", timeout=30)
    assert job.get_info(mode="force")["State"] == "COMPLETED"  # what submitit reads


def test_a_two_node_job_runs_one_task_on_each_node(slurm_cluster, tmp_path):
    job = slurm_cluster.executor(tmp_path, nodes=2, tasks_per_node=1).submit(where_am_i)
    results = job.results()
    assert [(rank, node) for rank, node, _ in results] == [(0, "n1"), (1, "n2")]
    # each task reported its own node above; sacct's NodeList is not asserted: on this one-host
    # cluster it reads "n1" or "n[1-2]" from run to run
    slurm_cluster.wait_for_state(job.job_id, "COMPLETED", timeout=30)


def test_a_plain_sbatch_writes_its_output_beside_the_cluster_not_in_the_checkout(slurm_cluster):
    job_id = slurm_cluster.run(["sbatch", "--parsable", "--wrap", "echo hello from $SLURM_JOB_ID"]).strip()
    slurm_cluster.wait_for_state(job_id, "COMPLETED", timeout=30)
    output = slurm_cluster.state_dir / "scratch" / f"slurm-{job_id}.out"
    assert output.read_text() == f"hello from {job_id}\n"


def test_a_cancelled_job_is_reported_cancelled(slurm_cluster, tmp_path):
    job = running(slurm_cluster, slurm_cluster.executor(tmp_path).submit(time.sleep, 300))
    slurm_cluster.run(["scancel", job.job_id])
    slurm_cluster.wait_for_state(job.job_id, "CANCELLED", timeout=30)
    assert job.get_info(mode="force")["State"].startswith("CANCELLED")
    assert job.done()  # submitit sees it end although it wrote no result (a wait() returns)


def test_scontrol_requeue_runs_the_job_again_to_its_end(slurm_cluster, tmp_path):
    marker = str(tmp_path / "starts")
    job = slurm_cluster.executor(tmp_path).submit(sleep_then_say_how_often_started, marker, 300)
    running(slurm_cluster, job)
    slurm_cluster.run(["scontrol", "requeue", job.job_id])
    # Within a minute: with Slurm's defaults (credentials live 120 s) it takes over two.
    slurm_cluster.wait_for_state(job.job_id, "COMPLETED", timeout=60)
    assert job.result() == 2


def test_a_preempted_checkpointable_job_is_requeued_and_finishes(slurm_cluster, tmp_path):
    job = slurm_cluster.executor(tmp_path).submit(Preemptible(str(tmp_path / "started")))
    wait_for_file(tmp_path / "started")  # the job runs, submitit's signal handler in place
    job._interrupt()  # what Slurm does to a preempted job: SIGTERM, then submitit's USR2
    slurm_cluster.wait_for_state(job.job_id, "COMPLETED", timeout=60)
    assert job.result() == "resumed"
    assert "preempted" in job.stderr()


def test_stop_ends_every_daemon_and_job_process(slurm_cluster, tmp_path, request):
    """A second cluster beside the session's: its stop, with a job running, leaves nothing."""
    state_dir = Path(tempfile.mkdtemp(prefix="gpunb-slurm-"))  # munged wants /tmp/pytest-of-root/ open
    request.addfinalizer(lambda: shutil.rmtree(state_dir, ignore_errors=True))
    request.addfinalizer(lambda: slurm_support.stop(state_dir))
    other = slurm_support.cluster_from(slurm_support.start(state_dir))
    pids = {path.stem: int(path.read_text()) for path in (state_dir / "pids").glob("*.pid")}
    assert set(pids) == {"mariadbd", "munged", "slurmdbd", "slurmctld", "slurmd-n1", "slurmd-n2"}
    job_pid = tmp_path / "job.pid"
    job_id = other.run(["sbatch", "--parsable", f"--chdir={tmp_path}", "--output=/dev/null",
                        "--wrap", f"echo $$ > {job_pid}; exec sleep 300"]).strip()
    other.wait_for_state(job_id, "RUNNING")
    wait_for_file(job_pid)
    while not job_pid.read_text().strip():
        time.sleep(0.1)
    pids["job"] = int(job_pid.read_text())

    slurm_support.stop(state_dir)  # raises if the script had to kill anything it found left
    assert [name for name, pid in pids.items() if _running(pid)] == []
    assert slurm_cluster.run("sinfo -h -N -o %N").split() == ["n1", "n2"]  # the session's is up


def _running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status
