"""The %%gputrain live dashboard in Notebook 7 (`jupyter notebook`), in headless Chromium.

Notebook 7 renders widgets with the same manager as JupyterLab (jupyterlab_widgets) but
in its own single-document app at /notebooks/<path>: the run's ipywidgets dashboard
must appear there and advance while the cell runs, then give way to the static summary.
"""

from __future__ import annotations

import re

import pytest
from browser_support import api, chromium_page, jupyter_lab, notebook_json, require_browser

pytestmark = pytest.mark.browser

NOTEBOOK = "nb7.ipynb"
TOTAL_STEPS = 30 * 45  # digits: 1,437 training images in batches of 32, 30 epochs
TRAIN_CELL = """\
%%gputrain --epochs 30 --batch-size 32 --lr 0.003 --log-every 5 --name nb7-demo --no-track
from torch import nn
from gpunb.demo import digits_data, digits_cnn

train_data, val_data = digits_data()
model = digits_cnn()
loss_fn = nn.CrossEntropyLoss()"""


def _step(text: str) -> int:
    match = re.search(rf"step (\d+)/{TOTAL_STEPS}\b", text)
    assert match, f"no 'step N/{TOTAL_STEPS}' in the status line {text!r}"
    return int(match.group(1))


def test_notebook7_shows_the_live_widget_dashboard_then_the_summary(tmp_path):
    require_browser()
    pytest.importorskip("notebook", minversion="7")
    with jupyter_lab(tmp_path, env={"OMP_NUM_THREADS": "1"}, app="notebook") as url:
        api(url, f"api/contents/{NOTEBOOK}", "PUT",
            {"type": "notebook", "format": "json", "content": notebook_json("%load_ext gpunb", TRAIN_CELL)})
        api(url, "api/sessions", "POST",  # its kernel, so the page asks no "Select Kernel" question
            {"path": NOTEBOOK, "type": "notebook", "name": NOTEBOOK, "kernel": {"name": "python3"}})
        with chromium_page(url, f"notebooks/{NOTEBOOK}") as page:
            try:
                cell = page.locator(".jp-Notebook .jp-CodeCell").nth(1)
                cell.locator(".jp-InputArea", has_text="--name nb7-demo").wait_for(timeout=60_000)
                # Notebook 7's single-document app, not JupyterLab.
                assert page.locator("body[data-notebook='notebooks']").count() == 1
                assert page.locator(".jp-LabShell").count() == 0
                page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
                page.get_by_role("menuitem", name="Run All Cells", exact=True).click()

                output = cell.locator(".jp-OutputArea")
                progress = output.locator(".widget-hprogress")  # the IntProgress widget, rendered
                progress.wait_for(timeout=90_000)
                status = output.locator(".widget-html").filter(has_text=re.compile(r"step \d+/\d+"))
                status.wait_for(timeout=30_000)
                assert "nb7-demo" in output.inner_text()  # the header names the run
                first_step = _step(status.inner_text())
                # Live: the status line moves on by at least an epoch while the cell still runs.
                page.wait_for_function(
                    """([line, target]) => {
                           const m = line.textContent.match(/step (\\d+)\\//);
                           return m && Number(m[1]) >= target;
                       }""",
                    arg=[status.element_handle(), first_step + 45], timeout=60_000)
                assert first_step < _step(status.inner_text()) < TOTAL_STEPS
                # the loss curve: its update is a message of its own, which may land after the status's
                output.locator("svg polyline").first.wait_for(timeout=30_000)

                summary = output.locator(".gpunb-result")
                summary.wait_for(timeout=120_000)
                assert progress.count() == 0 and output.locator(".jupyter-widgets").count() == 0
                assert output.locator(".jp-OutputArea-output").count() == 1  # replaced in place
                table = summary.locator("table").first
                rows = dict(zip(table.locator("th").all_inner_texts(), table.locator("td").all_inner_texts()))
                assert rows.get("status") == "completed", rows
                assert rows.get("progress") == f"epoch 30 of 30, step {TOTAL_STEPS:,} of {TOTAL_STEPS:,}", rows
                assert "Traceback" not in page.locator(".jp-Notebook").inner_text()
            except BaseException:
                page.screenshot(path=tmp_path / "failure.png")  # what the browser showed, for the report
                (tmp_path / "failure.html").write_text(page.content())
                raise
