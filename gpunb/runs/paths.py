"""Where gpunb keeps its files: `$GPUNB_HOME`, else the platform's per-user data dir.

Kernels (which record runs) and the Jupyter server (which lists them for the sidebar)
both call `default_path()`, so they agree without asking Jupyter: the core install has
no jupyter_core, and platformdirs is not worth a dependency for three lines.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def data_dir() -> Path:
    """`$GPUNB_HOME`, else ~/.local/share/gpunb ($XDG_DATA_HOME), ~/Library/Application
    Support/gpunb on macOS, %APPDATA%\\gpunb on Windows."""
    home = os.environ.get("GPUNB_HOME")
    if home:
        return Path(home).expanduser()
    if sys.platform == "win32":
        base = os.environ.get("APPDATA") or Path.home() / "AppData" / "Roaming"
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base).expanduser() / "gpunb"


def default_path() -> Path:
    """The run registry: <data_dir()>/runs.sqlite, or the one an earlier gpunb kept in
    Jupyter's data dir while there is none here, so that no recorded run goes missing."""
    path = data_dir() / "runs.sqlite"
    if "GPUNB_HOME" not in os.environ and not path.exists():
        earlier = _jupyter_data_dir() / "gpunb" / "runs.sqlite"
        if earlier.exists():
            return earlier
    return path


def _jupyter_data_dir() -> Path:
    """jupyter_core.paths.jupyter_data_dir() without importing it (the core install lacks it)."""
    if os.environ.get("JUPYTER_DATA_DIR"):
        return Path(os.environ["JUPYTER_DATA_DIR"]).expanduser()
    if sys.platform == "win32":
        return Path(os.environ.get("APPDATA") or Path.home() / "AppData" / "Roaming") / "jupyter"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Jupyter"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "jupyter"
