"""gpunb.render: the one place that turns results into HTML, text and plots."""

import ast
import io
import re
from pathlib import Path

from conftest import charts_in

import gpunb
from gpunb.charts import sparkline
from gpunb.render import ProgressPrinter, html_table
from gpunb.runtime.probes.lr_find import LRFinderResult
from gpunb.runtime.result import TrainResult

PACKAGE = Path(gpunb.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_runtime_holds_no_display_code():
    for path in (PACKAGE / "runtime").glob("*.py"):
        source = path.read_text()
        for marker in ("<table", "<svg", "<div", "import matplotlib", "sys.stdout", "class ProgressPrinter"):
            assert marker not in source, f"{path.name} contains {marker!r}"
        assert not {name for name in _imports(path) if name.startswith(("gpunb.charts", "IPython"))}, path.name


def test_render_sits_beside_charts_below_the_runtime():
    imported = _imports(PACKAGE / "render.py") | _imports(PACKAGE / "charts.py")
    assert not {name for name in imported if name.split(".")[0] == "torch" or name.startswith(
        ("gpunb.runtime", "gpunb.notebook", "gpunb.distributed", "gpunb.profiling", "gpunb.runs"))}


def test_one_html_table_escapes_cells_but_keeps_raw_columns():
    page = html_table([("<b>", "<i>x</i>")], ("a&b", "c"), raw=(1,), row_titles=["it's"])
    assert "<th style='text-align:left;padding:0 .8em 0 0'>a&amp;b</th>" in page
    assert "&lt;b&gt;" in page and "<i>x</i>" in page and "title='it&#x27;s'" in page
    assert page.count("<tr") == 2


def test_a_key_value_table_heads_each_row_with_its_key():
    page = html_table([("device", "cpu")], key_column=True, css_class="k")
    assert page.startswith("<table class='k'>") and "<thead>" not in page
    assert re.search(r"<th[^>]*>device</th><td[^>]*>cpu</td>", page)


def test_results_render_through_render_without_the_extension():
    result = TrainResult("r", history=[{"step": 1, "epoch": 0, "loss": 0.5}], steps=1, samples=8)
    assert result._repr_html_().startswith("<div class='gpunb-result'><b>r</b>")
    assert repr(result).startswith("TrainResult('r': completed, 0 epochs, 1 steps, 8 samples")
    finder = LRFinderResult(lrs=[1e-4, 1e-3], losses=[1.0, 0.5], suggestion=1e-4)
    assert repr(finder) == ("LRFinderResult: suggested lr 1.00e-04 after 2 steps (1e-04 to 1e-03)\n"
                            "Apply it with: %%gputrain --lr 1.00e-04")
    assert charts_in(finder._repr_html_()) and "Apply it with" in finder._repr_html_()


def test_the_sparkline_spans_its_box():
    svg = sparkline([0.0, 5.0, 10.0], width=100, height=32)
    assert "points='0.0,30.0 50.0,16.0 100.0,2.0'" in svg
    assert "points='0.0,30.0 100.0,30.0'" in sparkline([3.0, 3.0], width=100)  # flat: no division by zero


def test_the_progress_printer_writes_one_line_per_epoch_off_a_tty():
    stream = io.StringIO()

    class State:
        epoch = 1

    printer = ProgressPrinter(stream=stream)
    printer.on_epoch_end(State(), {"train_loss": 0.25, "epoch": 1})
    printer.on_fit_end(State())
    assert stream.getvalue() == "epoch 2: train_loss 0.25\n"


def test_stored_charts_are_images_that_untrusted_front_ends_keep():
    # Sanitizers (JupyterLab, Notebook 7, GitHub) drop inline <svg> from an untrusted notebook's
    # HTML and leave its labels as loose text; an <img> of the SVG survives them.
    history = [{"step": s, "epoch": 0, "loss": 1.0 / s} for s in range(1, 40)]
    result = TrainResult("run<1>", history=history, steps=39, samples=39 * 8,
                         validations=[{"step": 39, "val_loss": 0.05}])
    markup = result._repr_html_()
    assert "<svg" not in markup
    (svg,) = charts_in(markup)
    assert svg.startswith("<svg") and svg.count("<polyline") == 1 and "val loss" in svg
    assert "currentColor" not in svg  # the page's colour does not reach into an image
    assert re.search(r"<img src='data:image/svg\+xml;base64,[^']+' width='510' height='210' alt='loss of run&lt;1&gt;'",
                     markup)
    assert markup == result._repr_html_()  # the same bytes each time: stored outputs compare


def test_compute_reads_in_a_unit_of_its_size():
    from gpunb.render import compute_text

    assert compute_text(40.0, 0.04, 989) == "40 TFLOPS, MFU 4.0% of 989"
    assert compute_text(0.000808, None, None) == "808 MFLOPS"  # a CPU run: not "0.000808 TFLOPS"
    assert compute_text(1.43e-05, None, None) == "14.3 MFLOPS"
    assert compute_text(0.5, None, None) == "500 GFLOPS"


def test_the_best_checkpoint_line_says_whether_it_was_loaded():
    from gpunb.render import best_text

    best = dict(best_monitor="val_loss", best_value=0.25, best_step=40)
    kept = best_text(TrainResult("r", restored_best=False, **best))
    assert kept == "val_loss=0.25 at step 40 (on disk; restore_best=True would load it at the end)"
    assert "restored into the model" in best_text(TrainResult("r", restored_best=True, **best))
