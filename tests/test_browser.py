"""The sidebar in a real JupyterLab, driven in headless Chromium through Playwright.

Needs Debian's `chromium` and `pip install playwright` (never `playwright install`:
the system browser is used). Starts its own `jupyter lab` on 127.0.0.1 with a token,
a private config dir and GPUNB_HOME, and always tears both down (tests/browser_support.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from browser_support import (
    BUILT,
    chromium_page,
    jupyter_lab,
    kernel_client,
    require_browser,
)

from gpunb.runs import Registry

pytestmark = pytest.mark.browser

TRAIN = """\
import torch, gpunb
torch.manual_seed(0)
x = torch.randn(4096, 8)
y = x @ torch.randn(8, 1)
gpunb.Trainer(epochs=1000, max_steps=100_000, log_every=5, name="browser-run").fit(
    torch.nn.Linear(8, 1), (x, y), (x[:256], y[:256]), loss_fn=torch.nn.functional.mse_loss)
"""


def test_sidebar_shows_host_stats_stops_a_run_shows_it_and_removes_it(tmp_path, screenshots):
    require_browser()
    if not (BUILT / "package.json").exists():
        pytest.skip("the sidebar is not built: `pip install -e .` or `cd labextension && jlpm build`")
    screenshots.mkdir(parents=True, exist_ok=True)
    with jupyter_lab(tmp_path) as url, chromium_page(url) as page:
        # The panel: its own icon in the left area, the no-GPU state with host stats.
        page.locator(".jp-SideBar.jp-mod-left [data-id='gpunb-sidebar']").click()
        panel = page.locator("#gpunb-sidebar")
        panel.locator(".jp-gpunb-nogpu").wait_for()
        assert "No NVIDIA GPU" in panel.inner_text()
        panel.locator(".jp-gpunb-host .jp-gpunb-bar", has_text="RAM").wait_for()
        panel.locator(".jp-gpunb-host .jp-gpunb-sparkline").wait_for()  # CPU history: >= 2 samples
        page.locator(".jp-Launcher").wait_for()  # the same settled page in both screenshots
        page.screenshot(path=screenshots / "sidebar-no-gpu.png")

        # The layout restorer reopens the panel after a reload.
        page.wait_for_timeout(1500)  # the workspace is saved shortly after a layout change
        page.reload()
        panel.locator(".jp-gpunb-nogpu").wait_for()

        requests = []  # URL paths (ServerConnection may add a query string)
        page.on("request", lambda request: requests.append(urlsplit(request.url).path))

        # A training in a real kernel of this server shows up with its progress and loss.
        with kernel_client(url, tmp_path, "train.ipynb") as client:
            msg_id = client.execute(TRAIN)
            run = panel.locator(".jp-gpunb-run", has_text="browser-run")
            run.locator(".jp-gpunb-sparkline").wait_for()  # >= 2 logged losses
            assert run.get_attribute("data-status") == "running"
            assert "train.ipynb" in run.inner_text() and "ETA" in run.inner_text()
            page.screenshot(path=screenshots / "sidebar-run.png")

            # Stop, confirm, and the run ends cleanly as "stopped".
            run.locator(".jp-gpunb-stop").click()
            page.locator(".jp-Dialog").get_by_role("button", name="Stop run").click()
            page.locator(".jp-gpunb-run[data-status='stopped']", has_text="browser-run").wait_for()
            reply = client.get_shell_msg(timeout=30)
            while reply["parent_header"].get("msg_id") != msg_id:
                reply = client.get_shell_msg(timeout=30)
            assert reply["content"]["status"] == "ok", reply["content"]

        (recorded,) = Registry(tmp_path / "gpunb" / "runs.sqlite").list_runs()
        assert (recorded["name"], recorded["status"]) == ("browser-run", "stopped")
        assert Path(recorded["notebook"]).name == "train.ipynb"  # the kernel reports its full path
        assert set(recorded["best"]) == {"val_loss"}

        # The finished card: duration, steps, best validation value, when.
        stopped = panel.locator(".jp-gpunb-run[data-status='stopped']", has_text="browser-run")
        summary = stopped.locator(".jp-gpunb-run-summary").inner_text()
        assert re.fullmatch(r"(\d+m \d\ds|\d+s) · [\d,]+ steps · best val_loss [\d.e-]+ · just now", summary), summary
        assert f"{recorded['step']:,} steps" in summary
        assert stopped.locator(".jp-gpunb-remove").is_visible() and stopped.locator(".jp-gpunb-stop").count() == 0

        # A click opens its curves and configuration.
        stopped.click()
        detail = panel.locator(".jp-gpunb-detail")
        detail.locator(".jp-gpunb-chart[data-metric='loss'] polyline").first.wait_for()
        assert detail.locator(".jp-gpunb-chart[data-metric='loss'] polyline").count() == 2  # loss, val_loss
        config = detail.locator(".jp-gpunb-config").inner_text()
        assert "max_steps" in config and "100000" in config
        # The list stays above it, the open run marked: a new run and its Stop button stay in view.
        assert stopped.is_visible() and "jp-mod-open" in stopped.get_attribute("class")
        page.screenshot(path=screenshots / "sidebar-run-detail.png")
        detail.locator(".jp-gpunb-back").click()
        stopped.wait_for()

        # Remove, confirm: gone from the panel and from the registry.
        stopped.locator(".jp-gpunb-remove").click()
        page.locator(".jp-Dialog").get_by_role("button", name="Remove run").click()
        stopped.wait_for(state="detached")
        assert Registry(tmp_path / "gpunb" / "runs.sqlite").list_runs() == []

        # One request for the runs a poll: no per-run requests for running runs' losses.
        assert any(url.endswith("/gpunb/api/runs") for url in requests)  # it did poll while open
        assert not [url for url in requests if "/gpunb/api/runs/" in url and "/stop" not in url
                    and url.split("/")[-1] != recorded["id"]]

        # Collapsed, the panel stops polling.
        page.locator(".jp-SideBar.jp-mod-left [data-id='gpunb-sidebar']").click()
        panel.wait_for(state="hidden")
        requests.clear()
        page.wait_for_timeout(4500)  # more than two poll intervals
        assert not [url for url in requests if "/gpunb/api/" in url]


def test_sidebar_says_which_registry_file_is_damaged_and_how_to_recover(tmp_path):
    require_browser()
    if not (BUILT / "package.json").exists():
        pytest.skip("the sidebar is not built: `pip install -e .` or `cd labextension && jlpm build`")
    damaged = tmp_path / "gpunb" / "runs.sqlite"
    damaged.parent.mkdir()
    damaged.write_bytes(b"not an SQLite file " * 100)
    with jupyter_lab(tmp_path) as url, chromium_page(url) as page:
        page.locator(".jp-SideBar.jp-mod-left [data-id='gpunb-sidebar']").click()
        panel = page.locator("#gpunb-sidebar")
        error = panel.locator(".jp-gpunb-runs-error")
        error.wait_for()
        assert f"The run registry {damaged} is damaged" in error.inner_text()
        assert f"mv '{damaged}' '{damaged}.damaged'" in error.inner_text()
        assert panel.locator(".jp-gpunb-host").is_visible()  # the devices still show
        damaged.rename(damaged.with_suffix(".sqlite.damaged"))  # the recovery it gives
        panel.get_by_text("No training runs yet").wait_for()
        assert error.count() == 0
