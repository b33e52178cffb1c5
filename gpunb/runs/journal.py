"""The registry file's journal: WAL, or a rollback journal where the file system cannot do WAL."""

from __future__ import annotations

import sqlite3
import time
import warnings
from pathlib import Path


def enable_wal(db: sqlite3.Connection, timeout: float, path: Path | None = None) -> str:
    """Switch the file to WAL (a property of the file: every later connection gets it); returns
    the journal mode the file ends up with.

    The switch needs a moment alone with the file and, unlike other statements, answers
    "database is locked" at once instead of waiting on busy_timeout when another
    process is creating the file too, so it is retried here; but a registry that already
    has its tables had its journal chosen when it was made, so while another process
    writes to it, it is used as it is (a read must not wait for a writer). WAL needs shared memory
    that network file systems (NFS, Lustre, where clusters keep home directories) do not
    give: SQLite then keeps its old mode or fails with an I/O or locking error, and the
    registry falls back to a rollback journal, with one warning.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            mode = str(db.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
            break
        except sqlite3.OperationalError as error:
            message = str(error).lower()
            if any(sign in message for sign in _NO_WAL):
                return _rollback_journal(db, path, f"{type(error).__name__}: {error}")
            if "locked" not in message or time.monotonic() > deadline:
                raise
            if db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone() is not None:
                return str(db.execute("PRAGMA journal_mode").fetchone()[0]).lower()
            time.sleep(0.01)
    if mode != "wal":
        return _rollback_journal(db, path, f"SQLite kept journal_mode={mode}")
    return mode


_NO_WAL = ("disk i/o error", "locking protocol")  # SQLite's answers where WAL cannot work
_warned_no_wal: set = set()  # registry paths already warned about, once per process


def _rollback_journal(db: sqlite3.Connection, path: Path | None, why: str) -> str:
    db.execute("PRAGMA journal_mode=DELETE")
    if path not in _warned_no_wal:
        _warned_no_wal.add(path)
        warnings.warn(
            f"The run registry {path} cannot use SQLite's WAL journal here ({why}), as on network file "
            "systems (NFS, Lustre); it uses a rollback journal instead, so the sidebar's reads wait "
            "while a run writes. HINT: to keep WAL, point the registry at a local disk, e.g. "
            "`export GPUNB_HOME=/tmp/$USER/gpunb`.", UserWarning, stacklevel=2)
    return "delete"
