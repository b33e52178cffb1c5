"""gpunb: fast GPU training of PyTorch models in one Jupyter cell.

    %load_ext gpunb          # then %%gputrain, %gpuprofile, %gpustatus
    from gpunb import Trainer, TrainConfig, predict, evaluate

Importing gpunb is cheap: torch and everything else load on first use, and nothing
touches CUDA or NVML at import time.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Trainer", "TrainConfig", "TrainResult", "predict", "evaluate", "profile", "runs", "compare", "attach", "stop", "suggest"]

_LAZY = {
    "Trainer": "gpunb.trainer",
    "TrainResult": "gpunb.runtime.result",
    "TrainConfig": "gpunb.config",
    "predict": "gpunb.runtime.predict",
    "evaluate": "gpunb.runtime.predict",
    "profile": "gpunb.profiling",
    "runs": "gpunb.runs",
    "compare": "gpunb.runs",
    "attach": "gpunb.jobs",
    "stop": "gpunb.jobs",
    "suggest": "gpunb.sweeps",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpunb' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


def load_ipython_extension(ipython) -> None:
    """`%load_ext gpunb`: registers %%gputrain, %gpuprofile and %gpustatus."""
    from gpunb.notebook import register_magics

    register_magics(ipython)


# Jupyter finds the server extension and the prebuilt sidebar through these names.
from gpunb.server import _jupyter_labextension_paths, _jupyter_server_extension_points  # noqa: E402,F401
