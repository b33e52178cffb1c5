"""The run registry: every training run, in any kernel, as a row in one SQLite file.

    gpunb.runs.runs()                       recent runs as a table
    gpunb.runs.compare("a", "b")            their loss curves overlaid

Nothing touches the disk at import; the file is created on first use.
"""

from gpunb.runs.recorder import RunRecorder
from gpunb.runs.registry import STATUSES, Registry, default_path
from gpunb.runs.views import RunComparison, RunTable, compare, runs

__all__ = ["STATUSES", "Registry", "RunComparison", "RunRecorder", "RunTable", "compare",
           "default_path", "runs"]
