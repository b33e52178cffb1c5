"""The schedulers a job runs on, through submitit: its local executor and Slurm.

    executor(spec, settings, timeout_min)   a submitit executor for the spec's cluster
    job_state(spec)                         (state, reason): PENDING/RUNNING/... and Slurm's reason
    cancel(spec)                            end the job now (scancel; local: the controller)

A Slurm job is named after its folder (the run's name and the start of its id), and gpunb
acts on a Slurm id only while Slurm still gives it that name and this user: Slurm reuses
ids, and a registry row can outlive what Slurm remembers of its job. An id that names
another job, or that Slurm no longer knows, is LOST, and nothing is sent to it.

The local executor's controller is started in a session of its own: the kernel's
interrupt button signals the kernel's whole process group, and a detached job must not
hear it (its stop goes through the stop file), nor die with the kernel. It answers the SIGINT
`cancel` sends it even when the kernel or script that submitted it ignores SIGINT (started in
the background, or under `nohup`), which a child would otherwise inherit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

LOST = "LOST"  # the Slurm id no longer names this run's job (see the module's docstring)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE", "FINISHED", "INTERRUPTED", "GONE", LOST)
SLURM_PARAMETERS = ("partition", "account", "qos", "constraint", "comment", "mem", "mem_per_gpu",
                    "cpus_per_task", "cpus_per_gpu", "exclusive", "nodelist", "exclude", "gres",
                    "mail_type", "mail_user", "wckey", "dependency", "setup")
CANCELLED_MARK = "cancelled"  # a file in the job folder: the job was cancelled from gpunb
DEFAULT_TIMEOUT_MIN = 7 * 24 * 60  # a local job's limit when none is given (submitit's own is 2 minutes)


def executor(spec, settings: dict, timeout_min: float):
    """The submitit executor that runs `spec` (its folder is the job's submitit/ folder)."""
    import submitit

    folder = spec.submitit_dir
    if spec.cluster == "local":
        chosen = _DetachedLocalExecutor(folder, python=settings.get("python"))
        chosen.update_parameters(timeout_min=timeout_min, tasks_per_node=spec.tasks_per_node,
                                 gpus_per_node=spec.gpus_per_node, signal_delay_s=int(settings.get("signal_delay_s", 30)))
        return chosen
    chosen = submitit.SlurmExecutor(folder, python=settings.get("python"))
    parameters = {"nodes": spec.nodes, "ntasks_per_node": spec.tasks_per_node, "time": int(timeout_min),
                  "signal_delay_s": int(settings.get("signal_delay_s", 90)), "job_name": job_name(spec),
                  "stderr_to_stdout": True}
    if spec.gpus_per_node:
        parameters["gpus_per_node"] = spec.gpus_per_node
    extra = {}
    for key, value in settings.items():
        if key in SLURM_PARAMETERS:
            parameters[key] = value
    for key, value in dict(settings.get("sbatch") or {}).items():
        name = key.replace("-", "_")
        if name in SLURM_PARAMETERS:
            parameters[name] = value
        else:
            extra[name] = value
    if extra:
        parameters["additional_parameters"] = extra
    chosen.update_parameters(**parameters)
    return chosen


# submitit's local controller (`python -m submitit.local._local FOLDER`), answering SIGINT as Python
# does by default: it ends its tasks when `cancel` signals it
_CONTROLLER = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "runpy.run_module('submitit.local._local', run_name='__main__')")


def _DetachedLocalExecutor(folder, python=None):
    from submitit.local import local

    class DetachedLocalExecutor(local.LocalExecutor):
        """submitit's LocalExecutor with its controller in a new session (see the module's docstring)."""

        def _submit_command(self, command: str):
            tasks = self.parameters.get("tasks_per_node", 1)
            gpus = self.parameters.get("gpus_per_node", 0)
            environment = dict(os.environ, SUBMITIT_LOCAL_NTASKS=str(tasks), SUBMITIT_LOCAL_COMMAND=command,
                               SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * self.parameters.get("timeout_min", 2.0))),
                               SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(self.parameters.get("signal_delay_s", 30))),
                               SUBMITIT_LOCAL_NODEID="0", SUBMITIT_LOCAL_JOB_NUM_NODES="1",
                               SUBMITIT_STDERR_TO_STDOUT="1", SUBMITIT_EXECUTOR="local",
                               SUBMITIT_LOCAL_WITH_SHELL="")
            if gpus:
                environment["CUDA_VISIBLE_DEVICES"] = ",".join(str(k) for k in range(gpus))
            process = subprocess.Popen([sys.executable, "-c", _CONTROLLER, str(self.folder)],
                                       env=environment, start_new_session=True)
            return local.LocalJob(folder=self.folder, job_id=str(process.pid), process=process,
                                  tasks=list(range(tasks)))

    return DetachedLocalExecutor(folder, python=python)


def job_name(spec) -> str:
    """The Slurm job's name: its folder's (the run's name and the start of its id); a job
    submitted before job.json recorded it was named after the run."""
    return spec.job_name or spec.name


def job_state(spec) -> tuple[str, str | None]:
    """(state, reason) of the job now: Slurm's PENDING/RUNNING/COMPLETED/CANCELLED... with
    its reason while pending, or LOST with why; a local job is RUNNING while its controller
    lives, else GONE."""
    if spec.job_id is None:
        return "SUBMITTING", None
    if spec.cluster == "local":
        return ("RUNNING" if _local_alive(spec) else "GONE"), None
    return slurm_state(spec.job_id, job_name(spec))


def slurm_state(job_id: str, name: str) -> tuple[str, str | None]:
    """(state, reason) of the Slurm job `job_id` named `name`: squeue's while Slurm holds it,
    then sacct's; (LOST, why) when the id names another job or Slurm no longer knows it;
    UNKNOWN when Slurm does not answer."""
    queued = _ask(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r|%j|%U"])
    if queued.returncode == 0 and queued.stdout.strip():
        state, reason, *owner = queued.stdout.strip().splitlines()[0].split("|")
        reason = reason.strip() if reason.strip() not in ("", "None") else None
        return _owned(job_id, name, owner) or (state.strip(), reason)
    accounted = _ask(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State,JobName,UID"])
    if accounted.returncode == 0 and accounted.stdout.strip():
        state, *owner = accounted.stdout.strip().splitlines()[0].split("|")
        state = state.split()[0].strip()  # "CANCELLED by 0" -> CANCELLED
        # Until a job starts, sacct may call it "allocation": its name is judged once it has ended.
        return (state in ENDED and _owned(job_id, name, owner)) or (state, None)
    if "Invalid job id" in queued.stderr and accounted.returncode == 0:
        return LOST, f"Slurm no longer knows job {job_id}"
    return "UNKNOWN", None


def _owned(job_id: str, name: str, owner: list) -> tuple[str, str] | None:
    """None when Slurm's job `job_id` has this name and this user's id, else (LOST, why)."""
    found_name, found_uid = (part.strip() for part in (owner + ["", ""])[:2])
    if (found_name, found_uid) == (name, str(os.getuid())):
        return None
    return LOST, f"Slurm's job {job_id} is now {found_name!r} of user {found_uid or '?'}, not this run's {name!r}"


def ended_status(state: str) -> str | None:
    """The registry status of a job that Slurm's `state` ended, or None while it has not ended."""
    if state == LOST:
        return "lost"
    if state.startswith("CANCELLED"):
        return "cancelled"
    return "failed" if state in ENDED else None


def cancel(spec) -> str | None:
    """End the job at once (its newest checkpoint stays on disk). A Slurm id is confirmed to name
    this job first, and scancel itself is told the job's name and user; returns why nothing was
    sent when the id is LOST, else None."""
    if spec.job_id is None:
        return None
    if spec.cluster == "local":
        (spec.path / CANCELLED_MARK).touch()  # how a local job that ended tells a cancel from a crash
        _end_local(spec)
        return None
    state, reason = job_state(spec)
    if state == LOST:
        return reason
    (spec.path / CANCELLED_MARK).touch()
    _run(["scancel", f"--name={job_name(spec)}", f"--user={os.getuid()}", str(spec.job_id)])
    return None


def _end_local(spec, tries: int = 3, wait_s: float = 3.0) -> None:
    """SIGINT to the controller, which stops its tasks (SIGINT, then SIGKILL after 1 s). A
    controller still starting ignores SIGINT when its submitter did (the background, nohup), so
    one still alive `wait_s` later (its tasks would be gone by then) is sent it again, and after
    `tries`, SIGKILL goes to its whole session, tasks included."""
    import time

    for _ in range(tries):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(spec.job_id), signal.SIGINT)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _local_alive(spec):
                return
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(int(spec.job_id), signal.SIGKILL)  # the controller leads its session's process group


def _local_alive(spec) -> bool:
    import psutil

    try:
        process = psutil.Process(int(spec.job_id))
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE and \
            abs(process.create_time() - spec.job_started) < 1.0
    except (psutil.Error, ValueError, TypeError):
        return False


def _run(command: list) -> str:
    done = _ask(command)
    return done.stdout.strip() if done.returncode == 0 else ""


def _ask(command: list) -> subprocess.CompletedProcess:
    """A Slurm command's answer; one that cannot run or does not answer in 30 s as a failure."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return subprocess.CompletedProcess(command, 1, "", str(error))
