"""%%gputrain in a real kernel (nbclient): the dashboard, the final summary, the accuracy."""

import nbformat
import pytest
from conftest import charts_in
from nbclient import NotebookClient

CELLS = [
    "%load_ext gpunb",
    """%%gputrain --epochs 4 --batch-size 32 --lr 0.003 --name kernel-digits --no-track
import torch
from torch import nn
from gpunb.demo import digits_data, digits_cnn
train_data, val_data = digits_data()
torch.manual_seed(0)
model = digits_cnn()
loss_fn = nn.CrossEntropyLoss()""",
    "print(round(gputrain_result.final_metrics['val_acc'], 4), gputrain_result.steps)",
    """model.eval()
with torch.no_grad():
    x, y = val_data
    print('notebook model accuracy', round((model(x).argmax(1) == y).float().mean().item(), 4))""",
]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(notebook, timeout=240, kernel_name="python3").execute()
    return notebook


def test_dashboard_shows_then_becomes_a_static_summary(executed):
    outputs = executed.cells[1].outputs
    displays = [o for o in outputs if o.output_type == "display_data"]
    assert len(displays) == 1, [o.output_type for o in outputs]
    data = displays[0].data
    # nbclient applied the update: the widget's place holds the static summary.
    assert "application/vnd.jupyter.widget-view+json" not in data
    assert "TrainResult('kernel-digits': completed, 4 epochs" in data["text/plain"]
    assert "<polyline" in "".join(charts_in(data["text/html"])) and "val_acc" in data["text/html"]
    assert not [o for o in outputs if o.output_type == "error"]


def test_accuracy_reached_and_model_trained_in_the_notebook(executed):
    accuracy, steps = executed.cells[2].outputs[0].text.split()
    assert float(accuracy) >= 0.95 and int(steps) == 4 * 45
    line = executed.cells[3].outputs[0].text
    assert float(line.split()[-1]) == float(accuracy)
