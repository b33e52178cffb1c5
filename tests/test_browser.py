"""The sidebar in a real JupyterLab, driven in headless Chromium through Playwright.

Needs Debian's `chromium` and `pip install playwright` (never `playwright install`:
the system browser is used). Starts its own `jupyter lab` on 127.0.0.1 with a token,
a private config dir and GPUNB_HOME, and always tears both down.
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

from gpunb.runs import Registry

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BUILT = REPO / "gpunb" / "labextension"
TOKEN = "gpunb-browser-test"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TRAIN = """\
import torch, gpunb
torch.manual_seed(0)
x = torch.randn(4096, 8)
y = x @ torch.randn(8, 1)
gpunb.Trainer(epochs=1000, max_steps=100_000, log_every=5, name="browser-run").fit(
    torch.nn.Linear(8, 1), (x, y), loss_fn=torch.nn.functional.mse_loss)
"""


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no chromium on PATH: `apt-get install -y chromium` (Debian's browser is the one used)")
    return path


def _sync_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: `pip install playwright` (never `playwright install`)")
    return sync_playwright


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(url: str, path: str, method: str = "GET", body: dict | None = None) -> dict:
    request = urllib.request.Request(
        f"{url}/{path}", method=method, data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read() or b"null")


@contextlib.contextmanager
def jupyter_lab(tmp: Path):
    """A `jupyter lab` that sees this checkout's gpunb (server extension and built sidebar)."""
    (tmp / "root").mkdir()
    (tmp / "config").mkdir()
    # This checkout's build comes first on the labextensions path, ahead of any installed copy.
    (tmp / "labextensions").mkdir()
    (tmp / "labextensions" / "gpunb").symlink_to(BUILT)
    (tmp / "config" / "jupyter_server_config.json").write_text(json.dumps({
        "ServerApp": {"jpserver_extensions": {"gpunb": True}},
        "LabApp": {"extra_labextensions_path": [str(tmp / "labextensions")]}}))
    # No "Would you like to get Jupyter news?" toast over the screenshots (and no web request).
    notification = tmp / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = dict(os.environ, GPUNB_HOME=str(tmp / "gpunb"), JUPYTER_CONFIG_DIR=str(tmp / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTER_PLATFORM_DIRS="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp / "lab.log", "wb") as log:  # the child keeps its own copy of the descriptor
        lab = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
             f"--port={port}", f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={tmp / 'root'}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                _api(url, "api/status")
                break
            except OSError:
                if lab.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter lab did not start:\n{(tmp / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.25)
        yield url
    finally:
        with contextlib.suppress(OSError):
            _api(url, "api/shutdown", method="POST")  # shuts its kernels down too
        try:
            lab.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lab.pid, signal.SIGKILL)  # whatever is left of its session: kernels, workers
        lab.wait()


@contextlib.contextmanager
def chromium_page(url: str):
    executable = _chromium()
    with _sync_playwright()() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(30_000)
            page.goto(f"{url}/lab?token={TOKEN}")
            yield page
        finally:
            browser.close()


@contextlib.contextmanager
def kernel_client(url: str, tmp: Path, notebook: str):
    """A kernel of that server, started for `notebook`, and a client on its connection file."""
    from jupyter_client import BlockingKernelClient

    session = _api(url, "api/sessions", "POST",
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


def test_sidebar_shows_host_stats_and_stops_a_run(tmp_path):
    _chromium()
    _sync_playwright()
    if not (BUILT / "package.json").exists():
        pytest.skip("the sidebar is not built: `pip install -e .` or `cd labextension && jlpm build`")
    DOCS.mkdir(exist_ok=True)
    with jupyter_lab(tmp_path) as url, chromium_page(url) as page:
        # The panel: its own icon in the left area, the no-GPU state with host stats.
        page.locator(".jp-SideBar.jp-mod-left [data-id='gpunb-sidebar']").click()
        panel = page.locator("#gpunb-sidebar")
        panel.locator(".jp-gpunb-nogpu").wait_for()
        assert "No NVIDIA GPU" in panel.inner_text()
        panel.locator(".jp-gpunb-host .jp-gpunb-bar", has_text="RAM").wait_for()
        page.locator(".jp-Launcher").wait_for()  # the same settled page in both screenshots
        page.screenshot(path=DOCS / "sidebar-no-gpu.png")

        # The layout restorer reopens the panel after a reload.
        page.wait_for_timeout(1500)  # the workspace is saved shortly after a layout change
        page.reload()
        panel.locator(".jp-gpunb-nogpu").wait_for()

        requests = []
        page.on("request", lambda request: requests.append(request.url))

        # A training in a real kernel of this server shows up with its progress and loss.
        with kernel_client(url, tmp_path, "train.ipynb") as client:
            msg_id = client.execute(TRAIN)
            run = panel.locator(".jp-gpunb-run", has_text="browser-run")
            run.locator(".jp-gpunb-sparkline").wait_for()  # >= 2 logged losses
            assert run.get_attribute("data-status") == "running"
            assert "train.ipynb" in run.inner_text() and "ETA" in run.inner_text()
            page.screenshot(path=DOCS / "sidebar-run.png")

            # Stop, confirm, and the run ends cleanly as "stopped".
            run.locator(".jp-gpunb-stop").click()
            page.locator(".jp-Dialog").get_by_role("button", name="Stop run").click()
            page.locator(".jp-gpunb-run[data-status='stopped']", has_text="browser-run").wait_for()
            reply = client.get_shell_msg(timeout=30)
            while reply["parent_header"].get("msg_id") != msg_id:
                reply = client.get_shell_msg(timeout=30)
            assert reply["content"]["status"] == "ok", reply["content"]

        # Collapsed, the panel stops polling.
        assert any("/gpunb/api/runs" in url for url in requests)  # it did poll while open
        page.locator(".jp-SideBar.jp-mod-left [data-id='gpunb-sidebar']").click()
        panel.wait_for(state="hidden")
        requests.clear()
        page.wait_for_timeout(4500)  # more than two poll intervals
        assert not [url for url in requests if "/gpunb/api/" in url]

        (recorded,) = Registry(tmp_path / "gpunb" / "runs.sqlite").list_runs()
        assert (recorded["name"], recorded["status"]) == ("browser-run", "stopped")
        assert Path(recorded["notebook"]).name == "train.ipynb"  # the kernel reports its full path
