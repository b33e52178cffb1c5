"""EMA of the weights: the formula, validation on the average, checkpoints, apply, errors."""

import pytest
import torch
from conftest import classification_data, mlp
from test_checkpoint import StopAt
from torch import nn

from gpunb import Trainer, TrainConfig
from gpunb.demo import digits_cnn, digits_data
from gpunb.errors import GpunbError
from gpunb.runtime.state import checkpoint_files as ckpt
from gpunb.runtime.state.resume_target import find_checkpoint
from gpunb.runtime.step.ema import WeightEma


def fit(model, data, val=None, **options):
    settings = dict(batch_size=16, log_every=2, track=False, accelerator="cpu")
    settings.update(options)
    callbacks = settings.pop("callbacks", ())
    optimizer = settings.pop("optimizer", None) or torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Trainer(**settings).fit(model, data, val, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer,
                                   metrics={"acc": "accuracy"}, callbacks=callbacks)


class Snapshots:
    """The model's parameters after every optimizer step."""

    def __init__(self, model):
        self.model, self.taken = model, []

    def on_step_end(self, state):
        self.taken.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})


@pytest.mark.parametrize("warmup", [True, False])
def test_the_average_follows_the_formula(warmup):
    model = mlp(hidden=4)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    snapshots = Snapshots(model)
    x, y = classification_data(n=64)
    decay = 0.9
    result = fit(model, (x, y), epochs=1, ema=decay, ema_warmup=warmup, callbacks=[snapshots],
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(snapshots.taken) == 4
    expected = start
    for n, weights in enumerate(snapshots.taken):
        d = min(decay, (1 + n) / (10 + n)) if warmup else decay
        expected = {k: d * expected[k] + (1 - d) * weights[k] for k in weights}
    for name, value in result.ema_state_dict.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7)
        assert not torch.equal(value, model.state_dict()[name])


def test_digits_accuracy_with_and_without_ema():
    (x, y), val = digits_data()
    accuracies = {}
    for ema in (None, 0.99):
        torch.manual_seed(0)
        model = digits_cnn()
        result = fit(model, (x, y), val, epochs=2, batch_size=64, log_every=10, ema=ema,
                     optimizer=torch.optim.AdamW(model.parameters(), lr=2e-3))
        accuracies[ema] = result.final_metrics["val_acc"]
        if ema is None:
            assert result.ema_state_dict is None
            plain_losses = [row["loss"] for row in result.history]
        else:
            # Averaging never changes the training itself, only what is validated.
            assert [row["loss"] for row in result.history] == plain_losses
            averaged = digits_cnn()
            averaged.load_state_dict(result.ema_state_dict)
            averaged.eval()
            with torch.no_grad():
                acc = (averaged(val[0]).argmax(1) == val[1]).float().mean().item()
            assert acc == pytest.approx(result.final_metrics["val_acc"], abs=1e-6)  # validated the average
            assert any(not torch.equal(a, b) for a, b in zip(result.ema_state_dict.values(),
                                                            model.state_dict().values()))
    assert accuracies[None] > 0.9 and accuracies[0.99] > 0.9


def test_buffers_are_copied_and_ema_apply_loads_the_average():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    x, y = classification_data(n=64)
    result = fit(model, (x, y), epochs=2, ema=0.9)
    raw = model.state_dict()
    assert torch.equal(result.ema_state_dict["1.running_mean"], raw["1.running_mean"])
    assert result.ema_state_dict["1.num_batches_tracked"] == raw["1.num_batches_tracked"] == 8
    assert not torch.equal(result.ema_state_dict["0.weight"], raw["0.weight"])

    torch.manual_seed(0)
    applied = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    again = fit(applied, (x, y), epochs=2, ema=0.9, ema_apply=True)
    for name, value in applied.state_dict().items():
        assert torch.equal(value, again.ema_state_dict[name]), name
        assert torch.equal(value, result.ema_state_dict[name]), name  # the same run, averaged the same


def test_a_skipped_step_leaves_the_average_alone():
    model = nn.Linear(3, 2)
    ema = WeightEma(model, 0.5, warmup=False)
    before = [a.clone() for a in ema.averaged]
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(taken=torch.tensor(False))
    assert all(torch.equal(a, b) for a, b in zip(ema.averaged, before)) and ema.updates == 1
    ema.update(taken=torch.tensor(True))
    torch.testing.assert_close(ema.averaged[0], 0.5 * before[0] + 0.5 * model.weight.detach())


def test_swapping_in_and_out_keeps_the_parameters_objects():
    model = nn.Linear(3, 2)
    ema = WeightEma(model, 0.9)
    weight = model.weight
    with torch.no_grad():
        model.weight.add_(1.0)
    trained = model.weight.detach().clone()
    with ema.swapped():
        assert not torch.equal(model.weight, trained)
    assert model.weight is weight and torch.equal(model.weight, trained)


def test_resume_with_ema_is_bit_for_bit(tmp_path):
    x, y = classification_data(n=96)
    straight_model = mlp()
    straight = fit(straight_model, (x, y), epochs=3, ema=0.95)
    fit(mlp(), (x, y), epochs=3, ema=0.95, checkpoint_dir=tmp_path, callbacks=[StopAt(9)])
    saved = ckpt.load_checkpoint(find_checkpoint("last", tmp_path))
    assert saved["ema"]["updates"] == 9 and set(saved["ema"]["weights"]) == set(straight_model.state_dict())
    resumed_model = mlp(seed=7)
    resumed = fit(resumed_model, (x, y), epochs=3, ema=0.95, checkpoint_dir=tmp_path, resume="last")
    for name, value in straight.ema_state_dict.items():
        assert torch.equal(value, resumed.ema_state_dict[name]), name
        assert torch.equal(straight_model.state_dict()[name], resumed_model.state_dict()[name]), name
    assert [r["val_loss"] for r in straight.epochs if "val_loss" in r] == \
        [r["val_loss"] for r in resumed.epochs if "val_loss" in r]


def test_resuming_a_checkpoint_without_an_average_starts_one_from_the_resumed_weights(tmp_path):
    x, y = classification_data(n=96)
    fit(mlp(), (x, y), epochs=2, checkpoint_dir=tmp_path, callbacks=[StopAt(6)])
    saved = ckpt.load_checkpoint(find_checkpoint("last", tmp_path))
    assert saved["ema"] is None
    model = mlp(seed=7)
    # One more step with a slow average: it is (nearly) the resumed weights, not the model's own.
    result = fit(model, (x, y), epochs=2, ema=0.9999, ema_warmup=False, checkpoint_dir=tmp_path,
                 resume="last", callbacks=[StopAt(7)])
    assert result.steps == 7
    for name, value in result.ema_state_dict.items():
        torch.testing.assert_close(value, saved["model"][name], rtol=0, atol=1e-4)


@pytest.mark.parametrize("value", [0, 1, 1.5, True, "0.9"])
def test_a_decay_outside_0_1_is_refused(value):
    with pytest.raises(GpunbError, match="ema must be a decay between 0 and 1"):
        TrainConfig(ema=value)


def test_ema_apply_without_ema_is_refused():
    with pytest.raises(GpunbError, match="`ema` is not set") as error:
        TrainConfig(ema_apply=True)
    assert "`ema=0.999`" in error.value.hint


def test_fsdp_with_ema_is_refused_before_any_process_starts():
    model = mlp()
    x, y = classification_data(n=32)
    with pytest.raises(GpunbError, match="ema is not available with strategy='fsdp'") as error:
        Trainer(devices=2, strategy="fsdp", accelerator="cpu", batch_size=8, ema=0.99,
                track=False).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss())
    assert "`strategy='ddp'`" in error.value.hint


def test_ddp_ranks_average_alike_and_send_the_average_back():
    x, y = classification_data(n=64)
    model = mlp()
    result = Trainer(devices=2, accelerator="cpu", batch_size=8, epochs=1, ema=0.9, ema_apply=True,
                     track=False).fit(model, (x, y), loss_fn=nn.CrossEntropyLoss())
    assert result.world_size == 2 and result.continue_state is None
    for name, value in model.state_dict().items():  # rank 0's weights, averaged and applied
        assert torch.equal(value, result.ema_state_dict[name]), name


def test_an_fp16_step_the_loss_scaler_skips_does_not_move_the_average():
    from gpunb.runtime.step.precision import Precision

    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision("16-mixed", torch.device("cpu"))
    ema = WeightEma(model, 0.5, warmup=False)
    before = [a.clone() for a in ema.averaged]
    precision.backward(model(torch.randn(4, 3)).sum() * float("inf"))
    precision.step(optimizer)  # inf gradients: skipped
    ema.update(precision.step_taken)
    assert not precision.step_taken and all(torch.equal(a, b) for a, b in zip(ema.averaged, before))
    optimizer.zero_grad()
    precision.backward(model(torch.randn(4, 3)).sum())
    precision.step(optimizer)
    ema.update(precision.step_taken)
    assert precision.step_taken and not torch.equal(ema.averaged[0], before[0])


CELL = "model = mlp()\ntrain_data = (x, y)\nloss_fn = nn.CrossEntropyLoss()\n"


def test_gputrain_ema_options(ip):
    ip.run_cell_magic("gputrain", "--epochs 1 --batch-size 16 --ema 0.99 --ema-apply --quiet --no-track", CELL)
    result = ip.user_ns["gputrain_result"]
    assert (result.config["ema"], result.config["ema_apply"]) == (0.99, True)
    for name, value in ip.user_ns["model"].state_dict().items():
        assert torch.equal(value, result.ema_state_dict[name]), name


def test_gputrain_refuses_a_bad_decay_with_the_option_to_use(ip):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match=r"ema must be a decay between 0 and 1, got 2\.0") as error:
        ip.run_cell_magic("gputrain", "--ema 2 --quiet --no-track", CELL)
    assert "`--ema 0.999`" in str(error.value)


def test_restore_best_loads_the_averaged_weights_that_were_validated(tmp_path):
    x, y = classification_data(n=96)
    model = mlp()
    result = fit(model, (x, y), (x[:48], y[:48]), epochs=4, ema=0.9, ema_apply=True, checkpoint_dir=tmp_path,
                 save_top_k=1, restore_best=True, monitor="val_loss", mode="max")  # the worst: an early one
    best = ckpt.load_checkpoint(result.best_checkpoint)
    assert result.restored_best and best["ema"] is not None and result.best_step < result.steps
    for name, value in model.state_dict().items():  # the best average, not the last one (ema_apply)
        assert torch.equal(value, best["ema"]["weights"][name]), name


@pytest.mark.cuda
def test_an_update_on_the_gpu_never_waits_for_the_device():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).cuda()
    ema = WeightEma(model, 0.99)
    taken = torch.ones((), dtype=torch.bool, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host-device sync raises
    try:
        ema.update()
        ema.update(taken)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ema.updates == 2


def test_a_compiled_model_validates_the_swapped_in_average():
    x, y = classification_data(n=96)
    model = mlp()
    result = fit(model, (x, y), (x, y), epochs=2, ema=0.9, compile=True)
    averaged = mlp()
    averaged.load_state_dict(result.ema_state_dict)
    with torch.no_grad():
        expected = nn.functional.cross_entropy(averaged(x), y).item()
        raw = nn.functional.cross_entropy(model(x), y).item()
    assert result.final_metrics["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert abs(expected - raw) > 1e-4  # the two differ, so the check above tells them apart
