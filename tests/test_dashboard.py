"""The live dashboard and the run summary, driven in-process: what they say on small data."""

import re

import pytest
from conftest import charts_in, classification_data, mlp
from torch import nn

from gpunb import Trainer
from gpunb.charts import IMAGE_INK, MAX_CURVE_POINTS, loss_chart
from gpunb.notebook.dashboard import Dashboard
from gpunb.render import progress_line, summary_rows

pytest.importorskip("ipywidgets")


def _fit(epochs=3, callbacks=(), **options):
    x, y = classification_data(n=160)  # 10 steps an epoch at batch 16
    options = {"batch_size": 16, "track": False, "epochs": epochs, **options}
    return Trainer(**options).fit(mlp(), (x, y), (x[:32], y[:32]), loss_fn=nn.CrossEntropyLoss(),
                                  callbacks=list(callbacks))


def _x_ticks(svg: str) -> list[str]:
    return re.findall(r"text-anchor='middle'>([^<]*)</text>", svg)[:-1]  # the last is the axis title


class _StopAt:
    def __init__(self, step, reason):
        self.step, self.reason = step, reason

    def on_step_end(self, state):
        if state.step == self.step:
            state.request_stop(self.reason)


@pytest.fixture(scope="module")
def watched():
    dashboard = Dashboard(min_interval_s=0)
    return dashboard, _fit(callbacks=[dashboard])


def test_the_live_curve_is_the_summarys_curve(watched):
    dashboard, result = watched
    # Same function, same axes: the last live chart reappears in the summary, as an image
    # whose ink is fixed (the page's text colour does not reach into an image).
    assert charts_in(result._repr_html_()) == [dashboard.curve.value.replace("currentColor", IMAGE_INK)]
    assert "<polyline" in dashboard.curve.value and "<circle" not in dashboard.curve.value


def test_step_ticks_are_whole_numbers_from_zero(watched):
    dashboard, _ = watched
    ticks = _x_ticks(dashboard.curve.value)
    assert ticks[0] == "0" and all(t.isdigit() for t in ticks), ticks


def test_a_two_point_run_draws_a_line_on_whole_ticks():
    svg = loss_chart([(1, 0.9), (2, 0.7)], x_max=2)
    assert "<polyline" in svg and "<circle" not in svg
    assert _x_ticks(svg) == ["0", "1", "2"]
    assert "<circle" in loss_chart([(1, 0.9)], x_max=1)  # one point can only be a dot


def test_the_scale_is_decided_on_every_point_not_the_thinned_curve():
    points = [(i, 1.0) for i in range(1, 2 * MAX_CURVE_POINTS)]
    points[1] = (2, 0.001)  # the one low point falls between the kept ones
    assert "(log)" in loss_chart(points)


def test_the_dashboard_shows_an_epoch_table_and_elapsed_time(watched):
    dashboard, result = watched
    table = dashboard.epochs.value
    assert table.count("<tr>") == 1 + 3  # header and one row per epoch, as it ends
    header = re.findall(r"<th[^>]*>([^<]*)</th>", table)
    assert header == ["epoch", "train_loss", "val_loss", "val_acc", "time"]
    first = re.findall(r"<td[^>]*>([^<]*)</td>", table)[:5]
    assert first[:2] == ["1", f"{result.epochs[0]['train_loss']:.4g}"]
    duration = r"(\d+s|\d+m \d\ds|\d+h \d\dm)"  # gpunb.units.format_duration
    assert re.fullmatch(duration, first[4])
    assert re.search(rf"elapsed {duration}", dashboard.status.value)
    assert "epoch" in result._repr_html_() and "gpunb-epochs" in result._repr_html_()


def test_the_progress_line_says_the_elapsed_time():
    state = type("State", (), {})()
    state.__dict__.update(step=5, total_steps=10, progress=0.5, epoch=0, latest={"loss": 0.5},
                          config=type("C", (), {"epochs": 2})(), started_at=0.0)
    assert "elapsed " in progress_line(state) and "loss 0.5" in progress_line(state)
    assert "warming up" not in progress_line(state)


def test_a_stop_request_shows_at_once():
    # A stop asked for (the sidebar, early stopping) redraws the dashboard in the same step,
    # without waiting for the next redraw: the loop ends after it, a checkpoint may follow.
    from types import SimpleNamespace

    dashboard = Dashboard(min_interval_s=3600)
    drawn = []
    dashboard._draw = lambda state, now=None: drawn.append(progress_line(state))
    state = SimpleNamespace(step=5, total_steps=10, progress=0.5, epoch=0, latest={"loss": 0.5},
                            config=SimpleNamespace(epochs=2), started_at=0.0, stop_reason=None, eta=None)
    dashboard._last_draw = __import__("time").monotonic()
    dashboard.on_step_end(state)
    assert drawn == []  # throttled
    state.stop_reason = "stopped from the sidebar"
    dashboard.on_step_end(state)
    assert len(drawn) == 1 and drawn[0].endswith("stopping after this step (stopped from the sidebar)")
    dashboard.on_step_end(state)
    assert len(drawn) == 1  # once


def test_the_first_frame_says_the_run_is_warming_up():
    # Before the first log the dashboard has no loss, no rate and no ETA: it says why it waits.
    state = type("State", (), {})()
    state.__dict__.update(step=0, total_steps=10, progress=0.0, epoch=0, latest={},
                          config=type("C", (), {"epochs": 2})(), started_at=0.0)
    assert progress_line(state).endswith("warming up") and "ETA" not in progress_line(state)


def test_train_loss_is_the_epoch_mean_everywhere_and_the_last_interval_is_loss(watched):
    _, result = watched
    last_epoch = [row for row in result.history if row["epoch"] == 2]
    mean = sum(r["loss"] * r["steps"] for r in last_epoch) / sum(r["steps"] for r in last_epoch)
    assert result.epochs[-1]["train_loss"] == pytest.approx(mean)
    assert result.final_metrics["train_loss"] == result.epochs[-1]["train_loss"]
    assert result.final_metrics["train_loss"] != result.history[-1]["loss"]
    rows = dict(summary_rows(result))
    assert rows["last loss"] == f"{result.history[-1]['loss']:.4g}"
    assert rows["train_loss"] == f"{result.final_metrics['train_loss']:.4g}"


def test_a_run_stopped_within_an_epoch_reports_that_epochs_mean():
    result = _fit(epochs=5, log_every=2, callbacks=[_StopAt(14, "enough")])
    partial = [row for row in result.history if row["epoch"] == 1]
    assert [row["step"] for row in partial] == [12, 14]
    assert result.final_metrics["train_loss"] == pytest.approx(
        sum(r["loss"] for r in partial) / 2)


def test_the_summary_says_how_far_a_stopped_run_got():
    result = _fit(epochs=5, callbacks=[_StopAt(25, "stopped from the sidebar")])
    rows = dict(summary_rows(result))
    assert rows["status"] == "stopped (stopped from the sidebar)"
    assert rows["progress"] == "epoch 3 of 5, step 25 of 50"
    assert "(400 samples, " in rows["wall time"]


def test_an_interrupted_run_says_interrupted_once():
    result = _fit(epochs=2, callbacks=[_StopAt(3, "interrupted")])
    rows = dict(summary_rows(result))
    assert rows["status"] == "interrupted"
    assert repr(result).count("interrupted") == 1
    assert rows["progress"] == "epoch 1 of 2, step 3 of 20"


def test_progress_without_set_epochs_counts_steps_only():
    result = _fit(epochs=None, max_steps=12)
    assert dict(summary_rows(result))["progress"] == "epoch 2, step 12 of 12"
