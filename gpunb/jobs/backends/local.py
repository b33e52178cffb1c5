"""A detached job on this machine (`cluster="local"`, `--detach`), through submitit's local executor.

Its controller is started in a session of its own: the kernel's interrupt button signals the
kernel's whole process group, and a detached job must not hear it (its stop goes through the stop
file), nor die with the kernel. It answers the SIGINT `cancel` sends it even when the kernel or
script that submitted it ignores SIGINT (started in the background, or under `nohup`), which a
child would otherwise inherit. The job's id is the controller's pid, with its start time (a pid
alone may be reused): the job is RUNNING while that process lives, else GONE.

Its GPUs are the kernel's: the first of those the kernel's own CUDA_VISIBLE_DEVICES names (a
kernel started on GPUs 2 and 3 sends its job there, not to GPUs 0 and 1, which may be another
user's), unless a sweep's packing chose others among them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from gpunb.errors import GpunbError
from gpunb.jobs.backends.base import Setting, mark_cancelled
from gpunb.jobs.backends.via_submitit import SubmititBackend

# submitit's local controller (`python -m submitit.local._local FOLDER`), answering SIGINT as Python
# does by default: it ends its tasks when `cancel` signals it
_CONTROLLER = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "runpy.run_module('submitit.local._local', run_name='__main__')")


class LocalBackend(SubmititBackend):
    name = "local"
    on_this_machine = True
    aliases = ("detach",)
    what = "a detached job on this machine, which outlives the kernel"
    title = "Local job"
    switch = Setting("detach", "train in a job of its own on this machine, which outlives the kernel")

    def tasks_and_gpus(self, config) -> tuple[int, int]:
        """The job runs on this machine, so `accelerator="auto"` is decided here as a run in the kernel
        would decide it: with GPUs visible, each task gets one (submitit's local executor hides the
        GPUs it was not asked for)."""
        if config.gpus_per_node:
            _check_visible(config.gpus_per_node)
            return config.gpus_per_node, config.gpus_per_node
        import torch

        from gpunb.distributed.launch import plan_devices

        accelerator, tasks, _ = plan_devices(config)
        # gloo may put more tasks than GPUs on this machine: they share the visible ones
        return tasks, (min(tasks, torch.cuda.device_count()) if accelerator == "cuda" else 0)

    def executor(self, spec, settings: dict, time_limit_min: float):
        chosen = _DetachedLocalExecutor(spec.submitit_dir, python=settings.get("python"), visible=spec.visible_devices)
        chosen.update_parameters(timeout_min=time_limit_min, tasks_per_node=spec.tasks_per_node,
                                 gpus_per_node=spec.gpus_per_node,
                                 signal_delay_s=int(settings.get("signal_delay_s", 30)))
        return chosen

    def submitted(self, spec, job) -> None:
        import psutil

        spec.job_id, spec.job_started = str(job.job_id), psutil.Process(int(job.job_id)).create_time()

    def ask(self, spec) -> tuple[str, str | None]:
        return ("RUNNING" if _alive(spec) else "GONE"), None

    def end(self, spec) -> str | None:
        mark_cancelled(spec)
        end_controller(spec)
        return None

    def join_group(self, task) -> None:
        from gpunb.distributed.loopback import keep_sockets_on_loopback

        super().join_group(task)
        keep_sockets_on_loopback()  # every task is on this machine: nothing listens beyond it


def _DetachedLocalExecutor(folder, python=None, visible=None):
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
            if visible is not None:  # the GPUs a sweep's packing gave this trial
                environment["CUDA_VISIBLE_DEVICES"] = visible
            elif gpus:
                environment["CUDA_VISIBLE_DEVICES"] = first_gpus(gpus)
            process = subprocess.Popen([sys.executable, "-c", _CONTROLLER, str(self.folder)],
                                       env=environment, start_new_session=True)
            return local.LocalJob(folder=self.folder, job_id=str(process.pid), process=process,
                                  tasks=list(range(tasks)))

    return DetachedLocalExecutor(folder, python=python)


def end_controller(spec, tries: int = 3, wait_s: float = 3.0) -> None:
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
            if not _alive(spec):
                return
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(int(spec.job_id), signal.SIGKILL)  # the controller leads its session's process group


def _alive(spec) -> bool:
    import psutil

    try:
        process = psutil.Process(int(spec.job_id))
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE and \
            abs(process.create_time() - spec.job_started) < 1.0
    except (psutil.Error, ValueError, TypeError):
        return False


def first_gpus(gpus: int) -> str:
    """CUDA_VISIBLE_DEVICES for a job of `gpus` GPUs: the first `gpus` of those this process may use,
    named as its own CUDA_VISIBLE_DEVICES names them (indices, UUIDs or MIG ids), else 0 to gpus - 1."""
    named = named_visible()
    return ",".join(named[:gpus] if named is not None else (str(index) for index in range(gpus)))


def named_visible() -> list[str] | None:
    """The entries of this process's CUDA_VISIBLE_DEVICES; None when it is unset (every GPU is visible)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [entry.strip() for entry in value.split(",") if entry.strip()]


def _check_visible(gpus: int) -> None:
    named = named_visible()
    if named is not None and len(named) < gpus:
        raise GpunbError(f"The job asks for {gpus} GPUs per node, and this kernel may use {len(named)} "
                         f"(CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}): a job on this machine "
                         "runs on the kernel's GPUs.",
                         f"ask for at most {len(named)} (`--gpus-per-node {len(named)}`), or start the kernel "
                         "with more GPUs in CUDA_VISIBLE_DEVICES.")
