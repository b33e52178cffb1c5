"""A Slurm job (`cluster="slurm"`), through submitit's Slurm executor: one task per GPU, on `nodes` nodes.

A Slurm job is named after its folder (the run's name and the start of its id), and gpunb
acts on a Slurm id only while Slurm still gives it that name and this user: Slurm reuses
ids, and a registry row can outlive what Slurm remembers of its job. An id that names
another job, or that Slurm no longer knows, is LOST, and nothing is sent to it.
"""

from __future__ import annotations

import os
import subprocess

from gpunb.errors import GpunbError
from gpunb.jobs.backends.base import COMMON_SETTINGS, ENDED, LOST, Setting, mark_cancelled
from gpunb.jobs.backends.via_submitit import SubmititBackend

# The settings that are sbatch options of their own (and flags of %%gputrain).
SBATCH_SETTINGS = (
    Setting("partition", "Slurm partition", flag=True),
    Setting("account", "Slurm account", flag=True),
    Setting("qos", "Slurm QOS", flag=True),
    Setting("constraint", "Slurm node features (--constraint)", flag=True),
)
# sbatch settings submitit takes by name (it checks and converts them); any other becomes a line
# `#SBATCH --key=value` as it is (submitit's additional_parameters)
BY_NAME = {s.name for s in SBATCH_SETTINGS} | {
    "comment", "mem", "mem_per_gpu", "cpus_per_task", "cpus_per_gpu", "exclusive", "nodelist", "exclude", "gres",
    "mail_type", "mail_user", "wckey", "dependency", "setup"}
UNREACHABLE = ("configuration source", "Unable to contact", "Zero Bytes were transmitted", "Connection refused")
SLURM_CANCEL = "cancelled by Slurm (scancel, or an administrator)"  # a cancel that did not come from gpunb


class SlurmBackend(SubmititBackend):
    name = "slurm"
    what = "a Slurm job (settings from the cluster file and `slurm={...}`)"
    title = "Slurm"
    script = "the job's sbatch script"
    option_names = "sbatch's option name"
    settings = COMMON_SETTINGS + SBATCH_SETTINGS + (
        Setting("shared_fs", "true: the job folder is shared with the nodes in a way gpunb cannot see"),)
    extra_table = "sbatch"  # any other sbatch setting
    several_nodes = True
    default_time_min = 24 * 60
    reports_waiting = True
    cancelled_elsewhere = SLURM_CANCEL

    def check(self, root, settings: dict) -> None:
        from gpunb.jobs import checks

        checks.check_slurm()  # first: an unreachable Slurm explains every later failure
        checks.check_shared(root, settings)

    def executor(self, spec, settings: dict, time_limit_min: float):
        import submitit

        chosen = submitit.SlurmExecutor(spec.submitit_dir, python=settings.get("python"))
        parameters = {"nodes": spec.nodes, "ntasks_per_node": spec.tasks_per_node, "time": int(time_limit_min),
                      "signal_delay_s": int(settings.get("signal_delay_s", 90)), "job_name": job_name(spec),
                      "stderr_to_stdout": True}
        if spec.gpus_per_node:
            parameters["gpus_per_node"] = spec.gpus_per_node
        parameters.update({s.name: settings[s.name] for s in SBATCH_SETTINGS if s.name in settings})
        extra = {}
        for key, value in dict(settings.get("sbatch") or {}).items():
            name = key.replace("-", "_")
            if name in BY_NAME:
                parameters[name] = value
            else:
                extra[name] = value
        if extra:
            parameters["additional_parameters"] = extra
        chosen.update_parameters(**parameters)
        return chosen

    def refused(self, error: Exception) -> GpunbError:
        """sbatch's refusal, each of its lines once, under the hint that fits it."""
        from gpunb.jobs import checks, clusters

        said = []
        for line in str(error).splitlines():
            line = checks.slurm_error(line)
            if line and line not in said:
                said.append(line)
        text = "; ".join(said) or type(error).__name__
        if any(sign in text for sign in UNREACHABLE):
            return GpunbError(f"The job could not be submitted: Slurm does not answer here (`sbatch`: {text}).",
                              checks.NO_SLURM_HINT)
        return GpunbError(f"The job could not be submitted: {text}",
                          "check the Slurm settings (partition, account, time) in the run's options and in "
                          f"{clusters.path()}; `sbatch --test-only` with them says what Slurm refuses.")

    def ask(self, spec) -> tuple[str, str | None]:
        return slurm_state(spec.job_id, job_name(spec))

    def end(self, spec) -> str | None:
        """scancel, once the id is confirmed to name this job, told the job's name and user too."""
        state, reason = self.state(spec)
        if state == LOST:
            return reason
        mark_cancelled(spec)
        _ask(["scancel", f"--name={job_name(spec)}", f"--user={os.getuid()}", str(spec.job_id)])
        return None


def job_name(spec) -> str:
    """The Slurm job's name: its folder's (the run's name and the start of its id); a job
    submitted before job.json recorded it was named after the run."""
    return spec.job_name or spec.name


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


def _ask(command: list) -> subprocess.CompletedProcess:
    """A Slurm command's answer; one that cannot run or does not answer in 30 s as a failure."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return subprocess.CompletedProcess(command, 1, "", str(error))
