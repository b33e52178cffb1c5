"""The run registry: every training run, in any kernel, as a row in one SQLite file.

    gpunb.runs()                            recent runs as a table
    gpunb.compare("a", "b")                 their loss curves overlaid
    gpunb.runs.remove("a")                  delete finished runs by name or id
    gpunb.runs.prune(keep=20)               keep the 20 newest finished runs
    gpunb.runs.prune(older_than_days=30)    delete finished runs started over 30 days ago

Neither ever deletes a live run: its process runs on this host, or (a registry shared
between hosts) its heartbeat, stamped every few seconds by the run itself, is fresh.

A registry file that another process keeps locked raises `RegistryLocked`; one
that is damaged raises `RegistryDamaged`, whose message says how to start afresh.

Nothing touches the disk at import; the file is created on first use.
"""

import sys
import types

from gpunb.runs.recorder import RunRecorder
from gpunb.runs.registry import STATUSES, Registry, RegistryDamaged, RegistryLocked, default_path
from gpunb.runs.views import RunComparison, RunTable, compare, prune, remove, runs

__all__ = ["STATUSES", "Registry", "RegistryDamaged", "RegistryLocked", "RunComparison", "RunRecorder",
           "RunTable", "compare", "default_path", "prune", "remove", "runs"]


class _CallableModule(types.ModuleType):
    """`gpunb.runs` is this package and, once imported, still the call `gpunb.runs()`.

    Importing a subpackage binds its name on the parent package, which would shadow the
    public function `gpunb.runs`; making the module callable keeps both meanings.
    """

    def __call__(self, limit: int = 20, **kwargs) -> RunTable:
        return runs(limit, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
