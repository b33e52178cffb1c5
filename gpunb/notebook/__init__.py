"""The notebook front end: magics, the live dashboard, and the export of a cell as a torchrun script.

A thin layer over gpunb.runtime; importing it does not import torch or ipywidgets.
"""

from __future__ import annotations


def register_magics(ipython) -> None:
    """Register %%gputrain, %gpustatus and %gpuprofile on `ipython`."""
    from gpunb.notebook.magics import GpuMagics

    ipython.register_magics(GpuMagics)
    try:
        from gpunb.notebook.profile_magic import register
    except ImportError:  # profiling is optional
        return
    register(ipython)
