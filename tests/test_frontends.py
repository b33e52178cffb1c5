"""Which live view a run gets (GPUNB_DASHBOARD and the front end), and the HTML view in a real kernel."""

import types

import IPython
import nbformat
import pytest
from conftest import charts_in
from IPython.core.error import UsageError
from IPython.testing.globalipapp import get_ipython
from nbclient import NotebookClient

from gpunb.errors import GpunbError
from gpunb.notebook import frontends
from gpunb.notebook.dashboard import Dashboard, HtmlDashboard
from gpunb.render import ProgressPrinter

KERNEL = types.SimpleNamespace(kernel=object())  # what a shell inside ipykernel looks like here
TERMINAL = types.SimpleNamespace(kernel=None)


@pytest.fixture
def widgets_major(monkeypatch):
    """Pretend the installed ipywidgets has this major version (None: not installed)."""
    def set_major(major):
        monkeypatch.setattr(frontends, "_ipywidgets_major", lambda: major)
    set_major(8)
    return set_major


@pytest.mark.parametrize("value, mode", [("widgets", "widgets"), ("html", "html"), ("text", "text"),
                                         (" HTML ", "html"), ("Text", "text")])
def test_gpunb_dashboard_forces_a_view_in_any_shell(widgets_major, value, mode):
    for shell in (KERNEL, TERMINAL):
        assert frontends.dashboard_mode(shell, {"GPUNB_DASHBOARD": value}, {}) == mode


def test_a_bad_gpunb_dashboard_names_the_three_values(widgets_major):
    with pytest.raises(GpunbError) as error:
        frontends.dashboard_mode(KERNEL, {"GPUNB_DASHBOARD": "fancy"}, {})
    assert "GPUNB_DASHBOARD='fancy'" in str(error.value)
    assert "`widgets`, `html` or `text`" in str(error.value)


def test_forced_widgets_without_ipywidgets_says_what_to_install(widgets_major):
    widgets_major(None)
    with pytest.raises(GpunbError, match=r"ipywidgets cannot be imported(.|\n)*`pip install ipywidgets`"):
        frontends.dashboard_mode(KERNEL, {"GPUNB_DASHBOARD": "widgets"}, {})


@pytest.mark.parametrize("shell, major, environ, modules, mode", [
    (TERMINAL, 8, {}, {}, "text"),                                   # terminal IPython, scripts
    (KERNEL, 8, {}, {}, "widgets"),                                  # JupyterLab, Notebook 7
    (KERNEL, 7, {}, {}, "widgets"),
    (KERNEL, None, {}, {}, "html"),                                  # no ipywidgets in the kernel
    (KERNEL, 8, {"VSCODE_PID": "1"}, {}, "widgets"),                 # VS Code's own widget manager
    (KERNEL, 7, {}, {"google.colab": object()}, "widgets"),          # Colab renders ipywidgets 7
    (KERNEL, 8, {}, {"google.colab": object()}, "html"),             # ... 8 only after an opt-in
])
def test_the_front_end_decides_without_gpunb_dashboard(widgets_major, shell, major, environ, modules, mode):
    widgets_major(major)
    assert frontends.dashboard_mode(shell, environ, modules) == mode


def test_front_ends_are_told_apart_by_modules_then_environment():
    assert frontends.front_end({}, {"google.colab": 1}) == "colab"
    assert frontends.front_end({"VSCODE_CWD": "/x"}, {}) == "vscode"
    assert frontends.front_end({"JPY_SESSION_NAME": "a.ipynb"}, {}) == "jupyter"


def test_each_mode_gets_its_view():
    assert [type(cb) for cb in frontends.live_view("text")] == [ProgressPrinter]
    assert [type(cb) for cb in frontends.live_view("widgets")] == [Dashboard]
    assert [type(cb) for cb in frontends.live_view("html")] == [HtmlDashboard]


def test_gputrain_refuses_a_bad_gpunb_dashboard_before_running_the_cell(monkeypatch):
    shell = get_ipython() or IPython.get_ipython()
    shell.run_line_magic("load_ext", "gpunb")
    shell.user_ns.pop("ran", None)
    monkeypatch.setenv("GPUNB_DASHBOARD", "widget")
    with pytest.raises(UsageError, match="`widgets`, `html` or `text`"):
        shell.run_cell_magic("gputrain", "--max-steps 1 --no-track", "ran = True")
    assert "ran" not in shell.user_ns
    with pytest.raises(UsageError, match="needs a variable `model`"):  # --quiet: no view, so no check
        shell.run_cell_magic("gputrain", "--max-steps 1 --no-track --quiet", "ran = True")
    assert shell.user_ns.pop("ran") is True


# ------------------------------------------------------------------ the HTML view in a real kernel
CELLS = [
    "import os\nos.environ['GPUNB_DASHBOARD'] = 'html'\n%load_ext gpunb",
    """%%gputrain --epochs 3 --batch-size 16 --log-every 2 --name html-view --no-track
import torch
from torch import nn
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 8, generator=g)
train_data = val_data = (x, (x[:, 0] > 0).long())
model = nn.Linear(8, 2)
loss_fn = nn.CrossEntropyLoss()""",
]


class RecordingClient(NotebookClient):
    """Keeps every iopub message of the training cell, as the front end receives them."""

    def process_message(self, msg, cell, cell_index):
        if cell_index == 1:
            self.messages.append(msg)
        return super().process_message(msg, cell, cell_index)


@pytest.fixture(scope="module")
def html_run():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    client = RecordingClient(notebook, timeout=240, kernel_name="python3")
    client.messages = []
    client.execute()
    return notebook, client.messages


def test_the_html_view_is_one_display_updated_in_place(html_run):
    notebook, messages = html_run
    shown = [m for m in messages if m["msg_type"] == "display_data"]
    updates = [m for m in messages if m["msg_type"] == "update_display_data"]
    assert len(shown) == 1
    display_id = shown[0]["content"]["transient"]["display_id"]
    first = shown[0]["content"]["data"]
    assert first["text/plain"] == "gpunb: training 'html-view' (live dashboard)"
    assert "<progress max='18' value='0'" in first["text/html"] and "html-view" in first["text/html"]
    # Redrawn through the same handle: at least once an epoch, then the summary in its place.
    assert len(updates) >= 4 and {m["content"]["transient"]["display_id"] for m in updates} == {display_id}
    live = [m["content"]["data"]["text/html"] for m in updates[:-1]]
    assert all("gpunb-live" in frame for frame in live)
    assert any("<table class='gpunb-epochs'>" in frame and "<polyline" in "".join(charts_in(frame)) for frame in live)
    assert not any("application/vnd.jupyter.widget-view+json" in m["content"].get("data", {}) for m in messages)
    final = updates[-1]["content"]["data"]
    assert final["text/plain"].startswith("TrainResult('html-view': completed, 3 epochs, 18 steps")
    assert "gpunb-result" in final["text/html"]
    # nbclient applied the updates: the notebook keeps one output, the summary.
    outputs = notebook.cells[1].outputs
    assert [o.output_type for o in outputs] == ["display_data"]
    assert outputs[0].data["text/plain"] == final["text/plain"]
