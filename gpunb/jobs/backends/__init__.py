"""The engines a job runs on, one class each, chosen by `cluster=` from one table.

    base.py          JobBackend: the one interface (submit, state, cancel, the task's place and
                     group, requeue, the settings it accepts), TaskEnvironment, the job states
    via_submitit.py  what the submitit-based backends share
    local.py         cluster="local" (--detach): a detached job on this machine
    slurm.py         cluster="slurm": a Slurm job

Another engine is one file with a JobBackend subclass and one line in TABLE (or, from
outside gpunb, one call to `register`); nothing else in gpunb names an engine.
"""

from __future__ import annotations

import difflib
import importlib

from gpunb.errors import GpunbError
from gpunb.jobs.backends.base import JobBackend

# The engines: `cluster=` value -> "module:class". Imported when first asked for.
TABLE = {
    "local": "gpunb.jobs.backends.local:LocalBackend",
    "slurm": "gpunb.jobs.backends.slurm:SlurmBackend",
}
_made: dict[str, JobBackend] = {}


def register(backend: type[JobBackend]) -> None:
    """Add an engine from outside gpunb: its `name` becomes a `cluster=` value. Every process that
    looks its jobs up registers it too (the job's tasks, the sidebar's server): importing the module
    that defines it can do it."""
    TABLE[backend.name] = f"{backend.__module__}:{backend.__qualname__}"
    _made[backend.name] = backend()


def every() -> list[JobBackend]:
    """Every engine, in the table's order."""
    return [get(name) for name in TABLE]


def find(name: str | None) -> JobBackend | None:
    """The engine called `name` (or one of its aliases), None when there is none."""
    if name in _made:
        return _made[name]
    if name in TABLE:
        _made[name] = _load(TABLE[name])()
        return _made[name]
    return next((backend for backend in every() if name in backend.aliases), None)


def get(name: str | None) -> JobBackend:
    """The engine called `name`; a GpunbError naming the known ones when there is none."""
    found = find(name)
    if found is None:
        close = difflib.get_close_matches(str(name), list(TABLE), n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        known = ", ".join(f"`cluster='{b.name}'` ({b.what})" for b in every())
        raise GpunbError(f"cluster={name!r} is not a cluster gpunb knows{guess}.",
                         f"use {known}, or cluster=None to train in this process.")
    return found


def chosen(config) -> JobBackend:
    """The engine of `config.cluster`, once the config's job options are known to fit it."""
    backend = get(config.cluster)
    if config.nodes > 1 and not backend.several_nodes:
        several = " or ".join(f"`cluster='{b.name}'`" for b in every() if b.several_nodes)
        raise GpunbError(f"nodes={config.nodes} asks for several machines, and cluster={config.cluster!r} runs "
                         f"{backend.what}.", f"pass {several} too (`--cluster NAME`), or drop `nodes`.")
    return backend


def _load(path: str) -> type[JobBackend]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
