"""A real JupyterLab and headless Chromium for the browser tests (tests marked `browser`).

Needs Debian's `chromium` and `pip install playwright` (never `playwright install`:
the system browser is used). `jupyter_lab` starts its own `jupyter lab` on 127.0.0.1
with a token, a private config dir and GPUNB_HOME; `chromium_page` opens it. Both always
tear down, and nothing they started (server, kernels, their workers, browser) outlives them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BUILT = REPO / "gpunb" / "labextension"
TOKEN = "gpunb-browser-test"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no chromium on PATH: `apt-get install -y chromium` (Debian's browser is the one used)")
    return path


def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright as start
    except ImportError:
        pytest.skip("playwright is not installed: `pip install playwright` (never `playwright install`)")
    return start


def require_browser() -> None:
    """Skip the calling test, with the reason, unless chromium and playwright are both here."""
    chromium()
    sync_playwright()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, method: str = "GET", body: dict | None = None) -> dict:
    request = urllib.request.Request(
        f"{url}/{path}", method=method, data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read() or b"null")


def _started_by(marker: bytes) -> list[int]:
    """Pids of live processes whose environment holds `marker` (this server's private GPUNB_HOME)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and marker in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def _reap_started_by(marker: bytes, grace_s: float = 5.0) -> list[int]:
    """SIGKILL what is left of the processes carrying `marker`; returns the pids that were left.

    Kernels run in their own sessions (jupyter_client starts them with start_new_session),
    so killing the server's process group does not reach them; their environment does.
    """
    deadline = time.monotonic() + grace_s
    while (left := _started_by(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)  # a kernel shut down through the API exits on its own shortly
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


@contextlib.contextmanager
def jupyter_lab(tmp: Path, env: dict | None = None, app: str = "jupyterlab"):
    """A `jupyter lab` that sees this checkout's gpunb (server extension and, when built, the sidebar).

    `app="notebook"` starts Notebook 7 instead (`/tree`, `/notebooks/<path>`) on the same terms.

    Serves `tmp / "root"`; kernels write their connection files to `tmp / "runtime"` and
    record runs under GPUNB_HOME=`tmp / "gpunb"`. `env` adds to the server's (and its
    kernels') environment.
    """
    (tmp / "root").mkdir()
    (tmp / "config").mkdir()
    # This checkout's build comes first on the labextensions path, ahead of any installed copy.
    (tmp / "labextensions").mkdir()
    if (BUILT / "package.json").exists():
        (tmp / "labextensions" / "gpunb").symlink_to(BUILT)
    (tmp / "config" / "jupyter_server_config.json").write_text(json.dumps({
        "ServerApp": {"jpserver_extensions": {"gpunb": True}},
        "LabApp": {"extra_labextensions_path": [str(tmp / "labextensions")]}}))
    # No "Would you like to get Jupyter news?" toast over the screenshots (and no web request).
    notification = tmp / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    home = tmp / "gpunb"
    env = dict(os.environ, GPUNB_HOME=str(home), JUPYTER_CONFIG_DIR=str(tmp / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTER_PLATFORM_DIRS="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               **(env or {}))
    marker = f"GPUNB_HOME={home}".encode()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp / "lab.log", "wb") as log:  # the child keeps its own copy of the descriptor
        lab = subprocess.Popen(
            [sys.executable, "-m", app, "--no-browser", "--allow-root", "--ip=127.0.0.1",
             f"--port={port}", f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={tmp / 'root'}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                api(url, "api/status")
                break
            except OSError:
                if lab.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter {app} did not start:\n{(tmp / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.25)
        yield url
    finally:
        with contextlib.suppress(OSError):
            api(url, "api/shutdown", method="POST")  # shuts its kernels down too
        try:
            lab.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lab.pid, signal.SIGKILL)  # whatever is left of its own session
        lab.wait()
        _reap_started_by(marker)  # kernels (own sessions) and their workers, if shutdown missed them


def notebook_json(*sources: str) -> dict:
    """An nbformat 4 notebook of code cells, for the contents API."""
    cells = [{"cell_type": "code", "execution_count": None, "id": f"cell-{i}", "metadata": {},
              "outputs": [], "source": source} for i, source in enumerate(sources)]
    return {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                         "language_info": {"name": "python"}}}


@contextlib.contextmanager
def chromium_page(url: str, path: str = "lab", viewport: dict | None = None):
    """A headless Chromium page on `url/path` (logged in with the token); closed on exit."""
    executable = chromium()
    with sync_playwright()() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=viewport or {"width": 1280, "height": 800})
            page.set_default_timeout(30_000)
            page.goto(f"{url}/{path}?token={TOKEN}")
            yield page
        finally:
            browser.close()


@contextlib.contextmanager
def kernel_client(url: str, tmp: Path, notebook: str):
    """A kernel of that server, started for `notebook`, and a client on its connection file."""
    from jupyter_client import BlockingKernelClient

    session = api(url, "api/sessions", "POST",
                  {"path": notebook, "type": "notebook", "name": notebook, "kernel": {"name": "python3"}})
    client = BlockingKernelClient()
    client.load_connection_file(tmp / "runtime" / f"kernel-{session['kernel']['id']}.json")
    # No heartbeat: a client without its kernel's manager judges liveness by heartbeat,
    # which has not beaten yet for a fresh kernel, and wait_for_ready would call it dead.
    client.start_channels(hb=False)
    try:
        client.wait_for_ready(timeout=60)
        yield client
    finally:
        client.stop_channels()
