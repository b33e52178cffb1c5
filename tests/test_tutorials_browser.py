"""The shipped tutorials reopened cold, as a user who downloads or receives them would.

A notebook that this server has not signed is untrusted: JupyterLab and Notebook 7 sanitize
its HTML outputs and drop inline `<svg>`, which left a chart's labels as loose text
("01002003000.010.11steploss"). gpunb stores each chart as an image of its SVG instead;
here every stored chart of every shipped tutorial must show as an image of its full size.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from browser_support import REPO, chromium_page, jupyter_lab, require_browser

pytestmark = pytest.mark.browser

NOTEBOOKS = REPO / "notebooks"


def stored_charts(path: Path) -> list[tuple[int, int]]:
    """(width, height) of each chart image stored in the notebook's HTML outputs."""
    sizes = []
    for cell in json.loads(path.read_text())["cells"]:
        for output in cell.get("outputs", []):
            markup = output.get("data", {}).get("text/html", "")
            markup = "".join(markup) if isinstance(markup, list) else markup
            assert "<svg" not in markup, f"{path.name} stores an inline <svg>, which untrusted front ends drop"
            sizes += [(int(w), int(h)) for w, h in re.findall(
                r"<img src='data:image/svg\+xml;base64,[^']+' width='(\d+)' height='(\d+)'", markup)]
    return sizes


CHARTED = {path.name: stored_charts(path) for path in sorted(NOTEBOOKS.glob("*.ipynb")) if stored_charts(path)}


def test_the_tutorials_store_their_charts_as_images():
    assert len(CHARTED) >= 5 and "01-quickstart.ipynb" in CHARTED  # what the browser test below opens


@pytest.mark.parametrize("app, page_path", [("jupyterlab", "lab/tree/{}"), ("notebook", "notebooks/{}")])
def test_charts_of_a_reopened_untrusted_tutorial_are_images(tmp_path, screenshots, app, page_path):
    require_browser()
    if app == "notebook":
        pytest.importorskip("notebook", minversion="7")
    screenshots.mkdir(parents=True, exist_ok=True)
    with jupyter_lab(tmp_path, app=app) as url:
        for name in CHARTED:  # plain files on disk, never opened or signed by this server
            shutil.copy(NOTEBOOKS / name, tmp_path / "root" / name)
        with chromium_page(url, "api/status") as page:  # logs in with the token
            for name, sizes in CHARTED.items():
                # JupyterLab would restore the earlier tabs beside it: a reset workspace holds one
                page.goto(f"{url}/{page_path.format(name)}" + ("?reset" if app == "jupyterlab" else ""))
                charts = page.locator(".jp-OutputArea-output img[src^='data:image/svg+xml']")
                page.locator(".jp-Notebook .jp-Cell").first.wait_for()
                page.wait_for_function("n => document.querySelectorAll("
                                       "\".jp-OutputArea-output img[src^='data:image/svg+xml']\").length >= n",
                                       arg=len(sizes))
                assert charts.count() == len(sizes), name
                for i, size in enumerate(sizes):
                    chart = charts.nth(i)
                    # decoded as an image of the chart's own size: not broken, not stripped
                    natural = chart.evaluate("img => img.decode().then(() => [img.naturalWidth, img.naturalHeight])")
                    assert tuple(natural) == size, (name, i, natural)
                text = page.locator(".jp-Notebook").inner_text()
                assert not re.search(r"\dsteploss|train lossval loss", text), f"{name}: a chart became text"
                if name == "01-quickstart.ipynb":
                    charts.first.scroll_into_view_if_needed()
                    page.screenshot(path=screenshots / f"tutorial-reopened-{app}.png")
