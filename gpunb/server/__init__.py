"""Jupyter server extension: an authenticated REST API over telemetry and the run registry.

Enabled for every server by `jupyter-config/server-config/gpunb.json` (installed with
the package). The package `gpunb` re-exports the two `_jupyter_*` functions below, so
the server finds them under the name it was enabled with. Nothing here touches NVML
or the registry until a request comes in, and nothing imports Jupyter until the server
loads the extension: the core install has no jupyter_server (it comes with `gpunb[lab]`).
"""

from __future__ import annotations

import importlib.util


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "gpunb.server"}]


def _jupyter_labextension_paths() -> list[dict]:
    # Relative to the `gpunb` package: where the built sidebar lands (`jlpm build`).
    return [{"src": "labextension", "dest": "gpunb"}]


def _load_jupyter_server_extension(server_app) -> None:
    from .handlers import LAB_HINT, setup_handlers

    setup_handlers(server_app.web_app)
    server_app.log.info("gpunb: GPU and run API at %sgpunb/api/", server_app.base_url)
    if importlib.util.find_spec("jupyterlab") is None:
        # A server without JupyterLab (e.g. a bare `jupyter server`) serves the API but no sidebar.
        server_app.log.warning("gpunb: the GPU sidebar needs JupyterLab, which is not installed. "
                               "HINT: %s", LAB_HINT)

