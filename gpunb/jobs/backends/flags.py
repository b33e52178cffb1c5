"""The backends' settings as options of %%gputrain, made from the table as config_flags makes
TrainConfig's: a new backend's settings are new options, and nothing else lists them.

    --detach             a backend's `switch`: runs the cell as a job of that backend (`cluster="local"`)
    --partition gpu      a setting with `flag=True` (once, whichever backends share it)
    --slurm KEY=VALUE    a backend's table of other settings (repeatable), named after the backend

Their values become the config's `cluster` and `slurm={...}` (`cluster_values`).
"""

from __future__ import annotations

from gpunb.errors import GpunbError
from gpunb.jobs.backends import every


def add_cluster_flags(parser) -> None:
    """Every backend's switch, flagged settings and table of other settings, as options of `parser`."""
    group = parser.add_argument_group("jobs (each cluster's settings)")
    seen = set()
    for backend in every():
        if backend.switch is not None:
            group.add_argument(_option(backend.switch.name), dest=backend.switch.name, action="store_true",
                               help=backend.switch.help)
        for setting in backend.settings:
            if setting.flag and setting.name not in seen:
                seen.add(setting.name)
                group.add_argument(_option(setting.name), dest=setting.name, help=setting.help)
        if backend.extra_table:
            group.add_argument(_option(backend.name), dest=backend.name, action="append", metavar="KEY=VALUE",
                               help=f"any other {backend.extra_table} setting (repeatable)")


def cluster_values(args) -> dict:
    """`cluster` (from a backend's switch) and `slurm` (the settings given) from the parsed `args`."""
    chosen = {}
    for backend in every():
        if backend.switch is not None and getattr(args, backend.switch.name, False):
            if getattr(args, "cluster", None) or "cluster" in chosen:
                raise GpunbError(f"{_option(backend.switch.name)} runs {backend.what}, and another cluster is "
                                 "named too: pick one.",
                                 f"drop `{_option(backend.switch.name)}` to submit to the cluster.")
            chosen["cluster"] = backend.name
    settings = {}
    for backend in every():
        for setting in backend.settings:
            if setting.flag and getattr(args, setting.name, None) is not None:
                settings[setting.name] = getattr(args, setting.name)
        for item in (getattr(args, backend.name, None) or ()) if backend.extra_table else ():
            key, equals, value = item.partition("=")
            if not equals or not key.strip():
                raise GpunbError(f"{_option(backend.name)} {item!r} is not KEY=VALUE.",
                                 f"e.g. `{_option(backend.name)} mem=64G {_option(backend.name)} exclusive=`.")
            settings[key.strip().lstrip("-")] = value.strip()
    if settings:
        chosen["slurm"] = settings
    return chosen


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")
