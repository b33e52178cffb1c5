"""Your own scheduler: per step, per epoch, on a plateau; factories; checkpoints; errors; the magic."""

import pytest
import torch
from conftest import classification_data, mlp
from IPython.core.error import UsageError
from test_checkpoint import StopAt
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

from gpunb import Trainer
from gpunb.errors import GpunbError

DATA = classification_data(n=96)  # batch 16: 6 steps an epoch


def fit(model, scheduler=None, optimizer=None, val=None, **options):
    settings = dict(batch_size=16, log_every=1, track=False, accelerator="cpu", epochs=2)
    settings.update(options)
    callbacks = settings.pop("callbacks", ())
    return Trainer(**settings).fit(model, DATA, val, optimizer=optimizer, scheduler=scheduler,
                                   loss_fn=nn.CrossEntropyLoss(), callbacks=callbacks)


def lrs(result):
    return [row["lr"] for row in result.history]


def test_a_scheduler_object_steps_after_every_optimizer_step():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = fit(model, StepLR(optimizer, step_size=4, gamma=0.5), optimizer)
    assert lrs(result) == pytest.approx([0.1 * 0.5 ** (step // 4) for step in range(1, 13)])


def test_a_factory_gets_the_default_optimizer_and_the_run_length():
    seen = {}

    def factory(optimizer, total_steps):
        seen.update(optimizer=optimizer, total_steps=total_steps)
        return torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=total_steps)

    result = fit(mlp(), factory, lr=0.01)
    assert isinstance(seen["optimizer"], torch.optim.AdamW) and seen["total_steps"] == result.total_steps == 12
    assert lrs(result)[-1] == 0.0 and lrs(result)[5] == pytest.approx(0.01 * 6 / 12)


def test_an_epoch_interval_steps_once_an_epoch():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = {"scheduler": StepLR(optimizer, step_size=1, gamma=0.1), "interval": "epoch"}
    result = fit(model, schedule, optimizer, epochs=3)
    by_epoch = {row["epoch"]: row["lr"] for row in result.history}
    assert by_epoch == pytest.approx({0: 0.1, 1: 0.01, 2: 0.001})


def test_reduce_on_plateau_steps_with_the_monitored_validation_metric():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # mode="max" on a falling val_loss: every validation after the first is "no improvement"
    plateau = ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
    result = fit(model, {"scheduler": plateau, "monitor": "val_loss"}, optimizer, val=DATA, epochs=4)
    losses = [row["val_loss"] for row in result.epochs]
    assert losses == sorted(losses, reverse=True)
    by_epoch = {row["epoch"]: row["lr"] for row in result.history}
    assert by_epoch == pytest.approx({0: 0.1, 1: 0.1, 2: 0.05, 3: 0.025})


def test_reduce_on_plateau_with_a_metric_validation_lacks_is_refused_before_training():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GpunbError, match="monitors 'val_f1', and validation produces only `val_loss`, `val_acc`"):
        fit(model, {"scheduler": ReduceLROnPlateau(optimizer), "monitor": "val_f1"}, optimizer, val=DATA)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step was taken


def test_reduce_on_plateau_without_validation_data_is_refused():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GpunbError, match="has no `val_data`"):
        fit(model, ReduceLROnPlateau(optimizer), optimizer)


def test_a_scheduler_on_another_optimizer_is_refused():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GpunbError, match="built on another optimizer") as error:
        fit(model, StepLR(other, step_size=1), optimizer)
    assert "factory" in error.value.hint
    with pytest.raises(GpunbError, match="built on another optimizer"):
        fit(model, StepLR(other, step_size=1))  # the default AdamW is not `other` either


def test_both_a_scheduler_and_lr_schedule_are_refused():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GpunbError, match="Both `scheduler` and `lr_schedule='cosine'`"):
        fit(model, StepLR(optimizer, step_size=1), optimizer, lr_schedule="cosine")


@pytest.mark.parametrize("spec, message", [
    (3, "must be a torch LR scheduler or a factory"),
    (lambda opt, n: "nope", "factory returned a str"),
    ({"sched": None}, "takes the keys"),
    ({"scheduler": lambda opt, n: None, "interval": "batch"}, "interval must be 'step' or 'epoch'"),
])
def test_bad_scheduler_specs_are_refused(spec, message):
    with pytest.raises(GpunbError, match=message):
        fit(mlp(), spec)


def factory(optimizer, total_steps):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)


@pytest.mark.parametrize("interval, stop", [("step", 4), ("epoch", 6)])
def test_a_scheduler_is_saved_and_resumed_exactly(tmp_path, interval, stop):
    spec = {"scheduler": factory, "interval": interval}
    straight_model = mlp()
    straight = fit(straight_model, spec, epochs=3)
    fit(mlp(), spec, epochs=3, checkpoint_dir=tmp_path, callbacks=[StopAt(stop)])
    resumed_model = mlp(seed=7)
    resumed = fit(resumed_model, spec, epochs=3, checkpoint_dir=tmp_path, resume="last")
    assert lrs(resumed) == lrs(straight)
    for a, b in zip(straight_model.state_dict().values(), resumed_model.state_dict().values()):
        assert torch.equal(a, b)


def test_reduce_on_plateau_resumes_with_its_count_of_bad_epochs(tmp_path):
    # mode="max" on a falling val_loss, patience 1: a reduction at epochs 2 and 4; stopped after epoch 3,
    # the scheduler has reduced once and counted one bad epoch, which the resumed run must go on from
    def plateau_fit(epochs, **options):
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        plateau = ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=1)
        result = fit(model, {"scheduler": plateau, "monitor": "val_loss"}, optimizer, val=DATA, epochs=epochs,
                     **options)
        return model, plateau, result

    straight_model, straight_plateau, straight = plateau_fit(6)
    _, stopped, _ = plateau_fit(4, checkpoint_dir=tmp_path)
    assert stopped.num_bad_epochs == 1 and stopped.get_last_lr() == [0.05]
    resumed_model, resumed_plateau, resumed = plateau_fit(6, checkpoint_dir=tmp_path, resume="last")
    assert resumed.resumed_from["step"] == 24
    assert {row["epoch"]: row["lr"] for row in resumed.history} == {row["epoch"]: row["lr"] for row in straight.history}
    assert resumed_plateau.state_dict() == straight_plateau.state_dict()  # best, num_bad_epochs, last_epoch, lrs
    for a, b in zip(straight_model.state_dict().values(), resumed_model.state_dict().values()):
        assert torch.equal(a, b)


def test_gputrain_picks_up_a_scheduler_variable(ip):
    ip.run_cell_magic("gputrain", "--epochs 2 --batch-size 16 --log-every 1 --quiet --no-track", """
model = mlp()
train_data = (x, y)
loss_fn = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=6, gamma=0.1)
""")
    result = ip.user_ns["gputrain_result"]
    assert [row["lr"] for row in result.history] == pytest.approx([0.1] * 5 + [0.01] * 6 + [0.001])


def test_gputrain_refuses_a_scheduler_variable_that_is_not_one(ip):
    with pytest.raises(UsageError, match="`scheduler`: `scheduler` must be a torch LR scheduler"):
        ip.run_cell_magic("gputrain", "--epochs 1 --quiet --no-track",
                          "model = mlp()\ntrain_data = (x, y)\nloss_fn = nn.CrossEntropyLoss()\nscheduler = 0.1")


def test_ranks_build_a_factorys_scheduler_on_their_own_optimizer():
    result = Trainer(devices=2, accelerator="cpu", batch_size=8, epochs=1, log_every=1, track=False).fit(
        mlp(), DATA, loss_fn=nn.CrossEntropyLoss(),
        scheduler=lambda opt, n: torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=n))
    assert result.world_size == 2 and result.total_steps == 6
    assert [row["lr"] for row in result.history] == pytest.approx([1e-3 * (1 - s / 6) for s in range(1, 7)])


# -- the cosine shorthand: warm-up, then decay to a floor ------------------------------------------

def cosine_lrs(total, warmup, **ratio):
    """The rate each optimizer step uses under lr_schedule='cosine', and the rate after the last."""
    from gpunb.config import TrainConfig
    from gpunb.runtime.step.schedule import build_schedule

    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    config = TrainConfig(lr_schedule="cosine", warmup_steps=warmup, **ratio)
    schedule = build_schedule(None, optimizer, config, total, None)
    used = []
    for _ in range(total):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.after_step()
    return used, optimizer.param_groups[0]["lr"]


def test_cosine_warms_up_then_decays_to_min_lr_ratio_of_the_rate():
    used, after = cosine_lrs(total=11, warmup=3, min_lr_ratio=0.1)
    assert used[:3] == pytest.approx([0.1 / 3, 0.2 / 3, 0.1])  # linear warm-up; its last step at the full rate
    assert used[3] == pytest.approx(0.1)  # the decay starts from the full rate
    assert used[7] == pytest.approx(0.055)  # halfway through the decay: halfway between rate and floor
    assert all(a > b for a, b in zip(used[3:], used[4:]))  # decreasing all the way
    assert used[-1] > 0.01 and after == pytest.approx(0.01)  # the floor is reached, never passed
    _, to_zero = cosine_lrs(total=11, warmup=3)
    assert to_zero == pytest.approx(0.0, abs=1e-12)  # default: torch's CosineAnnealingLR, HF's "cosine"


def test_a_fit_with_min_lr_ratio_ends_at_the_floor():
    model = mlp()
    result = fit(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), lr_schedule="cosine",
                 warmup_steps=2, min_lr_ratio=0.2)
    assert lrs(result)[1] == pytest.approx(0.1) and lrs(result)[-1] == pytest.approx(0.02)
    assert min(lrs(result)) == pytest.approx(0.02)


@pytest.mark.parametrize("options, message", [
    (dict(min_lr_ratio=1.5), "min_lr_ratio must be a fraction of the learning rate between 0 and 1, got 1.5"),
    (dict(min_lr_ratio=0.1), "min_lr_ratio=0.1 sets where the cosine schedule ends, and lr_schedule is 'none'"),
    (dict(min_lr_ratio=0.1, lr_schedule="one-cycle"), "lr_schedule is 'one-cycle'"),
])
def test_min_lr_ratio_without_the_cosine_schedule_or_out_of_range_is_refused(options, message):
    from gpunb.config import TrainConfig

    with pytest.raises(GpunbError, match=message):
        TrainConfig(**options)


def test_gputrain_takes_min_lr_ratio(ip):
    cell = "model = mlp()\ntrain_data = (x, y)\nloss_fn = nn.CrossEntropyLoss()"
    ip.run_cell_magic("gputrain", "--max-steps 6 --lr-schedule cosine --min-lr-ratio 0.1 --lr 0.1 "
                      "--log-every 1 --no-track --quiet --out res", cell)
    result = ip.user_ns["res"]
    assert result.config["min_lr_ratio"] == 0.1
    assert result.history[-1]["lr"] == pytest.approx(0.01)


class SidebarStopAt:
    """Asks the run registry to stop this run at `step`, as the sidebar's stop button does, and waits
    until the run's writer thread has read the request: the stop lands at that step's log."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, state):
        if state.step == self.step:
            import gc
            import time

            from gpunb.runs.registry import Registry
            from gpunb.runs.writer import RunWriter

            run_id = state.registry_run
            deadline = time.monotonic() + 10
            # The sidebar lists a run once its row is written (the writer's thread makes it while the
            # first steps run); its stop button can be pressed from then on.
            while Registry().get_run(run_id, with_history=False) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert Registry().request_stop(run_id)
            writer = next(o for o in gc.get_objects() if isinstance(o, RunWriter) and o.run_id == run_id)
            deadline = time.monotonic() + 10
            while not writer.stop_requested and time.monotonic() < deadline:
                time.sleep(0.01)


@pytest.mark.parametrize("stopper", [SidebarStopAt, StopAt])
def test_a_stop_mid_epoch_neither_steps_an_epoch_scheduler_nor_validates_the_partial_epoch(tmp_path, stopper):
    spec = {"scheduler": lambda opt, n: StepLR(opt, step_size=1, gamma=0.5), "interval": "epoch"}
    straight_model = mlp()
    straight = fit(straight_model, spec, val=DATA, epochs=3)
    stopped = fit(mlp(), spec, val=DATA, epochs=3, checkpoint_dir=tmp_path, track=True, callbacks=[stopper(4)])
    assert stopped.steps == 4 and stopped.stop_reason in ("stopped from the sidebar", "test stop")
    assert stopped.validations == [] and stopped.epochs == []  # epoch 0 did not end
    assert lrs(stopped) == lrs(straight)[:4]
    resumed_model = mlp(seed=7)
    resumed = fit(resumed_model, spec, val=DATA, epochs=3, checkpoint_dir=tmp_path, resume="last")
    assert lrs(resumed) == lrs(straight)
    assert [row["val_loss"] for row in resumed.validations] == [row["val_loss"] for row in straight.validations]
    for a, b in zip(straight_model.state_dict().values(), resumed_model.state_dict().values()):
        assert torch.equal(a, b)


class InterruptAt(StopAt):
    def on_step_end(self, state):
        if state.step == self.step:
            state.request_stop("interrupted")  # what the loop does after a Ctrl-C


def test_a_ctrl_c_on_an_epochs_last_step_still_ends_that_epoch_so_the_resume_is_exact(tmp_path):
    spec = {"scheduler": lambda opt, n: StepLR(opt, step_size=1, gamma=0.5), "interval": "epoch"}
    straight_model = mlp()
    straight = fit(straight_model, spec, val=DATA, epochs=3)
    stopped = fit(mlp(), spec, val=DATA, epochs=3, checkpoint_dir=tmp_path, callbacks=[InterruptAt(6)])
    assert stopped.interrupted and [row["epoch"] for row in stopped.epochs] == [0]
    resumed_model = mlp(seed=7)
    resumed = fit(resumed_model, spec, val=DATA, epochs=3, checkpoint_dir=tmp_path, resume="last")
    assert lrs(resumed) == lrs(straight)
    assert [row["val_loss"] for row in resumed.validations] == [row["val_loss"] for row in straight.validations]
    for a, b in zip(straight_model.state_dict().values(), resumed_model.state_dict().values()):
        assert torch.equal(a, b)


def one_cycle(optimizer, total_steps):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total_steps)


def test_a_one_cycle_factory_resumed_for_more_epochs_is_refused_before_anything_loads(tmp_path):
    fit(mlp(), one_cycle, epochs=2, checkpoint_dir=tmp_path)
    model = mlp(seed=7)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(GpunbError, match="OneCycleLR built for 12 steps .* this run has 24") as error:
        fit(model, one_cycle, epochs=4, checkpoint_dir=tmp_path, resume="last")
    assert "with the `epochs`/`max_steps` it was saved with" in error.value.hint
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in before.items())


@pytest.mark.parametrize("old_file", [False, True])
def test_a_scheduler_state_of_another_class_is_refused(tmp_path, old_file):
    fit(mlp(), lambda opt, n: StepLR(opt, step_size=3), checkpoint_dir=tmp_path)
    if old_file:  # written before checkpoints named the scheduler's class
        from gpunb.runtime.state.resume_target import find_checkpoint

        path = find_checkpoint("last", tmp_path)
        payload = torch.load(path, weights_only=True)
        del payload["scheduler_type"]
        torch.save(payload, path)
    exponential = lambda opt, n: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)  # noqa: E731
    with pytest.raises(GpunbError, match="holds the state of (StepLR|another scheduler class), and this run's "
                                         "scheduler is ExponentialLR"):
        fit(mlp(), exponential, epochs=3, checkpoint_dir=tmp_path, resume="last")


def linear_decay(optimizer, total_steps):
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.01, total_iters=total_steps)


def test_a_schedule_the_checkpoint_lacks_is_moved_on_to_the_saved_step(tmp_path):
    straight_model = mlp()
    straight = fit(straight_model, linear_decay, torch.optim.SGD(straight_model.parameters(), lr=0.1), epochs=4)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fit(model, None, optimizer, epochs=4, checkpoint_dir=tmp_path, callbacks=[StopAt(5)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="saved without a learning-rate schedule.*moved on to step 5"):
        resumed = fit(model, linear_decay, optimizer, epochs=4, checkpoint_dir=tmp_path, resume="last")
    assert lrs(resumed)[:5] == [0.1] * 5  # trained at a constant rate
    assert lrs(resumed)[5:] == pytest.approx(lrs(straight)[5:])  # then the schedule, ending where planned


def test_a_saved_schedule_this_run_lacks_is_named(tmp_path):
    fit(mlp(), lambda opt, n: StepLR(opt, step_size=4, gamma=0.5), checkpoint_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match=r"holds a learning-rate schedule \(StepLR\) and this run has none"):
        fit(mlp(), None, epochs=3, checkpoint_dir=tmp_path, resume="last")


def test_a_factory_that_builds_other_settings_is_told_the_saved_ones_go_on(tmp_path):
    fit(mlp(), factory, epochs=2, checkpoint_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match=r"CosineAnnealingLR was saved with T_max=12 \(this run built 24\)"):
        fit(mlp(), factory, epochs=4, checkpoint_dir=tmp_path, resume="last")
