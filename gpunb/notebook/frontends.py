"""Which live view a %%gputrain run gets: ipywidgets, HTML re-sent through a display handle,
or the terminal line.

`GPUNB_DASHBOARD=widgets|html|text` decides when set. Otherwise the front end does:

- no kernel (terminal IPython, a script): text.
- a kernel without ipywidgets: html; every notebook front end renders HTML outputs and
  applies `update_display_data`, nbconvert and nbclient included.
- Colab: its built-in widget manager renders ipywidgets 7's controls; ipywidgets 8 models
  need `google.colab.output.enable_custom_widget_manager()`, an opt-in (loading from a CDN)
  that the kernel cannot see, so widgets with ipywidgets 7 and html with 8.
- VS Code (which hosts JupyterLab's widget manager for ipywidgets 7 and 8), JupyterLab and
  Notebook 7 (jupyterlab_widgets): widgets.

A front end the kernel cannot tell apart that has no widget manager (say, an old classic
Notebook beside ipywidgets 8) shows the widget's one-line text; `GPUNB_DASHBOARD=html` fixes it.
"""

from __future__ import annotations

import os
import sys

from gpunb.errors import GpunbError

MODES = ("widgets", "html", "text")


def front_end(environ=None, modules=None) -> str:
    """"colab", "vscode" or "jupyter": what the kernel can tell of who displays its outputs."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "google.colab" in modules:
        return "colab"
    if any(name.startswith("VSCODE_") for name in environ):  # VS Code's kernels inherit its env
        return "vscode"
    return "jupyter"


def dashboard_mode(shell, environ=None, modules=None) -> str:
    """One of MODES for a run in `shell`; a bad GPUNB_DASHBOARD is a GpunbError."""
    environ = os.environ if environ is None else environ
    forced = environ.get("GPUNB_DASHBOARD", "").strip().lower()
    if forced:
        if forced not in MODES:
            raise GpunbError(f"GPUNB_DASHBOARD={environ['GPUNB_DASHBOARD']!r} is not a dashboard gpunb knows.",
                             "set it to `widgets`, `html` or `text`, or unset it to let gpunb choose.")
        if forced == "widgets" and _ipywidgets_major() is None:
            raise GpunbError("GPUNB_DASHBOARD=widgets, but ipywidgets cannot be imported.",
                             "`pip install ipywidgets`, or set `GPUNB_DASHBOARD=html`.")
        return forced
    if getattr(shell, "kernel", None) is None:
        return "text"
    major = _ipywidgets_major()
    if major is None:
        return "html"
    if front_end(environ, modules) == "colab" and major >= 8:
        return "html"
    return "widgets"


def live_view(mode: str) -> list:
    """The callbacks that draw a run in `mode` (one of MODES)."""
    if mode == "text":
        from gpunb.render import ProgressPrinter

        return [ProgressPrinter()]
    from gpunb.notebook.dashboard import Dashboard, HtmlDashboard

    return [Dashboard() if mode == "widgets" else HtmlDashboard()]


def _ipywidgets_major() -> int | None:
    try:
        import ipywidgets
    except ImportError:
        return None
    return int(ipywidgets.__version__.split(".")[0])
