"""Continue training: fit(..., continue_from=result) and %%gputrain --continue."""

import pytest
import torch
from conftest import classification_data, mlp
from IPython.core.error import UsageError
from torch import nn
from torch.optim.lr_scheduler import StepLR

from gpunb import Trainer
from gpunb.errors import GpunbError

DATA = classification_data(n=96)  # batch 16: 6 steps an epoch


def fit(model, continue_from=None, optimizer=None, scheduler=None, **options):
    settings = dict(batch_size=16, log_every=2, track=False, accelerator="cpu", epochs=1)
    settings.update(options)
    callbacks = settings.pop("callbacks", ())
    return Trainer(**settings).fit(model, DATA, DATA, optimizer=optimizer, scheduler=scheduler,
                                   loss_fn=nn.CrossEntropyLoss(), continue_from=continue_from,
                                   callbacks=callbacks)


def dropout_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))


def test_two_epochs_then_one_more_equal_three_straight():
    straight_model = dropout_mlp()
    straight = fit(straight_model, epochs=3, ema=0.9)
    model = dropout_mlp()
    first = fit(model, epochs=2, ema=0.9)
    more = fit(model, continue_from=first, epochs=1, ema=0.9)
    assert more.steps == 18 and more.total_steps == 18
    assert [row["step"] for row in more.history] == [row["step"] for row in straight.history]
    assert [row["loss"] for row in more.history] == [row["loss"] for row in straight.history]
    assert [row["epoch"] for row in more.epochs] == [0, 1, 2]
    assert more.continue_state.optimizer is first.continue_state.optimizer  # the default AdamW goes on
    for name, value in straight_model.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
        assert torch.equal(straight.ema_state_dict[name], more.ema_state_dict[name]), name


def test_max_steps_counts_the_steps_added():
    model = mlp()
    first = fit(model, max_steps=4)
    more = fit(model, continue_from=first, max_steps=3, epochs=None)
    assert more.steps == 7 and more.history[-1]["step"] == 7


def test_a_users_scheduler_goes_on_from_where_it_was():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = fit(model, optimizer=optimizer, scheduler=StepLR(optimizer, step_size=4, gamma=0.5), log_every=1)
    more = fit(model, continue_from=first, optimizer=optimizer, log_every=1)
    assert [row["lr"] for row in more.history] == pytest.approx([0.1 * 0.5 ** (s // 4) for s in range(1, 13)])


def test_a_new_schedule_replaces_the_kept_one_over_this_fits_steps():
    model = mlp()
    first = fit(model, lr_schedule="cosine")
    seen = {}

    def factory(optimizer, total_steps):
        seen.update(optimizer=optimizer, total_steps=total_steps)
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)

    more = fit(model, continue_from=first, scheduler=factory, epochs=2)
    assert seen == {"optimizer": first.continue_state.optimizer, "total_steps": 12}
    assert more.steps == 18


def test_a_kept_cosine_schedule_is_stretched_with_a_warning():
    model = mlp()
    first = fit(model, lr_schedule="cosine")
    assert first.history[-1]["lr"] == 0.0
    with pytest.warns(RuntimeWarning, match="planned for 6 steps and the continued run has 12"):
        more = fit(model, continue_from=first)
    assert all(row["lr"] > 0 for row in more.history if 6 < row["step"] < 12)


def test_a_kept_one_cycle_schedule_past_its_end_is_refused():
    model = mlp()
    first = fit(model, lr_schedule="one-cycle")
    with pytest.raises(GpunbError, match="one-cycle schedule planned for 6 steps") as error:
        fit(model, continue_from=first)
    assert "`lr_schedule='cosine'`" in error.value.hint


def test_another_model_is_refused():
    first = fit(mlp())
    with pytest.raises(GpunbError, match="result of a fit of another model") as error:
        fit(mlp(), continue_from=first)
    assert "same model object" in error.value.hint


def test_another_optimizer_is_refused():
    model = mlp()
    first = fit(model)
    with pytest.raises(GpunbError, match="another optimizer was given"):
        fit(model, continue_from=first, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("options, message", [
    (dict(resume="last", checkpoint_dir="unused"), "continue_from and resume were both given"),
    (dict(devices=2), "works in one process only"),
])
def test_settings_that_cannot_continue_are_refused(options, message):
    model = mlp()
    first = fit(model)
    with pytest.raises(GpunbError, match=message):
        fit(model, continue_from=first, **options)


def test_something_that_is_not_a_result_is_refused():
    model = mlp()
    with pytest.raises(GpunbError, match="needs the TrainResult of an earlier one-process fit"):
        fit(model, continue_from={"step": 3})
    first = fit(model)
    first.continue_state = None  # freed, or a multi-process fit's result
    with pytest.raises(GpunbError, match="ran in several processes or was not kept"):
        fit(model, continue_from=first)


CELL = "model = mlp()\ntrain_data = (x, y)\nloss_fn = nn.CrossEntropyLoss()\n"
OPTIONS = "--batch-size 16 --log-every 2 --quiet --no-track"


def test_gputrain_continue_goes_on_from_the_last_fit(ip):
    ip.run_cell_magic("gputrain", f"--epochs 2 {OPTIONS}", CELL)
    first = ip.user_ns["gputrain_result"]
    ip.run_cell_magic("gputrain", f"--continue --epochs 1 {OPTIONS}", "# the model of the cell above")
    more = ip.user_ns["gputrain_result"]
    assert more.steps == 18 and [row["epoch"] for row in more.epochs] == [0, 1, 2]
    assert more.history[:len(first.history)] == first.history
    assert more.continue_state.optimizer is first.continue_state.optimizer


def test_gputrain_continue_without_a_previous_fit_is_refused(ip):
    with pytest.raises(UsageError, match="no %%gputrain has trained in this kernel yet") as error:
        ip.run_cell_magic("gputrain", f"--continue {OPTIONS}", CELL)
    assert "without `--continue`" in str(error.value)


def test_gputrain_continue_on_a_new_model_is_refused(ip):
    ip.run_cell_magic("gputrain", f"--epochs 1 {OPTIONS}", CELL)
    with pytest.raises(UsageError, match="result of a fit of another model"):
        ip.run_cell_magic("gputrain", f"--continue {OPTIONS}", CELL)  # the cell builds a new model


def test_gputrain_continue_after_the_result_was_deleted_is_refused(ip):
    import gc

    ip.run_cell_magic("gputrain", f"--epochs 1 {OPTIONS}", CELL)
    del ip.user_ns["gputrain_result"]  # the optimizer state lives only as long as the result
    gc.collect()
    with pytest.raises(UsageError, match="its result, which holds the optimizer state, was deleted"):
        ip.run_cell_magic("gputrain", f"--continue {OPTIONS}", "# go on")


@pytest.mark.parametrize("option", ["--export out.py", "--find-lr"])
def test_gputrain_continue_with_export_or_find_lr_is_refused(ip, option):
    with pytest.raises(UsageError, match=f"--continue trains on from the last fit, and {option.split()[0]}"):
        ip.run_cell_magic("gputrain", f"--continue {option} {OPTIONS}", CELL)


def test_gputrain_continue_after_a_multi_process_fit_is_refused(ip):
    from gpunb import TrainConfig
    from gpunb.notebook import session

    session.LAST_TRAIN = session.LastTrain(TrainConfig(devices=2), {"model": "model"}, None)
    with pytest.raises(UsageError, match="ran in several processes, which keep no optimizer here"):
        ip.run_cell_magic("gputrain", f"--continue {OPTIONS}", CELL)


def test_the_dashboard_of_a_continued_fit_draws_on_from_the_earlier_points():
    pytest.importorskip("ipywidgets")
    from gpunb.notebook.dashboard import Dashboard

    model = mlp()
    first = fit(model, epochs=2)
    dashboard = Dashboard(min_interval_s=0)
    Trainer(batch_size=16, log_every=2, track=False, epochs=1).fit(
        model, DATA, DATA, loss_fn=nn.CrossEntropyLoss(), callbacks=[dashboard], continue_from=first)
    assert [step for step, _ in dashboard.train_points] == [row["step"] for row in first.history] + [14, 16, 18]
    assert [step for step, _ in dashboard.val_points] == [6, 12, 18]
    assert [row["epoch"] for row in dashboard.epoch_rows] == [0, 1, 2]


def test_a_pickled_result_leaves_the_continue_state_behind():
    import pickle

    first = fit(mlp())
    assert first.continue_state is not None
    assert pickle.loads(pickle.dumps(first)).continue_state is None


class FailAt:
    """A callback that raises at a step, as a bug in user code would."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, state):
        if state.step == self.step:
            raise ValueError(f"failed at step {state.step}")


def weights(model):
    return {name: value.clone() for name, value in model.state_dict().items()}


def test_a_result_continued_once_is_refused_and_names_the_newer_fit():
    model = mlp()
    first = fit(model, lr_schedule="cosine")
    more = fit(model, continue_from=first)
    before = weights(model)
    with pytest.raises(GpunbError, match="already continued by the fit of 'Sequential' that went on from "
                                         "step 6 to step 12") as error:
        fit(model, continue_from=first)
    assert "`gputrain_result`" in error.value.hint
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in before.items())
    assert fit(model, continue_from=more).steps == 18  # the newer result goes on


def test_a_failed_continuation_puts_everything_back_so_the_next_one_is_exact():
    reference_model = dropout_mlp()
    reference_first = fit(reference_model, lr_schedule="cosine", ema=0.9)
    reference = fit(reference_model, continue_from=reference_first, ema=0.9)
    model = dropout_mlp()
    first = fit(model, lr_schedule="cosine", ema=0.9)
    # two epochs stretch the kept cosine schedule; the failure comes 3 steps in
    with (pytest.warns(RuntimeWarning, match="back as they were at step 6"),
          pytest.raises(ValueError, match="failed at step 9")):
        fit(model, continue_from=first, ema=0.9, epochs=2, callbacks=[FailAt(9)])
    more = fit(model, continue_from=first, ema=0.9)
    assert [row["lr"] for row in more.history] == [row["lr"] for row in reference.history]
    assert [row["loss"] for row in more.history] == [row["loss"] for row in reference.history]
    assert more.steps == 12 and more.continue_state.ema.updates == 12
    for name, value in reference_model.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
        assert torch.equal(reference.ema_state_dict[name], more.ema_state_dict[name]), name
    optimizer = more.continue_state.optimizer
    assert all(float(state["step"]) == 12 for state in optimizer.state.values())


def test_gputrain_continue_after_a_failed_continue_goes_on_from_where_both_started(ip):
    ip.run_cell_magic("gputrain", f"--epochs 1 {OPTIONS}", CELL)
    ip.user_ns["FailAt"] = FailAt
    with (pytest.warns(RuntimeWarning, match="back as they were at step 6"),
          pytest.raises(ValueError, match="failed at step 8")):
        ip.run_cell_magic("gputrain", f"--continue {OPTIONS}", "callbacks = [FailAt(8)]")
    ip.run_cell_magic("gputrain", f"--continue {OPTIONS}", "callbacks = []")
    more = ip.user_ns["gputrain_result"]
    optimizer = more.continue_state.optimizer
    assert more.steps == 12 and all(float(state["step"]) == 12 for state in optimizer.state.values())


def test_a_users_one_cycle_continued_past_its_end_is_refused_before_training():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = fit(model, optimizer=optimizer,
                scheduler=lambda opt, n: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=n))
    before = weights(model)
    with pytest.raises(GpunbError, match="OneCycleLR built for 6 steps") as error:
        fit(model, continue_from=first, optimizer=optimizer)
    assert "schedule of its own" in error.value.hint
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in before.items())


def test_a_fit_stopped_mid_epoch_continues_by_ending_that_epoch_exactly():
    from test_checkpoint import StopAt

    spec = {"scheduler": lambda opt, n: StepLR(opt, step_size=1, gamma=0.5), "interval": "epoch"}
    straight_model = dropout_mlp()
    straight = fit(straight_model, scheduler=spec, epochs=3, log_every=1)
    model = dropout_mlp()
    stopped = fit(model, scheduler=spec, epochs=3, log_every=1, callbacks=[StopAt(4)])
    assert stopped.steps == 4 and stopped.epochs == []
    more = fit(model, continue_from=stopped, epochs=2, log_every=1)  # the rest of epoch 0, then 2 more
    assert [row["epoch"] for row in more.epochs] == [0, 1, 2] and more.steps == 18
    assert [row["lr"] for row in more.history] == [row["lr"] for row in straight.history]
    assert [row["val_loss"] for row in more.validations] == [row["val_loss"] for row in straight.validations]
    for name, value in straight_model.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
