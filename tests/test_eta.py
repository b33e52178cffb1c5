"""One ETA for every view: estimated at each log over a window of wall time (runtime/eta.py)."""

import time
from types import SimpleNamespace

import pytest
from conftest import classification_data, mlp

from gpunb import Trainer
from gpunb.render import eta_left, progress_line
from gpunb.runtime.eta import WINDOW_S, EtaClock
from gpunb.units import format_duration


def test_one_slow_interval_moves_the_estimate_a_little():
    clock, t, estimates = EtaClock(), 0.0, []
    for step in range(10, 1010, 10):  # 10 steps a second, logged every 10 steps
        t += 1.0 if step != 500 else 4.0  # one interval four times slower (a hiccup)
        seconds, _ = clock.at_log(step, t, 10_000, interval_step_s=0.1)
        estimates.append(seconds)
    before, during = estimates[48], estimates[49]  # around the slow interval
    assert before == pytest.approx((10_000 - 490) * 0.1)
    # the interval alone says 0.4 s a step (4x); over the 30 s window it is 10% more
    assert 1.05 < during / (before - 1.0) < 1.15
    assert estimates[-1] == pytest.approx((10_000 - 1000) * 0.1)  # the hiccup has left the window


def test_validation_counts_once_an_epoch_has_ended():
    clock, t = EtaClock(), 0.0
    for epoch in range(3):  # 100 steps of 0.1 s, then a 5 s validation pass, each epoch
        for step in range(epoch * 100 + 10, epoch * 100 + 110, 10):
            t += 1.0
            seconds, _ = clock.at_log(step, t, 1000, interval_step_s=0.1)
        t += 5.0
        clock.at_epoch_end(t)
    # an epoch takes 15 s for 100 steps: 0.15 s a step, validation included
    seconds, _ = clock.at_log(310, t + 1.0, 1000, interval_step_s=0.1)
    assert seconds == pytest.approx(690 * 0.15, rel=0.02)
    assert WINDOW_S < 15 * 3  # what made the window span an epoch was the epoch, not WINDOW_S


def test_the_estimate_counts_down_between_logs():
    state = SimpleNamespace(eta=(100.0, 1000.0), total_steps=50)
    assert eta_left(state, now=1030.0) == 70.0 and eta_left(state, now=2000.0) == 0.0
    assert eta_left(SimpleNamespace(eta=None, total_steps=50)) is None


def test_the_dashboard_shows_the_runtimes_estimate():
    heard = []

    class Watch:
        def on_log(self, state, row):
            heard.append((state.eta, progress_line(state)))

    x, y = classification_data(n=256)
    Trainer(epochs=2, batch_size=16, log_every=4, track=False).fit(
        mlp(), (x, y), classification_data(n=32, seed=1), loss_fn=__import__("torch").nn.functional.cross_entropy,
        callbacks=[Watch()])
    assert len(heard) == 8
    for (seconds, made_at), line in heard:
        assert 0 <= made_at - time.time() < 1 or made_at <= time.time()
        shown = line.split("ETA ")[1]
        assert shown in {format_duration(max(0.0, seconds - d)) for d in (0.0, 1.0)}, (seconds, line)
    assert heard[-1][0][0] == 0.0  # the last step: nothing left
