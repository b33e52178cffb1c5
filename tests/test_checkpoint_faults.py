"""Damaged checkpoints, a run resumed at its end, a continued fit whose model changed, and a
host out of memory: each handled before it costs trained weights, with one clear message."""

import os
import warnings

import pytest
import torch
from conftest import classification_data
from test_checkpoint import StopAt, assert_same_state, dropout_mlp, train
from torch import nn

from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runtime.state.checkpoint_files import list_checkpoints, load_checkpoint

DAMAGES = {
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "random bytes": lambda data: os.urandom(len(data)),
}


def two_checkpoints(tmp_path):
    """A run stopped at step 20 (checkpoints at 10 and 20), and the straight run it is part of."""
    straight = dropout_mlp()
    _, opt_straight = train(straight, epochs=2)
    train(dropout_mlp(), epochs=2, checkpoint_dir=tmp_path, checkpoint_every=10, callbacks=[StopAt(20)])
    older, newest = list_checkpoints(tmp_path)
    assert (older.name, newest.name) == ("step-000000010.pt", "step-000000020.pt")
    return straight, opt_straight, older, newest


def resumed_with_warnings(**options):
    model = dropout_mlp(seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, optimizer = train(model, **options)
    said = [str(w.message) for w in caught if "cannot be read" in str(w.message)]
    return model, optimizer, result, said


@pytest.mark.parametrize("damage", DAMAGES)
def test_an_unreadable_newest_checkpoint_gives_way_to_the_newest_readable_one(tmp_path, damage):
    straight, opt_straight, older, newest = two_checkpoints(tmp_path)
    newest.write_bytes(DAMAGES[damage](newest.read_bytes()))
    model, optimizer, result, said = resumed_with_warnings(epochs=2, checkpoint_dir=tmp_path, resume="last")
    assert result.resumed_from["step"] == 10 and result.resumed_from["path"] == str(older)
    assert len(said) == 1 and str(newest) in said[0] and str(older) in said[0], said
    assert "could run code" not in said[0]
    assert_same_state(straight, opt_straight, model, optimizer)  # exact from step 10 on
    assert newest.exists()  # the damaged file is left as it is


def test_a_directory_given_as_resume_falls_back_too(tmp_path):
    _, _, older, newest = two_checkpoints(tmp_path)
    newest.write_bytes(b"")
    _, _, result, said = resumed_with_warnings(epochs=2, checkpoint_dir=tmp_path, resume=str(older.parent))
    assert result.resumed_from["step"] == 10 and len(said) == 1


def test_an_unreadable_checkpoint_named_by_its_path_is_refused_not_swapped(tmp_path):
    _, _, older, newest = two_checkpoints(tmp_path)
    newest.write_bytes(os.urandom(4096))
    with pytest.raises(GpunbError) as error:
        train(dropout_mlp(), epochs=2, checkpoint_dir=tmp_path, resume=str(newest))
    message = str(error.value)
    assert f"Cannot read the checkpoint {newest}: it is corrupt or not a torch file (4,096 bytes; " in message
    assert "could run code" not in message and "HINT" in message


def test_random_bytes_are_called_unreadable_not_code(tmp_path):
    noise = tmp_path / "noise.pt"
    for seed in range(20):  # whatever opcode the first random byte happens to be
        noise.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8,
                                        generator=torch.Generator().manual_seed(seed)).numpy().tobytes())
        with pytest.raises(GpunbError, match="corrupt or not a torch file") as error:
            load_checkpoint(noise)
        assert "could run code" not in str(error.value), seed


def test_when_no_checkpoint_can_be_read_resume_says_so_and_names_each(tmp_path):
    _, _, older, newest = two_checkpoints(tmp_path)
    older.write_bytes(b"")
    newest.write_bytes(b"\x00not a zip file")
    with pytest.raises(GpunbError) as error:
        train(dropout_mlp(), epochs=2, checkpoint_dir=tmp_path, resume="last")
    message = str(error.value)
    assert "cannot read any of the 2 checkpoints" in message and "corrupt" in message
    assert "step-000000010.pt (0 bytes; EOFError)" in message and "step-000000020.pt (15 bytes;" in message
    assert "HINT: start fresh without `resume`" in message


# ---------------------------------------------------------------- a run resumed at its end
class EpochEnds:
    def __init__(self):
        self.heard = 0

    def on_epoch_end(self, state, row):
        self.heard += 1


@pytest.mark.parametrize("checkpoint_every", [None, 5])  # saved at the epoch's end / at the last step
def test_a_max_steps_run_resumed_at_its_end_trains_no_step(tmp_path, checkpoint_every):
    x, y = classification_data(n=200)  # 13 batches an epoch: step 10 ends the run mid-epoch

    def fit(**options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
        ends = EpochEnds()
        result = Trainer(max_steps=10, batch_size=16, log_every=5, track=False, checkpoint_dir=tmp_path,
                         checkpoint_every=checkpoint_every, **options).fit(
            model, (x, y), (x[:64], y[:64]), loss_fn=nn.CrossEntropyLoss(), callbacks=[ends])
        return model, result, ends.heard

    done, first, heard_first = fit()
    again, resumed, heard_resumed = fit(resume="last")
    assert resumed.resumed_from["step"] == 10 and resumed.steps == 10
    # the epoch's end comes once in all: in the resumed run only when the checkpoint was saved before it
    assert (heard_first, heard_resumed) == (1, 0 if checkpoint_every is None else 1)
    assert all(torch.equal(a, b) for a, b in zip(done.state_dict().values(), again.state_dict().values()))
    assert [row["val_loss"] for row in resumed.epochs] == [row["val_loss"] for row in first.epochs]
    assert len(resumed.validations) == len(first.validations) == 1
    assert load_checkpoint(list_checkpoints(tmp_path)[-1])["step"] == 10
