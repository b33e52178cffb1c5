"""What every job backend is: the one interface the rest of gpunb.jobs talks to.

A backend is one class (`JobBackend`) that says what it needs and what it gives:

    in the kernel   check(root, settings)       what would fail remotely, before anything is written
                    tasks_and_gpus(config)      processes and GPUs per node the job asks for
                    submit(spec, settings, ...)  send the job; its id into `spec`
                    state(spec), cancel(spec)   the scheduler's answer; end the job (gpunb's own only)
    in the job      task()                      this task's place (rank, node, host, job id ...)
                    join_group(task)            torchrun's variables, for torch.distributed's env://
                    requeue(task)               back into the queue after a preemption signal
    its settings    settings, extra_table       what the cluster file's section, `slurm={...}` and the
                                                magic's flags may hold; check_settings refuses the rest

The states are Slurm's words (PENDING, RUNNING, COMPLETED, CANCELLED ...) for every backend; a
backend without a queue says RUNNING while its job lives and GONE after. LOST: the scheduler's id
no longer names this run's job, and nothing is sent to it.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass

from gpunb.errors import GpunbError

LOST = "LOST"  # the scheduler's id no longer names this run's job
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE", "FINISHED", "INTERRUPTED", "GONE", LOST)
CANCELLED_MARK = "cancelled"  # a file in the job folder: the job was cancelled from gpunb
OPTION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # sbatch's long options: `mail-type`, `cpus_per_task`
LINE_BREAKS = ("\n", "\r", "\0")  # would end the script's line (a NUL ends the text a scheduler reads)


@dataclass(frozen=True)
class Setting:
    """A setting a backend accepts: a key of its cluster-file section and of `slurm={...}`."""

    name: str
    help: str
    flag: bool = False  # also an option of %%gputrain (`--partition gpu`)


# What every backend accepts (the job folder, the interpreter, the price, the time limit ...).
COMMON_SETTINGS = (
    Setting("time", "a job's time limit: minutes or h:mm:ss", flag=True),
    Setting("job_dir", "where job folders go (a file system every node mounts)"),
    Setting("python", "the interpreter the job runs (e.g. a shared virtual environment's)"),
    Setting("gpu_hour_price", "a GPU-hour's price, for the result's cost"),
    Setting("signal_delay_s", "the warning before the time limit: checkpoint and requeue"),
    Setting("max_ship_mb", "fit's arguments above this, pickled, are refused"),
)


@dataclass(frozen=True)
class TaskEnvironment:
    """Where one task of a job stands, as its backend tells it."""

    rank: int  # in the job (every node's tasks)
    world_size: int
    local_rank: int  # on its node
    local_world_size: int
    node: int
    host: str
    job_id: str
    master_addr: str  # rank 0's host: the group meets there
    master_port: int

    def torchrun_variables(self) -> dict[str, str]:
        """What torchrun would set, for torch.distributed's env:// rendezvous."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


class JobBackend:
    """One engine that runs jobs; subclasses fill in the class attributes and the methods below."""

    name = ""  # the value of `cluster=`
    aliases: tuple = ()  # other values that choose it (`cluster="detach"`)
    what = ""  # one line for messages: what the backend runs jobs on
    title = ""  # its settings' name in messages ("Slurm setting(s) refused ...")
    script = "the job's script"  # what each setting becomes a line of
    option_names = "an option's name"  # how a key must be written, in check_settings' hint
    settings: tuple = COMMON_SETTINGS
    extra_table: str | None = None  # a table of any other settings, passed on as they are (Slurm's sbatch)
    switch: Setting | None = None  # a flag of its own that chooses it (`--detach`)
    several_nodes = False  # whether `nodes > 1` can run there
    on_this_machine = False  # its jobs run here: gpunb gives them their GPUs (a sweep's packing), no scheduler
    default_time_min = 7 * 24 * 60  # the time limit when none is set
    requeue_signals = (signal.SIGUSR1, signal.SIGUSR2)  # the scheduler's warning: checkpoint, then requeue
    reports_waiting = False  # a queued job has a state and reason worth asking for with no kernel following it
    cancelled_elsewhere = "cancelled: the job's controller was stopped"  # a cancel that did not come from gpunb

    # ------------------------------------------------------------------ in the kernel
    def check(self, root, settings: dict) -> None:
        """Refuse, with one message naming the fix, what would fail remotely (before anything is written)."""

    def tasks_and_gpus(self, config) -> tuple[int, int]:
        """(tasks per node, GPUs asked per node). The nodes are not this machine: only `gpus_per_node`
        or `accelerator="cuda"` asks for GPUs."""
        if config.gpus_per_node:
            return config.gpus_per_node, config.gpus_per_node
        tasks = config.devices if isinstance(config.devices, int) else 1
        return tasks, (tasks if config.accelerator == "cuda" else 0)

    def submit(self, spec, settings: dict, time_limit_min: float, entry) -> None:
        """Start the job: every task calls `entry()` (pickled by reference). Sets `spec.job_id` (and
        whatever else finds the job again); raises a GpunbError when the scheduler refuses it."""
        raise NotImplementedError

    def state(self, spec) -> tuple[str, str | None]:
        """(state, reason) of the job now (see the module's docstring)."""
        return ("SUBMITTING", None) if spec.job_id is None else self.ask(spec)

    def ask(self, spec) -> tuple[str, str | None]:
        """The scheduler's (state, reason) of the submitted job `spec`."""
        raise NotImplementedError

    def cancel(self, spec) -> str | None:
        """End the job at once (its newest checkpoint stays on disk); returns why nothing was sent
        when its id no longer names this job, else None."""
        return None if spec.job_id is None else self.end(spec)

    def end(self, spec) -> str | None:
        """End the submitted job `spec` (mark_cancelled first, once it is known to be this run's)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ in the job
    def task(self) -> TaskEnvironment:
        """This task's place, read from what the scheduler set in its environment."""
        raise NotImplementedError

    def join_group(self, task: TaskEnvironment) -> None:
        """Set torchrun's variables: the runtime then joins the group as it does under torchrun."""
        os.environ.update(task.torchrun_variables())

    def requeue(self, task: TaskEnvironment) -> None:
        """Put the job back in its queue (rank 0, after a preemption); may exit the process."""
        raise NotImplementedError

    # ------------------------------------------------------------------ settings
    def accepts(self) -> tuple:
        """The keys of its settings (and of its table of other settings)."""
        return tuple(s.name for s in self.settings) + ((self.extra_table,) if self.extra_table else ())

    def time_limit_min(self, settings: dict) -> float:
        """The `time` setting (Slurm's format: "90", "2:00:00", "1-12:00:00") in minutes."""
        given = settings.get("time")
        return self.default_time_min if given is None else minutes(given)

    def check_settings(self, given: dict, where: str) -> None:
        """Refuse, in one message naming them, settings that would not stay one line of the job's
        script: keys that are not option names, values with a line break, values of another kind."""
        bad = []
        for key, value in given.items():
            if key == self.extra_table and isinstance(value, dict):
                bad += [(f"{where}.{key}: {k!r} = {v!r}", why) for k, v in value.items() if (why := _problem(k, v))]
            elif why := _problem(key, value):
                bad.append((f"{where}: {key!r} = {value!r}", why))
        if bad:
            listed = "; ".join(f"{setting} ({why})" for setting, why in bad)
            raise GpunbError(f"{self.title} setting(s) refused before anything was written: {listed}. Each setting "
                             f"is a line of {self.script}, and a line break there would run the rest as a command.",
                             f"write each key as {self.option_names} (letters, digits, `-`, `_`: `mail-type`, "
                             "`cpus_per_task`) and each value on one line (`time = \"2:00:00\"`, `exclusive = true`); "
                             "`setup` takes a list of commands, one line each.")


def mark_cancelled(spec) -> None:
    """How a job that ended tells a cancel from gpunb from a crash or a cancel elsewhere."""
    (spec.path / CANCELLED_MARK).touch()


def ended_status(state: str) -> str | None:
    """The registry status of a job that `state` ended, or None while it has not ended."""
    if state == LOST:
        return "lost"
    if state.startswith("CANCELLED"):
        return "cancelled"
    return "failed" if state in ENDED else None


def minutes(given) -> float:
    """Slurm's time format ("90", "2:00:00", "1-12:00:00") as minutes."""
    text = str(given).strip()
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise GpunbError(f"time={given!r} is not a Slurm time limit.",
                         "write minutes (`90`), `hours:minutes:seconds` (`2:00:00`) or `days-hours:minutes:seconds`.")
    days, first, second, third = match.groups()
    if days is not None:  # d-hh[:mm[:ss]]
        return int(days) * 1440 + int(first) * 60 + int(second or 0) + int(third or 0) / 60
    if third is not None:  # hh:mm:ss
        return int(first) * 60 + int(second) + int(third) / 60
    if second is not None:  # mm:ss
        return int(first) + int(second) / 60
    return float(first)


def _problem(key, value) -> str | None:
    """Why `key = value` cannot be a line of the job's script, or None."""
    if not isinstance(key, str) or not OPTION_NAME.fullmatch(key):
        return "the key is not an option name"
    if key == "setup":
        lines = value if isinstance(value, (list, tuple)) else [None]
        if not all(isinstance(line, str) for line in lines):
            return "`setup` is a list of commands (strings)"
        return "a command holds a line break" if any(any(c in line for c in LINE_BREAKS) for line in lines) else None
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return None
    if not isinstance(value, str):
        return f"the value is {type(value).__name__}, not text, a number or true/false"
    return "the value holds a line break" if any(c in value for c in LINE_BREAKS) else None
