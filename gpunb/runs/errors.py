"""What can go wrong with the registry file itself, as errors that say what to do."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from gpunb.errors import GpunbError


class RegistryLocked(GpunbError):
    """Another process held the registry's write lock for longer than the wait allowed."""

    def __init__(self, path: Path, timeout: float):
        self.path = path
        super().__init__(f"The run registry {path} is locked: another process held it for more than "
                         f"{timeout:g} s.",
                         "try again in a moment. If it stays locked, close whatever holds the file "
                         "open for writing (an `sqlite3` shell or a database browser, for example).")


class RegistryDamaged(GpunbError):
    """The registry file is not a readable SQLite database, or not one gpunb can use.

    `error` is the SQLite error that showed it, or what is wrong in words ("is a directory ...").
    """

    def __init__(self, path: Path, error: BaseException | str):
        self.path = path
        problem = error if isinstance(error, str) else f"is damaged and cannot be read ({error})"
        super().__init__(f"The run registry {path} {problem}.",
                         f"move it aside, e.g. `mv '{path}' '{path}.damaged'`; gpunb starts a fresh "
                         "registry on next use. Training does not need it.")


def registry_error(error: BaseException, path: Path, timeout: float) -> GpunbError | None:
    """The `RegistryLocked`/`RegistryDamaged` that a sqlite3 error means, or None for other errors."""
    if isinstance(error, sqlite3.OperationalError):
        text = str(error)
        return RegistryLocked(path, timeout) if "locked" in text or "busy" in text else None
    if type(error) is sqlite3.DatabaseError:  # "file is not a database", "disk image is malformed"
        return RegistryDamaged(path, error)
    return None
