"""Validation every N optimizer steps: max_steps runs and streams are validated, early stopping
and best checkpoints act on those passes, exact resume neither repeats nor skips one, and
DDP ranks validate at the same steps."""

from pathlib import Path

import pytest
import torch
from conftest import charts_in, classification_data, mlp
from test_checkpoint import StopAt
from torch import nn
from torch.utils.data import IterableDataset

from gpunb import Trainer
from gpunb.runtime.state.checkpoint_files import load_checkpoint
from gpunb.runtime.validation.early_stopping import EarlyStopping


class Stream(IterableDataset):
    """Samples without a length, as a streaming dataset gives them."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return zip(self.x, self.y)


def fit(model, train, callbacks=(), **options):
    x, y = classification_data(n=200)
    config = dict(batch_size=16, track=False, lr=0.01, log_every=4)
    config.update(options)
    return Trainer(**config).fit(model, train, (x[:64], y[:64]), loss_fn=nn.CrossEntropyLoss(),
                                 callbacks=callbacks)


def test_a_stream_under_max_steps_is_validated_every_n_steps():
    x, y = classification_data(n=200)
    heard = []

    class Listen:
        def on_validation_end(self, state, metrics):
            heard.append(state.step)

    result = fit(mlp(), Stream(x, y), callbacks=[Listen()], max_steps=20, val_every_steps=5)
    assert result.steps == 20 and heard == [5, 10, 15, 20]
    assert [row["step"] for row in result.validations] == heard
    assert set(result.validations[0]) >= {"step", "epoch", "val_loss", "val_acc"}
    assert result.final_metrics["val_loss"] == result.validations[-1]["val_loss"]
    assert [step for step, _ in result.loss_series()["val"]] == heard  # the chart's validation points
    # the epoch row shows the epoch's last pass, not a pass of its own
    assert result.epochs[-1]["val_loss"] == result.validations[-1]["val_loss"]
    assert charts_in(result._repr_html_()) and "val_loss=" in repr(result)


def test_without_val_every_steps_validation_stays_at_epoch_ends():
    x, y = classification_data(n=200)
    result = fit(mlp(), (x, y), epochs=2)  # 13 steps an epoch
    assert [row["step"] for row in result.validations] == [13, 26]


def test_early_stopping_acts_on_step_validations():
    x, y = classification_data(n=200)
    noise = torch.randint(0, 3, (200,), generator=torch.Generator().manual_seed(1))
    result = fit(mlp(), (x, noise), callbacks=[EarlyStopping(patience=2)], epochs=50, lr=0.05,
                 val_every_steps=3)
    assert result.stop_reason.startswith("early stopping")
    assert result.steps % 3 == 0 and result.steps == result.validations[-1]["step"]
    assert result.steps < 50 * 13


def test_best_checkpoints_are_taken_at_step_validations(tmp_path):
    x, y = classification_data(n=200)
    result = fit(mlp(), (x, y), epochs=2, val_every_steps=4, checkpoint_dir=tmp_path, save_top_k=2,
                 monitor="val_acc")
    steps = [int(p.name[10:-3]) for p in Path(result.best_checkpoint).parent.glob("best-step-*.pt")]
    assert len(steps) == 2 and all(step % 4 == 0 for step in steps)
    assert result.best_step % 4 == 0


@pytest.mark.parametrize("stop", [8, 6])  # at a validation step, and between two
def test_a_resumed_run_neither_repeats_nor_skips_a_validation(tmp_path, stop):
    x, y = classification_data(n=200)
    options = dict(epochs=2, val_every_steps=4, checkpoint_dir=tmp_path)
    straight = fit(mlp(), (x, y), **{**options, "checkpoint_dir": None})
    stopped = fit(mlp(), (x, y), callbacks=[StopAt(stop)], **options)
    assert [row["step"] for row in stopped.validations] == [s for s in (4, 8) if s <= stop]
    assert load_checkpoint(stopped.checkpoint_path)["validations"] == stopped.validations
    resumed = fit(mlp(seed=3), (x, y), resume="last", **options)
    assert [r["step"] for r in resumed.validations] == [r["step"] for r in straight.validations]
    assert [r["val_loss"] for r in resumed.validations] == [r["val_loss"] for r in straight.validations]
    assert [r.get("val_loss") for r in resumed.epochs] == [r.get("val_loss") for r in straight.epochs]


def test_two_ddp_ranks_validate_at_the_same_steps_as_one_process(tmp_path):
    x, y = classification_data(n=256)
    val = (x[192:], y[192:])
    options = dict(epochs=2, log_every=4, val_every_steps=3, lr=0.01, track=False)
    one = Trainer(batch_size=16, **options).fit(mlp(), (x[:192], y[:192]), val, loss_fn=nn.CrossEntropyLoss())
    two_model = mlp()
    two = Trainer(batch_size=8, devices=2, accelerator="cpu", checkpoint_dir=tmp_path, save_top_k=1,
                  restore_best=True, **options).fit(two_model, (x[:192], y[:192]), val,
                                                    loss_fn=nn.CrossEntropyLoss())
    assert [r["step"] for r in two.validations] == [r["step"] for r in one.validations] == [3, 6, 9, 12, 15, 18, 21, 24]
    for a, b in zip(two.validations, one.validations):
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-5)
    assert two.world_size == 2 and two.restored_best and two.best_step % 3 == 0
    best = load_checkpoint(two.best_checkpoint)["model"]
    for name, value in two_model.state_dict().items():
        assert torch.equal(value, best[name]), name


# --- a setting that cannot fire, and the steps after the last interval


class Heard:
    """The steps at which validation ends, as EarlyStopping and best checkpoints hear them."""

    def __init__(self):
        self.steps = []

    def on_validation_end(self, state, metrics):
        self.steps.append(state.step)


def test_an_interval_longer_than_the_run_warns_and_validates_once_at_the_end(tmp_path):
    x, y = classification_data(n=200)  # 13 steps an epoch, 26 in all
    heard, stopping = Heard(), EarlyStopping(patience=1)
    model = mlp()
    with pytest.warns(UserWarning, match=r"val_every_steps=1000 is more than this run's 26 optimizer steps"
                                         r"(.|\n)*HINT: set `val_every_steps` to at most 26"):
        result = fit(model, (x, y), callbacks=[heard, stopping], epochs=2, val_every_steps=1000,
                     checkpoint_dir=tmp_path, save_top_k=1, restore_best=True)
    assert result.steps == 26 and heard.steps == [26]
    assert [row["step"] for row in result.validations] == [26]
    assert stopping.best == result.validations[0]["val_loss"]  # early stopping judged the pass
    assert result.best_step == 26 and Path(result.best_checkpoint).exists() and result.restored_best
    assert load_checkpoint(result.checkpoint_path)["validations"] == result.validations
    assert result.final_metrics["val_loss"] == result.validations[0]["val_loss"]


def test_the_steps_after_the_last_interval_are_validated_at_the_end(tmp_path):
    x, y = classification_data(n=200)
    result = fit(mlp(), (x, y), epochs=2, val_every_steps=10, checkpoint_dir=tmp_path)
    assert [row["step"] for row in result.validations] == [10, 20, 26]
    assert load_checkpoint(result.checkpoint_path)["validations"][-1]["step"] == 26  # the final save holds it
    assert result.epochs[-1]["val_loss"] == result.validations[-1]["val_loss"]
    aligned = fit(mlp(), (x, y), epochs=2, val_every_steps=13)  # the end is a pass already: not twice
    assert [row["step"] for row in aligned.validations] == [13, 26]
    stopped = fit(mlp(), (x, y), callbacks=[StopAt(15)], epochs=2, val_every_steps=10)
    assert [row["step"] for row in stopped.validations] == [10]  # a run stopped early is not at its end


def test_a_stream_of_unknown_length_is_validated_at_its_end():
    x, y = classification_data(n=200)  # 13 steps, unknown before they are taken
    with pytest.warns(UserWarning, match="has no length"):
        result = fit(mlp(), Stream(x, y), epochs=1, val_every_steps=5)
    assert [row["step"] for row in result.validations] == [5, 10, 13]


def test_epochs_after_the_last_val_every_are_validated_at_the_end(tmp_path):
    x, y = classification_data(n=200)
    result = fit(mlp(), (x, y), epochs=3, val_every=2)
    assert [row["step"] for row in result.validations] == [26, 39]
    assert [row.get("val_loss") is not None for row in result.epochs] == [False, True, True]
    with pytest.warns(UserWarning, match=r"val_every=5 is more than this run's 3 epochs"):
        longer = fit(mlp(), (x, y), epochs=3, val_every=5, checkpoint_dir=tmp_path, save_top_k=1,
                     restore_best=True)
    assert [row["step"] for row in longer.validations] == [39]
    assert longer.best_step == 39 and longer.restored_best


@pytest.mark.parametrize("setting", [dict(val_every_steps=5), dict(val_every=2)])
def test_an_interval_without_validation_data_is_named_before_training(setting):
    x, y = classification_data(n=200)
    name = next(iter(setting))
    heard, told_at_start = Heard(), []

    class AtStart:
        def on_fit_start(self, state):
            told_at_start.extend(str(w.message) for w in caught if "no validation data" in str(w.message))

    with pytest.warns(UserWarning, match=rf"{name}=\d is set but there is no validation data(.|\n)*"
                                         r"HINT: pass `val_data`") as caught:
        result = Trainer(batch_size=16, track=False, epochs=2, **setting).fit(
            mlp(), (x, y), loss_fn=nn.CrossEntropyLoss(), callbacks=[heard, AtStart()])
    assert result.validations == [] and heard.steps == []
    assert len(told_at_start) == 1  # once, before the first step
